"""Signals sent to a running ``parastream`` command, and the check of what it left: shared by the interrupt tests
of the example models (tests/test_interrupts.py) and of the public-model corpus (tests/corpus/test_corpus.py).

Real processes (a signal must land in a running program), each with TMPDIR a fresh empty folder; the signal is sent
when a kind of temporary folder appears (the CPU alternatives' scratch folder, the demo's folder, a staging folder
beside the output) or after a delay."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

MODEL = Path(__file__).resolve().parents[1] / "examples" / "models" / "small_net.onnx"
# the program's own entry (``sys.exit(main())``, as the console script), saying when main is about to run, so that
# a signal lands in the command and not in Python's start-up
ENTRY = "import sys; from parastream.pipeline.cli import main; print('ready', file=sys.stderr, flush=True); sys.exit(main())"



def command(kind: str, work: Path, bundle: Path, model: Path = MODEL) -> tuple[list[str], Path, list[str]]:
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
    argv, out_folder, partials = command(kind, work, bundle, model)
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


def ten_random_moments(kind: str, tmp: Path, bundle: Path, span: float | None, model: Path = MODEL) -> int:
    """Ten signals to ``kind`` at random moments of its first ``span`` seconds (None: of its run on this machine, timed
    uninterrupted twice first, the first warming the disk cache, so that a fast or a loaded machine interrupts it as
    often), SIGINT, SIGTERM, SIGHUP in turn, each checked; returns how many of the ten were interrupted (the rest
    finished first)."""
    if span is None:
        runs = [interrupt(kind, signal.SIGINT, tmp / f"whole{i}", bundle, when=float("inf"), model=model) for i in range(2)]
        assert all(r["rc"] == 0 for r in runs), [r["stderr"] for r in runs]
        span = max(0.1, 0.8 * min(r["elapsed"] for r in runs))  # inside the run however fast it goes this time
    rng = random.Random(f"interrupts-{kind}" + ("" if model == MODEL else f"-{model.name}"))
    interrupted = 0
    for i in range(10):
        sig = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)[i % 3]
        r = interrupt(kind, sig, tmp / str(i), bundle, when=rng.uniform(0.05, span), model=model)
        check(r, sig, kind)
        interrupted += r["rc"] != 0
    return interrupted
