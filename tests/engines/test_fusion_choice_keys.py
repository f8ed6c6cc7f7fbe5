"""A fusion option changes a branch's compiled engine only where the branch holds the nodes it converts: there the
option is in the engine's cache key and engine.json, elsewhere the engine is the same either way (one key; recorded
null, loaded under either choice without compiling).  So a GPU build's alternative with a fusion off compiles the
branches that fusion touches and finds the rest compiled."""

from __future__ import annotations

import pytest
from onnx import TensorProto, helper

from parastream.core import fused_ops
from parastream.launcher.engines import BuildOptions
from parastream.launcher.engines import torch as torch_backend
from parastream.launcher.engines.torch import _compile_at_load_reason, cache_key, choices_that_apply


def _branch(*ops: str):
    """A branch holding one node of each op type named (Conv, Relu, Add, SDPA, GEMM): only the op types matter."""
    nodes = []
    for i, op in enumerate(ops):
        if op == "SDPA":
            nodes.append(helper.make_node(fused_ops.SDPA, ["q", "k", "v"], [f"t{i}"], domain=fused_ops.DOMAIN))
        elif op == "GEMM":
            nodes.append(helper.make_node(fused_ops.GEMM_ACTIVATION, ["x", "w", "b"], [f"t{i}"], domain=fused_ops.DOMAIN))
        else:
            nodes.append(helper.make_node(op, ["x"], [f"t{i}"]))
    g = helper.make_graph(nodes, "b", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])], [])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _key(branch, fuse: bool = True, **opts) -> str:
    return cache_key(branch, [["x", "float16", [1, 4, 8, 8]]], "float16", BuildOptions(**opts), fuse,
                     {"device": "cuda", "arch": "sm_90"}, "inductor")


@pytest.mark.parametrize("ops,option", [(("Conv", "Relu"), "fuse_conv_relu"), (("SDPA",), "fuse_attention"),
                                        (("GEMM",), "fuse_gemm_epilogue")])
def test_an_option_is_in_the_key_only_where_its_nodes_are(ops, option):
    with_nodes, without = _branch(*ops, "Add"), _branch("Add", "Conv" if option != "fuse_conv_relu" else "Add")
    on_off = ({"fuse": True}, {"fuse": False}) if option == "fuse_conv_relu" else ({option: True}, {option: False})
    assert choices_that_apply(with_nodes)[option] and not choices_that_apply(without)[option]
    assert _key(with_nodes, **on_off[0]) != _key(with_nodes, **on_off[1])
    assert _key(without, **on_off[0]) == _key(without, **on_off[1])


def test_a_conv_and_an_epilogue_node_both_needed_for_the_conv_relu_option():
    assert not choices_that_apply(_branch("Conv", "Tanh"))["fuse_conv_relu"]
    assert not choices_that_apply(_branch("Relu", "Add"))["fuse_conv_relu"]
    assert choices_that_apply(_branch("Conv", "Add", "Relu"))["fuse_conv_relu"]  # conv + residual + ReLU
    assert choices_that_apply(_branch("Conv", "Add"))["fuse_conv_relu"]  # conv + residual add as a cuDNN plan
    assert choices_that_apply(_branch("Conv", "Sigmoid", "Mul"))["fuse_conv_relu"]  # conv + SiLU as a cuDNN plan


def _reason(meta: dict, fuse: bool = True, **opts) -> str:
    return _compile_at_load_reason(b"artifact", dict(meta, signature="s", dtype="float16"), elsewhere=False,
                                   signature="s", dtype="float16", fuse_conv_relu=fuse, options=BuildOptions(**opts))


def test_an_engine_recorded_null_loads_under_either_choice():
    null = {"fuse_conv_relu": None, "fuse_attention": None, "fuse_gemm_epilogue": None}
    for fuse in (True, False):
        assert _reason(null, fuse=fuse, fuse_attention=fuse, fuse_gemm_epilogue=fuse) == ""


def test_an_engine_compiled_with_a_fusion_is_compiled_again_for_the_other_choice():
    meta = {"fuse_conv_relu": True, "fuse_attention": True, "fuse_gemm_epilogue": True}
    assert _reason(meta) == ""
    assert "fuse_conv_relu" in _reason(meta, fuse=False)
    assert "fuse_attention" in _reason(meta, fuse_attention=False)
    # an engine file from before the option was recorded was compiled with the fusion on (the only choice then)
    assert "fuse_gemm_epilogue" in _reason({"fuse_conv_relu": True, "fuse_attention": True}, fuse_gemm_epilogue=False)


def test_the_fusion_choices_are_the_options_the_key_leaves_out():
    assert set(torch_backend.FUSION_CHOICES) == set(choices_that_apply(_branch("Add")))
