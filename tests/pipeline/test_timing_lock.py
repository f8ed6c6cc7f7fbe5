"""The GPU timing lock: builds side by side on one GPU take turns while they time (pipeline.bench.gpu_timing_lock)."""

import subprocess
import sys
import tempfile
from pathlib import Path

from parastream.pipeline.bench import gpu_timing_lock

TRY_LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except BlockingIOError:
    sys.exit(3)
"""


def _other_process_can_lock(device: int) -> bool:
    path = Path(tempfile.gettempdir()) / f"parastream-gpu{device}-timing.lock"
    rc = subprocess.run([sys.executable, "-c", TRY_LOCK, str(path)]).returncode
    assert rc in (0, 3)
    return rc == 0


def test_lock_is_held_only_inside_the_block(monkeypatch):
    monkeypatch.delenv("PARASTREAM_GPU_TIMING_LOCK", raising=False)
    with gpu_timing_lock(7):
        assert not _other_process_can_lock(7)
        assert _other_process_can_lock(6)  # one lock per GPU
    assert _other_process_can_lock(7)


def test_lock_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("PARASTREAM_GPU_TIMING_LOCK", "0")
    with gpu_timing_lock(7):
        assert _other_process_can_lock(7)


def test_the_build_option_turns_it_off(monkeypatch):
    """``BuildOptions.gpu_timing_lock`` False (``--no-gpu-timing-lock``): the block runs without the lock."""
    monkeypatch.delenv("PARASTREAM_GPU_TIMING_LOCK", raising=False)
    with gpu_timing_lock(7, enabled=False):
        assert _other_process_can_lock(7)
