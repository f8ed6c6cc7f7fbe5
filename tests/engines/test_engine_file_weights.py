"""A torch engine file's weights.bin as a load reads it (``EngineFile.weights_view``): the stored member's bytes
as a view of the engine file, no copy and no second pass of zipfile's CRC over bytes the bundle's sha256 checked;
the same bytes as zipfile's read."""

from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest

pytest.importorskip("torch")

from parastream.launcher.engines import torch as tb  # noqa: E402
from parastream.launcher.errors import ParastreamError  # noqa: E402

META = {"format": tb.ENGINE_FORMAT, "compiled": None}


def _weights(n=4096, seed=0) -> bytes:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float16).tobytes()


def test_a_stored_weights_member_is_a_view_of_the_engine_file_with_zipfile_s_bytes():
    w = _weights()
    data = tb.pack(META, b"branch-onnx", None, w)
    f = tb.EngineFile(data)
    view = f.weights_view()
    assert isinstance(view, memoryview) and view.obj is data  # the engine file's own bytes, not a copy
    assert bytes(view) == f.weights() == w


def test_a_deflated_weights_member_is_read_by_zipfile():
    """Must not fire: a member pack would not write (deflated) is zipfile's to read, inflated and CRC-checked."""
    w = _weights(seed=1)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("engine.json", '{"format": %d, "compiled": null}' % tb.ENGINE_FORMAT)
        z.writestr(zipfile.ZipInfo(tb.WEIGHTS_MEMBER), w, compress_type=zipfile.ZIP_DEFLATED)
    view = tb.EngineFile(buf.getvalue()).weights_view()
    assert isinstance(view, bytes) and view == w


def test_a_weights_member_whose_local_header_is_damaged_is_one_clear_error():
    data = bytearray(tb.pack(META, b"branch-onnx", None, _weights(seed=2)))
    f = tb.EngineFile(bytes(data))
    at = f._zip.getinfo(tb.WEIGHTS_MEMBER).header_offset
    data[at:at + 4] = b"XXXX"
    with pytest.raises(ParastreamError, match="no local header"):
        tb.EngineFile(bytes(data)).weights_view()


def test_an_engine_without_weights_has_none():
    assert tb.EngineFile(tb.pack(META, b"branch-onnx", None, None)).weights_view() is None
