"""The GPU timing lock: builds side by side on one GPU take turns while they time (pipeline.bench.gpu_timing_lock)."""

import subprocess
import sys
import time

from parastream.launcher import cuda
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
    path = cuda.gpu_lock_path(device)
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


class _BusRuntime:
    """cuda-python's runtime as far as the lock's name needs it: a PCI bus id per ordinal."""

    class cudaError_t:
        cudaSuccess = 0

    def __init__(self, buses):
        self.buses = buses

    def cudaDeviceGetPCIBusId(self, length, device):
        return (0, self.buses[device].encode() + b"\x00" * 3)


def test_one_lock_per_physical_gpu(monkeypatch):
    """Processes that number GPUs differently (each its own CUDA_VISIBLE_DEVICES) name one GPU's lock alike, and
    two GPUs never share one: the file is named by the PCI bus id, else by the ordinal."""
    monkeypatch.setattr(cuda, "_BUS_IDS", {})
    monkeypatch.setattr(cuda, "runtime", lambda: _BusRuntime({0: "00000000:1A:00.0", 1: "00000000:2B:00.0"}))
    monkeypatch.setattr(cuda, "check", lambda result, call: result[1])
    first, second = cuda.gpu_lock_path(0), cuda.gpu_lock_path(1)
    assert first != second and "1A_00_0" in first.name and "2B_00_0" in second.name
    monkeypatch.setattr(cuda, "_BUS_IDS", {})
    monkeypatch.setattr(cuda, "runtime", lambda: _BusRuntime({0: "00000000:2B:00.0"}))  # GPU 1 seen as ordinal 0
    assert cuda.gpu_lock_path(0) == second

    def no_driver():
        raise cuda.BackendUnavailable("no cuda-python")

    monkeypatch.setattr(cuda, "_BUS_IDS", {})
    monkeypatch.setattr(cuda, "runtime", no_driver)
    assert cuda.gpu_lock_path(3).name == "parastream-gpu3-timing.lock"


TRY_TURN = """
import fcntl, os, sys
gate = os.open(sys.argv[1] + ".gate", os.O_RDWR | os.O_CREAT)
lock = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
try:
    fcntl.flock(gate, fcntl.LOCK_EX | fcntl.LOCK_NB)
    fcntl.flock(lock, (fcntl.LOCK_SH if sys.argv[2] == "shared" else fcntl.LOCK_EX) | fcntl.LOCK_NB)
except BlockingIOError:
    sys.exit(3)
"""

HOLD_EXCLUSIVE = """
import sys
from parastream.launcher import cuda
with cuda.gpu_turn(int(sys.argv[1])):
    print("held", flush=True)
"""


def _other_process_gets(device: int, kind: str) -> bool:
    rc = subprocess.run([sys.executable, "-c", TRY_TURN, str(cuda.gpu_lock_path(device)), kind]).returncode
    assert rc in (0, 3)
    return rc == 0


def test_shared_turns_run_beside_each_other_and_an_exclusive_turn_waits_for_them(monkeypatch):
    """Compile workers' GPU runs (shared turns) overlap; a timing (exclusive) waits for those in progress, and
    while it waits no new shared turn starts (the turnstile), so that it is not kept waiting without end."""
    monkeypatch.delenv("PARASTREAM_GPU_TIMING_LOCK", raising=False)
    with cuda.gpu_turn(5, shared=True):
        assert _other_process_gets(5, "shared")
        assert not _other_process_gets(5, "exclusive")
        waiting = subprocess.Popen([sys.executable, "-c", HOLD_EXCLUSIVE, "5"], stdout=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 30
            while _other_process_gets(5, "shared"):  # until the exclusive turn holds the turnstile
                assert time.monotonic() < deadline and waiting.poll() is None
                time.sleep(0.05)
            assert waiting.poll() is None  # it waits for this shared turn
        except BaseException:
            waiting.kill()
            raise
    assert waiting.communicate(timeout=60)[0].strip() == "held" and waiting.returncode == 0
    with cuda.gpu_turn(5):
        assert not _other_process_gets(5, "shared") and not _other_process_gets(5, "exclusive")
    assert _other_process_gets(5, "exclusive")
