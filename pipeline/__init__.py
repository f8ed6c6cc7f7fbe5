"""parastream.pipeline: the build — load and check, rewrite, schedule, build engines, verify, export.

Python API mirroring the CLI::

    from parastream.pipeline import build
    bundle = build("model.onnx", "out/", backend="onnxruntime", streams=2)
    from parastream.launcher import load
    run = load("out/")
    outputs = run({"input": x})
"""

from parastream.launcher.bundle import Bundle  # noqa: F401
from parastream.launcher.errors import ParastreamError, VerificationError  # noqa: F401

from .build import BuildConfig, build  # noqa: F401
