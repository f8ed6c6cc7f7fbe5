"""Helpers of the Triton export tests: import an exported model.py as Triton's Python backend does, and the
arguments its initialize() gets."""

from __future__ import annotations

import importlib.util
import json
import uuid
from pathlib import Path


def model_config_or_skip():
    """Triton's ModelConfig protobuf module, or skip the test module where tritonclient (or its grpc extra) is missing."""
    import pytest

    from parastream.launcher.errors import ParastreamError
    from parastream.pipeline.triton import model_config_pb2

    try:
        return model_config_pb2()
    except ParastreamError as e:
        pytest.skip(str(e), allow_module_level=True)


def load_model_py(model_dir: Path):
    """Import REPO/NAME/1/model.py the way Triton's Python backend does: from its file."""
    path = Path(model_dir) / "1" / "model.py"
    spec = importlib.util.spec_from_file_location(f"triton_model_{uuid.uuid4().hex}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def initialize_args(model_dir: Path, kind: str = "CPU", device_id: int = 0) -> dict:
    """What the Python backend passes to initialize(): the config as JSON (protobuf's JSON form), instance kind and device."""
    from google.protobuf import json_format

    from parastream.pipeline.triton import read_config

    config = read_config(Path(model_dir) / "config.pbtxt")
    return {
        "model_config": json.dumps(json_format.MessageToDict(config, preserving_proto_field_name=True)),
        "model_instance_kind": kind,
        "model_instance_device_id": str(device_id),
        "model_repository": str(model_dir),
        "model_version": "1",
        "model_name": config.name,
    }


def exported_model_py(bundle, repo: Path, name: str, kind: str = "CPU"):
    """``bundle`` exported as Triton model ``name`` into ``repo`` and its model.py initialized as the Python backend
    does: the TritonPythonModel instance (``finalize()`` it)."""
    from parastream.pipeline.triton import export_triton

    model_dir = export_triton(bundle, repo, name=name)
    model = load_model_py(model_dir).TritonPythonModel()
    model.initialize(initialize_args(model_dir, kind))
    return model


def as_tensorrt_bundle(src, out: Path):
    """The same plan claiming TensorRT engines: what a ``--backend tensorrt`` build writes, byte for byte
    except the engines, which are placeholders (TensorRT is not installable here; the export only copies them)."""
    from parastream.launcher.bundle import Bundle, write_manifest
    from parastream.launcher.plan import Plan

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
