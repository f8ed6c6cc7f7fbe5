"""Bundles for the Triton export tests and the pb_utils double (triton_helpers.py loads the exported model.py).

The folder is not called tests/triton: with tests/ on sys.path a folder named ``triton`` would be
found by ``import triton`` (as a namespace package), and torch._dynamo then fails to import on
machines without OpenAI Triton.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import onnx
import pytest
from graphs import three_branch_model, two_output_model
from triton_helpers import as_tensorrt_bundle

from parastream.launcher.bundle import Bundle
from parastream.pipeline import build

HERE = Path(__file__).resolve().parent


def build_ort(tmp_root: Path, model: onnx.ModelProto, name: str, streams: int) -> Bundle:
    path = tmp_root / f"{name}.onnx"
    model.ir_version = 8  # what every onnxruntime reads (the device's older one too)
    onnx.save(model, path)
    return build(path, tmp_root / f"{name}.bundle", backend="onnxruntime", search=False, streams=streams)


@pytest.fixture(scope="session")
def bundles(tmp_path_factory):
    """name -> (bundle, original model): three branches at batch 1 and batch 4, and a two-output chain."""
    root = tmp_path_factory.mktemp("bundles")
    models = {
        "three": (three_branch_model(), 3),
        "three_b4": (three_branch_model(batch=4), 3),
        "two_output": (two_output_model(), 2),
    }
    out = {name: (build_ort(root, m, name, s), m) for name, (m, s) in models.items()}
    out["three_trt"] = (as_tensorrt_bundle(out["three"][0], root / "three_trt.bundle"), out["three"][1])
    return out


@pytest.fixture
def pb_utils(monkeypatch):
    """The pb_utils double, installed as ``triton_python_backend_utils`` for the model.py under test."""
    spec = importlib.util.spec_from_file_location("triton_python_backend_utils", HERE / "triton_python_backend_utils.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", module)
    return module
