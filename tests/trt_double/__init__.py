"""A test double of TensorRT 10's Python API, for checking the TensorRT backend where TensorRT is missing.

``trt_double.tensorrt`` stands in for the ``tensorrt`` module and ``trt_double.host_memory`` for
device memory.  ``install(monkeypatch)`` puts both in place for one test: ``sys.modules["tensorrt"]``
becomes the double, the backend's ``Memory`` becomes host memory, and the backend sees one GPU.
Nothing here is installed or importable as ``tensorrt`` outside such a test.
"""

from __future__ import annotations

import sys

from . import host_memory
from . import tensorrt as fake_tensorrt


def install(monkeypatch):
    from parastream.launcher.engines import tensorrt as backend

    fake_tensorrt.reset()
    host_memory.reset()
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt)
    monkeypatch.setattr(backend, "Memory", host_memory.HostMemory)
    monkeypatch.setattr(backend, "_gpu_check", lambda: None)
    return fake_tensorrt
