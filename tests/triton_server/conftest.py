"""The server tier: repositories that ``parastream export-triton`` wrote, served by NVIDIA's real tritonserver.

Every test here is marked ``triton_server``.  Where the server cannot start (no nvidia-pytriton wheel,
no stub for this Python, an interpreter without a shared libpython) the tier skips with the reason,
unless PARASTREAM_REQUIRE_TRITON_SERVER=1 (set by .ci/run), which turns the skip into a failure.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from tritonserver_process import unavailable  # noqa: E402

REQUIRE = "PARASTREAM_REQUIRE_TRITON_SERVER"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).resolve().parent == HERE:
            item.add_marker(pytest.mark.triton_server)


@pytest.fixture(scope="session")
def tritonserver_or_skip():
    """Skip (or, under PARASTREAM_REQUIRE_TRITON_SERVER=1, fail) where tritonserver cannot be started."""
    reason = unavailable()
    if reason is None:
        for module in ("tritonclient.http", "tritonclient.grpc"):
            try:
                __import__(module)
            except Exception as e:  # noqa: BLE001 - tritonclient raises RuntimeError for a missing extra
                reason = f"{module} does not import ({e}): pip install 'tritonclient[grpc,http]'"
                break
    if reason is not None:
        if os.environ.get(REQUIRE) == "1":
            pytest.fail(f"{REQUIRE}=1 but {reason}")
        pytest.skip(reason)
