"""Engine backends: tensorrt (production), torch (GPU engines we can run here), onnxruntime (CPU, reference).

Each backend is a module with every member of ``base.Backend`` (``name``, ``suffix``, ``gpu``, the capability
flags, ``available()``, ``Builder``, ``load``, ...; tests/engines/test_backend_contract.py checks each one).
Heavy dependencies are imported lazily,
so every backend module imports everywhere and fails with an install hint only
when it is used.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ..errors import BackendUnavailable
from .base import BuildOptions, BranchEngine, PRECISIONS  # noqa: F401

BACKENDS = ("tensorrt", "torch", "onnxruntime")
_MODULES = {"tensorrt": ".tensorrt", "torch": ".torch", "onnxruntime": ".onnxruntime"}


def get_backend(name: str) -> ModuleType:
    if name not in _MODULES:
        raise BackendUnavailable(f"--backend {name!r} is not one of: auto, {', '.join(BACKENDS)}")
    return importlib.import_module(_MODULES[name], __name__)


def require_backend(name: str) -> ModuleType:
    """The backend module, or BackendUnavailable with its install hint."""
    mod = get_backend(name)
    why = mod.available()
    if why is not None:
        raise BackendUnavailable(f"--backend {name}: {why}")
    return mod


def resolve_backend(name: str) -> ModuleType:
    """``auto`` picks tensorrt, then torch on a GPU, then onnxruntime."""
    if name != "auto":
        return require_backend(name)
    for candidate in BACKENDS:
        try:
            mod = get_backend(candidate)
        except ImportError:
            continue
        if mod.available() is None:
            return mod
    raise BackendUnavailable("no engine backend is available: pip install onnxruntime")
