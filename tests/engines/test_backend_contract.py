"""Every engine backend has every member of ``launcher.engines.base.Backend`` (and its builder every member of
``base.Builder``) with the contract's signature: a member added to the contract, or a backend that drifts from it,
fails here rather than in a build that reaches for it."""

from __future__ import annotations

import inspect
import typing

import pytest

from parastream.launcher.engines import BACKENDS, base, get_backend

FLAGS = ("compiles_for_layout", "builds_side_by_side", "background_compiles", "fuses_conv_relu", "lowers_convolutions",
         "supports_internal_nhwc", "supports_channel_views", "warms_after_load", "compiles_repeats_once")


def _members(protocol) -> tuple[dict[str, object], dict[str, inspect.Signature]]:
    """The protocol's data members (name -> annotation) and methods (name -> signature without ``self``)."""
    data = dict(typing.get_type_hints(protocol, globalns=vars(base))) if protocol is not base.Backend else {
        k: v for k, v in protocol.__annotations__.items()}
    methods = {}
    for name, fn in vars(protocol).items():
        if callable(fn) and not name.startswith("_"):
            sig = inspect.signature(fn)
            methods[name] = sig.replace(parameters=list(sig.parameters.values())[1:])
    return data, methods


def _compatible(want: inspect.Signature, got: inspect.Signature) -> str | None:
    """None when ``got`` takes every parameter of ``want`` by the same name and kind, in order, with a default
    where the contract has one (its value is the backend's: TensorRT's engines default to "cuda"), and anything
    more only with a default."""
    have = list(got.parameters.values())
    if have and have[0].name == "self":
        have = have[1:]
    for i, w in enumerate(want.parameters.values()):
        if i >= len(have):
            return f"lacks {w.name!r}"
        g = have[i]
        empty = inspect.Parameter.empty
        if (g.name, g.kind, g.default is empty) != (w.name, w.kind, w.default is empty):
            return f"parameter {i}: {g} where the contract says {w}"
    extra = [p for p in have[len(want.parameters):] if p.default is inspect.Parameter.empty
             and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return f"needs {extra[0].name!r}, which the contract never passes" if extra else None


def test_the_contract_names_every_capability_flag():
    data, methods = _members(base.Backend)
    assert set(FLAGS) <= set(data) and {"name", "suffix", "gpu"} <= set(data)
    assert {"available", "check_model", "describe_device", "Builder", "load", "slim_engine", "memory_scope", "own_workspaces", "prepare_load",
            "start_workers", "stop_workers", "precompile", "compiling", "hasten", "drop", "cancel_precompile", "background_summary"} == set(methods)


@pytest.mark.parametrize("name", BACKENDS)
def test_each_backend_has_every_member_with_the_contract_s_signature(name):
    mod = get_backend(name)
    data, methods = _members(base.Backend)
    for member in data:
        assert hasattr(mod, member), f"{name} lacks {member}"
    for flag in FLAGS + ("gpu",):
        assert isinstance(getattr(mod, flag), bool), f"{name}.{flag} is not a bool"
    assert mod.tunes_kernels_from is None or (mod.gpu and 0 < mod.tunes_kernels_from <= 5)
    assert mod.name == name and isinstance(mod.suffix, str) and mod.suffix.startswith(".")
    for member, sig in methods.items():
        fn = getattr(mod, member, None)
        assert callable(fn), f"{name} lacks {member}()"
        if member == "Builder":
            continue
        why = _compatible(sig, inspect.signature(fn))
        assert why is None, f"{name}.{member}: {why}"
    _, builder_methods = _members(base.Builder)
    for member, sig in builder_methods.items():
        fn = getattr(mod.Builder, member, None)
        assert callable(fn), f"{name}.Builder lacks {member}()"
        why = _compatible(sig, inspect.signature(fn))
        assert why is None, f"{name}.Builder.{member}: {why}"


@pytest.mark.parametrize("name", BACKENDS)
def test_a_backend_without_background_compiles_does_nothing_in_the_background(name):
    mod = get_backend(name)
    if mod.background_compiles:
        pytest.skip("compiles in the background")
    assert mod.compiling(["k"]) == 0 and mod.drop(["k"]) == 0 and mod.cancel_precompile() == 0 and mod.background_summary(0.0) is None
    assert mod.precompile([]) is None and not mod.compiles_for_layout  # the build never precompiles for it


def test_the_capabilities_say_what_each_backend_does():
    """The flags, not the names, decide: the torch backend compiles for the launcher's layout in the background and
    fuses conv+ReLU; TensorRT and ONNX Runtime build one engine at a time for NCHW bindings."""
    torch_backend, trt, ort = (get_backend(n) for n in ("torch", "tensorrt", "onnxruntime"))
    assert all(getattr(torch_backend, f) for f in FLAGS)
    assert not any(getattr(trt, f) for f in FLAGS) and not any(getattr(ort, f) for f in FLAGS)
