"""The scan of an engine's Inductor output code for kernels that read only the engine's weights, work repeated at
every call (``inductor_kernels.weight_only_kernels``: engine.json and report.json record what it finds), on code
written as Inductor writes it."""

from __future__ import annotations

from parastream.launcher.engines.inductor_kernels import weight_only_kernels, weight_only_reads

# the shape of a wrapper.py: kernels defined with their pointer arguments, then ``call`` running them; arg0_1 and
# arg1_1 are weights, arg2_1 the engine's input (DenseNet-121's engine transposed its 3x3 weights this way)
WRAPPER = '''
triton_poi_fused_convolution_2 = async_compile.triton('triton_poi_fused_convolution_2', """
@triton.jit
def triton_poi_fused_convolution_2(in_ptr0, out_ptr0, ynumel, xnumel, YBLOCK : tl.constexpr, XBLOCK : tl.constexpr):
    ynumel = 4096
""", device_str='cuda')

triton_poi_fused_add_relu_3 = async_compile.triton('triton_poi_fused_add_relu_3', """
@triton.jit
def triton_poi_fused_add_relu_3(in_out_ptr0, in_ptr0, in_ptr1, xnumel, XBLOCK : tl.constexpr):
    xnumel = 100
""", device_str='cuda')

triton_poi_fused_cast_4 = async_compile.triton('triton_poi_fused_cast_4', """
@triton.jit
def triton_poi_fused_cast_4(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    xnumel = 100
""", device_str='cuda')

triton_poi_fused_addmm_5 = async_compile.triton('triton_poi_fused_addmm_5', """
@triton.jit
def triton_poi_fused_addmm_5(in_out_ptr0, in_ptr0, xnumel, XBLOCK : tl.constexpr):
    xnumel = 100
""", device_str='cuda')

triton_tem_fused_addmm_t_0 = async_compile.triton('triton_tem_fused_addmm_t_0', """
@triton.jit
def triton_tem_fused_addmm_t_0(in_ptr0, arg_A, arg_B, out_ptr0):
    M = 128
""", device_str='cuda')

class Runner:
    def call(self, args):
        arg0_1, arg1_1, arg2_1 = args
        buf7 = empty_strided_cuda((32, 128, 3, 3), (1152, 1, 384, 128), torch.float16)
        triton_poi_fused_convolution_2.run(arg0_1, buf7, 4096, 9, stream=stream0)
        buf8 = extern_kernels.convolution(arg2_1, buf7, stride=(1, 1))
        triton_poi_fused_convolution_2.run(arg1_1, buf9, 4096, 9, stream=stream0)
        triton_poi_fused_add_relu_3.run(buf8, arg1_1, buf9, 100, stream=stream0)
        triton_poi_fused_cast_4.run(arg2_1, buf10, 100, stream=stream0)
        triton_poi_fused_addmm_5.run(buf11, arg1_1, 100, stream=stream0)
        triton_tem_fused_addmm_t_0.run(arg1_1, arg2_1, arg0_1, buf12, stream=stream0)
'''


def test_kernels_reading_only_weights_are_counted_per_call():
    found = weight_only_kernels(WRAPPER, n_weights=2)
    # the transposes of the two weights; not the epilogue (it reads a buffer too), not the input's cast, not a
    # bias added in place to a product's output (its in_out_ptr is read), not a GEMM template whose operand A
    # is the input (the template's epilogue reads only a weight, a bias: a scan of in_ptr alone counted BERT-base's
    # GEMM templates at --opt-level 5 as weight-only)
    assert found == {"triton_poi_fused_convolution_2": 2}


def test_the_input_is_not_a_weight():
    # with all three arguments counted as weights, the input's cast would be weight-only work too
    assert weight_only_kernels(WRAPPER, n_weights=3) == {"triton_poi_fused_convolution_2": 2,
                                                         "triton_poi_fused_cast_4": 1,
                                                         "triton_tem_fused_addmm_t_0": 1}
    assert weight_only_kernels(WRAPPER, n_weights=0) == {}


def test_the_weights_those_kernels_read_are_named_by_index():
    # both transposes read a weight of their own; the input's cast and the template read the input
    assert weight_only_reads(WRAPPER, n_weights=2) == [0, 1]
    assert weight_only_reads(WRAPPER, n_weights=3) == [0, 1, 2]
    assert weight_only_reads(WRAPPER, n_weights=0) == []
