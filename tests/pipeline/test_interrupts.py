"""SIGINT, SIGTERM and SIGHUP unwind a command through its normal cleanup: every temporary folder it made is gone,
no output is half-written, the exit status is 128 + the signal and the last line says what happened.

Real processes (a signal must land in a running program), each with TMPDIR a fresh empty folder; the signal is sent
when a kind of temporary folder appears (the CPU alternatives' scratch folder, the demo's folder, a staging folder
beside the output) or after a random delay."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
from interrupting import MODEL, check, interrupt, ten_random_moments

from parastream.pipeline.cli import main


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("b") / "bundle"
    assert main(["build", str(MODEL), "-o", str(out), "--backend", "onnxruntime", "--no-search", "--quiet"]) == 0
    return out


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


def test_a_signal_raised_where_python_would_drop_it_is_raised_again():
    """A signal that lands while the garbage collector finalises a generator raises there, where Python prints the
    exception and drops it (a build then finished with status 0 after printing ``Interrupted: 2``): it is raised
    again once the main thread is out, and nothing is printed."""
    import gc

    from parastream.pipeline import interrupts

    def closing():
        try:
            yield
        finally:  # runs when the generator is finalised: the signal lands there
            os.kill(os.getpid(), signal.SIGINT)

    printed = []
    previous, sys.unraisablehook = sys.unraisablehook, printed.append
    try:
        with pytest.raises(interrupts.Interrupted) as e:
            with interrupts.signals_raise():
                g = closing()
                next(g)
                del g
                gc.collect()
                time.sleep(2)  # raised again within RECHECK_S
        assert e.value.signum == signal.SIGINT and printed == []
    finally:
        sys.unraisablehook = previous
