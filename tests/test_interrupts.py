"""SIGINT, SIGTERM and SIGHUP unwind a command through its normal cleanup: every temporary folder it made is gone,
no output is half-written, the exit status is 128 + the signal and the last line says what happened.

Real processes (a signal must land in a running program), each with TMPDIR a fresh empty folder; the signal is sent
when a kind of temporary folder appears (the CPU alternatives' scratch folder, the demo's folder, a staging folder
beside the output) or after a random delay."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parastream.pipeline.cli import main

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "models"
MODEL = EXAMPLES / "small_net.onnx"
# the program's own entry (``sys.exit(main())``, as the console script), saying when main is about to run, so that
# a signal lands in the command and not in Python's start-up
ENTRY = "import sys; from parastream.pipeline.cli import main; print('ready', file=sys.stderr, flush=True); sys.exit(main())"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("b") / "bundle"
    assert main(["build", str(MODEL), "-o", str(out), "--backend", "onnxruntime", "--no-search", "--quiet"]) == 0
    return out


def _command(kind: str, work: Path, bundle: Path, model: Path = MODEL) -> tuple[list[str], Path, list[str]]:
    """(arguments, the folder the output goes into, globs there of what a signal may catch half-way)."""
    if kind == "build":
        return ["build", str(model), "-o", str(work / "out"), "--backend", "onnxruntime"], work, [".out.*.partial"]
    if kind == "demo":
        return ["demo", "--backend", "onnxruntime"], work, []
    if kind == "bench":
        return ["bench", str(bundle), "--runs", "300"], work, []
    if kind == "export-triton":
        return ["export-triton", str(bundle), str(work / "repo"), "--name", "m"], work / "repo", [".m.*.partial"]
    raise ValueError(kind)


def interrupt(kind: str, sig: int, tmp: Path, bundle: Path, *, when: str | float, timeout: float = 120.0,
              model: Path = MODEL) -> dict:
    """Run ``kind`` (``build``: of ``model``) with TMPDIR=``tmp``/tmpdir; send ``sig`` once the glob ``when`` matches
    a folder in TMPDIR or beside the output (a str), or ``when`` seconds after main began (a float).  Returns what
    happened."""
    tmpdir, work = tmp / "tmpdir", tmp / "work"
    tmpdir.mkdir(parents=True)
    work.mkdir()
    argv, out_folder, partials = _command(kind, work, bundle, model)
    env = dict(os.environ, TMPDIR=str(tmpdir))
    p = subprocess.Popen([sys.executable, "-c", ENTRY, *argv], cwd=work, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stderr.readline().strip() == "ready"
        t0 = time.monotonic()
        sent = None
        while p.poll() is None and time.monotonic() - t0 < timeout:
            if isinstance(when, str):
                caught = list(tmpdir.glob(when)) + (list(out_folder.glob(when)) if out_folder.is_dir() else [])
                if caught:
                    sent = [c.name for c in caught]
            elif time.monotonic() - t0 >= when:
                sent = when
            if sent is not None:
                p.send_signal(sig)
                break
            time.sleep(0.002)
        out, err = p.communicate(timeout=timeout)
        elapsed = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    # onnxruntime keeps a file .ses (a session id) in TMPDIR on every run, finished or not: not parastream's
    return {"rc": p.returncode, "sent": sent, "stdout": out, "stderr": err, "elapsed": elapsed,
            "tmpdir": sorted(x for x in os.listdir(tmpdir) if x != ".ses"),
            "out_folder": sorted(os.listdir(out_folder)) if out_folder.is_dir() else [],
            "partials": partials}


def check(r: dict, sig: int, kind: str) -> None:
    if r["rc"] == 0:  # the command finished before the signal: nothing to check but that it was not a folder's moment
        assert not isinstance(r["sent"], list), r
        return
    assert r["rc"] == 128 + sig, r
    assert r["tmpdir"] == [], r  # every temporary folder removed
    assert "Traceback" not in r["stderr"], r["stderr"]
    last = r["stderr"].strip().splitlines()[-1]
    what = "interrupted" if sig == signal.SIGINT else f"terminated by {signal.Signals(sig).name}"
    if last.endswith(" was written before it"):  # the signal came while the output was renamed into place, or after
        assert last.startswith(f"parastream: {what}; "), r["stderr"]
        assert r["out_folder"] == [{"build": "out", "export-triton": "m"}[kind]], r
        written = Path(last.split("; ")[1][: -len(" was written before it")])
        if kind == "build":
            from parastream.launcher.bundle import Bundle

            Bundle.open(written)  # complete: every file there, hashes right
        else:
            from parastream.pipeline.triton import validate_repository

            assert validate_repository(written.parent) == []
    else:
        assert last == f"parastream: {what}; nothing was written", r["stderr"]
        assert r["out_folder"] == [], r  # no output, nothing half-written beside it


# (command, signal, when): at the moment each kind of temporary folder appears, and once at a random moment
QUICK = [
    ("build", signal.SIGINT, "parastream-cpu-*"),
    ("build", signal.SIGTERM, ".out.*.partial"),
    ("build", signal.SIGHUP, 1.0),
    ("demo", signal.SIGINT, "parastream-demo-*"),
    ("demo", signal.SIGHUP, "parastream-cpu-*"),
    ("bench", signal.SIGTERM, 0.6),
    ("export-triton", signal.SIGINT, ".m.*.partial"),
]


@pytest.mark.parametrize("kind,sig,when", QUICK, ids=[f"{k}-{s.name}-{w}" for k, s, w in QUICK])
def test_a_signal_removes_every_temporary_folder(kind, sig, when, tmp_path, bundle):
    r = interrupt(kind, sig, tmp_path, bundle, when=when)
    if isinstance(when, str):
        assert r["sent"], f"{when} never appeared: {r}"
        assert r["rc"] == 128 + sig, r["stderr"]
    check(r, sig, kind)


def ten_random_moments(kind: str, tmp: Path, bundle: Path, span: float | None, model: Path = MODEL) -> int:
    """Ten signals to ``kind`` at random moments of its first ``span`` seconds (None: of its run, the shorter of two
    uninterrupted runs first, the first of which warms the disk cache), SIGINT, SIGTERM, SIGHUP in turn, each
    checked; returns how many of the ten were interrupted (the rest finished first)."""
    if span is None:
        runs = [interrupt(kind, signal.SIGINT, tmp / f"whole{i}", bundle, when=float("inf"), model=model) for i in range(2)]
        assert all(r["rc"] == 0 for r in runs), [r["stderr"] for r in runs]
        span = min(r["elapsed"] for r in runs)
    rng = random.Random(f"interrupts-{kind}" + ("" if model == MODEL else f"-{model.name}"))
    interrupted = 0
    for i in range(10):
        sig = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)[i % 3]
        r = interrupt(kind, sig, tmp / str(i), bundle, when=rng.uniform(0.05, span), model=model)
        check(r, sig, kind)
        interrupted += r["rc"] != 0
    return interrupted


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["build", "demo", "bench", "export-triton"])
def test_ten_random_moments_per_command(kind, tmp_path, bundle):
    """Ten signals per command at random moments of its run (SIGINT, SIGTERM, SIGHUP in turn)."""
    assert ten_random_moments(kind, tmp_path, bundle, None) >= 3  # the rest finished first


def test_a_signal_inside_an_import_waits_for_its_end(tmp_path, monkeypatch):
    """An exception raised inside a native library's import aborted the interpreter (torch, SIGABRT): the signal
    is raised once the import is over, and the module is whole."""
    from parastream.pipeline import interrupts

    (tmp_path / "slow_module_for_interrupts.py").write_text(
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(0.3)\nWHOLE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(interrupts.Interrupted) as e:
        with interrupts.signals_raise():
            import slow_module_for_interrupts  # noqa: F401

            time.sleep(5)  # the interrupt comes within RECHECK_S of the import's end
    assert e.value.signum == signal.SIGTERM and e.value.exit_code == 143
    assert sys.modules["slow_module_for_interrupts"].WHOLE
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_an_uninterrupted_block_ends_before_the_signal_is_raised():
    from parastream.pipeline import interrupts

    steps = []
    with pytest.raises(interrupts.Interrupted):
        with interrupts.signals_raise():
            with interrupts.uninterrupted():
                os.kill(os.getpid(), signal.SIGHUP)
                time.sleep(0.1)
                steps.append("renamed")
            steps.append("after")
    assert steps == ["renamed"]
