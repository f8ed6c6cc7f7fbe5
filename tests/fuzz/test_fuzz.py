"""The hostile-input harness (bench/fuzz.py): a seeded sample of mutated example models through the CLI, and
kill trials, must give no traceback, signal, hang, leftover beside OUT, wrong build or noisy error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import fuzz  # noqa: E402


@pytest.mark.slow
def test_seeded_sample_and_kill_trials(tmp_path):
    """300 cases over every mutation class and 20 kill trials (SIGKILL, SIGTERM, SIGHUP, SIGINT), ~3 min on 2 cores."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "fuzz.py"), "--cases", "300", "--seed", "1", "--workers", "2",
                        "--kill-trials", "20", "--check", "--out", str(tmp_path / "cases.jsonl")],
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "cases.jsonl").read_text().splitlines()]
    assert len(records) == 300
    assert {r["class"] for r in records} == set(fuzz.CLASSES)
    outcomes = {r["outcome"] for r in records}
    assert outcomes <= {"clean-error", "built-equal"}, outcomes
    assert "built-equal" in outcomes and "clean-error" in outcomes  # the sample exercises both
    summary = json.loads(r.stdout)
    assert sum(summary["kill_trials"].values()) == 20 and all(k.startswith("ok") for k in summary["kill_trials"])


def _case_dir(tmp_path, stderr: str, *extra: str) -> Path:
    d = tmp_path / "case"
    d.mkdir()
    (d / "model.onnx").write_bytes(b"")
    (d / "stderr").write_text(stderr)
    for name in extra:
        (d / name).mkdir()
    return d


@pytest.mark.parametrize("stderr,extra,rc,want", [
    ("parastream build: error: model.onnx: no\n", (), 2, "clean-error"),
    ("[W:onnxruntime] log line\nparastream build: error: model.onnx: no\n", (), 2, "noisy-error"),
    ("parastream build: [   0.1 s] load and check\nparastream build: error: model.onnx: no\n", (), 2, "clean-error"),
    ("Traceback (most recent call last):\n  File x\nValueError: y\n", (), 1, "traceback"),
    ("parastream build: error: model.onnx: no\n", (".out.abc.partial",), 2, "leftover"),
    ("parastream build: error: model.onnx: no\n", ("out",), 2, "leftover"),
    ("", (), 0, "built-wrong"),  # exit 0 without a passing check of the bundle
])
def test_classify(tmp_path, stderr, extra, rc, want):
    """The harness tells the outcomes apart (so that its CI test can fail)."""
    case = fuzz.Case(index=0, cls="bytes", seed_model="x")
    assert fuzz.classify(case, _case_dir(tmp_path, stderr, *extra), "out", rc, None, False)[0] == want


def test_classify_signal_and_hang(tmp_path):
    case = fuzz.Case(index=0, cls="bytes", seed_model="x")
    d = _case_dir(tmp_path, "")
    assert fuzz.classify(case, d, "out", None, 11, False)[0] == "signal"
    assert fuzz.classify(case, d, "out", None, None, True)[0] == "hang"


def test_cases_are_seeded():
    seeds = fuzz.Seeds()
    a = [fuzz.make_case(seeds, 3, i) for i in range(20)]
    b = [fuzz.make_case(seeds, 3, i) for i in range(20)]
    assert [(c.cls, c.what, c.args) for c in a] == [(c.cls, c.what, c.args) for c in b]
    assert [c.model.SerializeToString() if c.model else c.raw for c in a] == \
        [c.model.SerializeToString() if c.model else c.raw for c in b]
