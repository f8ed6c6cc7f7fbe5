"""Bundles for the Triton export tests and the pb_utils double (triton_helpers.py loads the exported model.py).

The folder is not called tests/triton: with tests/ on sys.path a folder named ``triton`` would be
found by ``import triton`` (as a namespace package), and torch._dynamo then fails to import on
machines without OpenAI Triton.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import onnx
import pytest
from graphs import three_branch_model, two_output_model

from parastream.launcher.bundle import Bundle, write_manifest
from parastream.launcher.plan import Plan
from parastream.pipeline import build

HERE = Path(__file__).resolve().parent


def build_ort(tmp_root: Path, model: onnx.ModelProto, name: str, streams: int) -> Bundle:
    path = tmp_root / f"{name}.onnx"
    model.ir_version = 8  # what every onnxruntime reads (the device's older one too)
    onnx.save(model, path)
    return build(path, tmp_root / f"{name}.bundle", backend="onnxruntime", search=False, streams=streams)


def as_tensorrt_bundle(src: Bundle, out: Path) -> Bundle:
    """The same plan claiming TensorRT engines: what a ``--backend tensorrt`` build writes, byte for byte
    except the engines, which are placeholders (TensorRT is not installable here; the export only copies them)."""
    out.mkdir(parents=True)
    (out / "engines").mkdir()
    plan = Plan.from_json(src.plan.to_json())
    plan.backend = "tensorrt"
    for b in plan.branches:
        b.engine = f"engines/{b.name}.plan"
        (out / b.engine).write_bytes(b"placeholder TensorRT engine of " + b.name.encode())
    plan.save(out / "plan.json")
    (out / "model.onnx").write_bytes(src.model_path.read_bytes())
    (out / "report.json").write_text(json.dumps(src.report))
    write_manifest(out, dict(src.manifest, backend="tensorrt"))
    return Bundle.open(out)


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
