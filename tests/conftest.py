"""Shared test set-up: GPU and TensorRT tests skip cleanly where there is no GPU or no TensorRT."""

from __future__ import annotations

import importlib.util

import pytest


def _has_gpu() -> bool:
    from parastream.launcher import cuda_device_count

    if cuda_device_count() > 0:
        return True
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def _has_tensorrt() -> bool:
    return importlib.util.find_spec("tensorrt") is not None


def pytest_sessionstart(session):
    """Refuse at once, in one line, a torchvision that does not import beside the installed torch.

    transformers imports torchvision whenever it is installed, so such a torchvision fails every test that
    builds a transformers model, each with transformers' own "Could not import module 'BertModel'".
    """
    if importlib.util.find_spec("torchvision") is None or importlib.util.find_spec("torch") is None:
        return
    try:
        import torchvision  # noqa: F401
    except Exception as error:  # torchvision raises RuntimeError for ops built against another torch
        from importlib.metadata import PackageNotFoundError, version

        def _version(name):
            try:
                return version(name)
            except PackageNotFoundError:
                return "(no metadata)"

        raise pytest.UsageError(
            f"torchvision {_version('torchvision')} does not import beside torch {_version('torch')} "
            f"({(str(error).splitlines() or [type(error).__name__])[0]}): install the torchvision built for this torch, or uninstall it"
        ) from None


def pytest_collection_modifyitems(config, items):
    import os

    corpus = os.environ.get("PARASTREAM_CORPUS") == "1"
    skip_corpus = pytest.mark.skip(reason="the full corpus tier runs on demand: PARASTREAM_CORPUS=1")
    gpu = _has_gpu()
    trt = _has_tensorrt()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_trt = pytest.mark.skip(reason="needs TensorRT (not installable here; see README)")
    for item in items:
        if item.get_closest_marker("corpus") is not None and not corpus:
            item.add_marker(skip_corpus)
        if "gpu" in item.keywords and not gpu:
            item.add_marker(skip_gpu)
        if "trt" in item.keywords and not trt:
            item.add_marker(skip_trt)
