"""Engines read a wide Concat in place (``torch.POINTWISE_CAT_INPUTS``): a Concat of more than Inductor's default 8
inputs, which convolutions wrote and pointwise ops read (each DenseNet dense layer's), compiles without a copy kernel
per input, and computes what torch does."""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu


class DenseLayerInputs(torch.nn.Module):
    """``n`` convolutions' outputs concatenated and normalised with a ReLU, as a dense layer reads its block; each
    output in two Concats, as each of a block's outputs is in every later layer's.  Without bias, as DenseNet's:
    each output is then a cuDNN call's own buffer, which Inductor copies into a Concat's buffer unless the Concat
    is read in place (a bias is added by a pointwise kernel that both Concats would read, which Inductor writes
    into one Concat's buffer whatever the setting: the first form of this test, with biases, launched as many
    kernels either way)."""

    def __init__(self, n: int):
        super().__init__()
        self.convs = torch.nn.ModuleList(torch.nn.Conv2d(8, 8, 3, padding=1, bias=False) for _ in range(n))
        self.scale = torch.nn.Parameter(torch.rand(1, 8 * n, 1, 1) + 0.5)

    def forward(self, x):
        outs = [c(x) for c in self.convs]
        return (torch.relu(torch.cat(outs, 1) * self.scale + 0.1)
                + torch.relu(torch.cat(outs[::-1], 1) * self.scale - 0.1))


def _launches(module, x, options: dict):
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    with torch.no_grad():
        y, code = run_and_get_code(torch.compile(module, options=options, dynamic=False), x)
    return y, len(re.findall(r"\.run\(", "\n".join(code)))


@pytest.mark.parametrize("n", [12, 25])
def test_a_wide_concat_read_by_pointwise_ops_is_read_in_place(n):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from parastream.launcher.engines.base import BuildOptions
    from parastream.launcher.engines.torch import POINTWISE_CAT_INPUTS, _inductor_options

    assert n <= POINTWISE_CAT_INPUTS
    module = DenseLayerInputs(n).half().cuda().eval()
    x = torch.randn(1, 8, 14, 14, device="cuda").half()
    with torch.no_grad():
        ref = module(x).float()
    engine, in_place = _launches(module, x, _inductor_options(BuildOptions(precision="fp16")))
    default, copied = _launches(module, x, {})
    # Inductor's default copies each convolution's output into each Concat's buffer, a kernel each; the engine's
    # kernels read them where they are
    assert in_place < copied, (in_place, copied)
    for y in (engine, default):
        torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)
