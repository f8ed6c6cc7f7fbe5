"""SIGINT, SIGTERM and SIGHUP while a command runs: an exception in the main thread, so that every ``with``
block and ``finally`` unwinds (temporary folders, the staging folder, children forked by ``isolate``, sessions).

The handler raises :class:`Interrupted` (a KeyboardInterrupt carrying the signal) at once, except where an
exception would do harm; there it notes the signal and raises it as soon as the main thread is out of that place
(re-checked every ``RECHECK_S`` by SIGALRM):

* inside an import: one raised inside torch's import (which polygraphy triggers during verification) aborted the
  interpreter with SIGABRT instead of unwinding;
* inside ``tempfile`` (between ``mkdtemp`` and the object that removes the folder again) or a finaliser
  (``__del__``, ``weakref.finalize``: an exception there is printed and dropped, and the command would go on);
* inside an ``uninterrupted()`` block: a few lines that must not stop half-way (renaming a finished folder into
  place).

Where it is raised anyway in a place that Python reports and drops (``sys.unraisablehook``: a generator or
another object finalised by the garbage collector while the signal lands; a kill trial's build finished with
status 0 after printing ``Interrupted: 2``), it is noted again and raised, as above, once the main thread is out.

Once raised, further signals are noted but do not interrupt the cleanup the first one started.
"""

from __future__ import annotations

import signal
import sys
import tempfile
import threading
import weakref
from contextlib import contextmanager

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
RECHECK_S = 0.05


class Interrupted(KeyboardInterrupt):
    """A command stopped by ``signum``; its exit status is 128 + signum, as a shell gives a process killed by it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = int(signum)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def describe(self) -> str:
        return "interrupted" if self.signum == signal.SIGINT else f"terminated by {signal.Signals(self.signum).name}"


class _State:
    installed = False
    pending: int | None = None  # the first signal, until it is raised
    raised = False
    depth = 0  # nesting of uninterrupted() blocks


_state = _State()
_UNSAFE_FILES = {tempfile.__file__, weakref.__file__}


def _unsafe(frame) -> bool:
    """Whether an exception raised in ``frame`` (the main thread's, where the signal landed) could do harm."""
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith("<frozen importlib") or code.co_filename in _UNSAFE_FILES or code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def _handler(signum, frame):
    if signum in SIGNALS and _state.pending is None and not _state.raised:
        _state.pending = signum
    if _state.pending is None or _state.raised:
        return  # a second signal while the first unwinds, or a stray SIGALRM
    if _state.depth or _unsafe(frame):
        signal.setitimer(signal.ITIMER_REAL, RECHECK_S)  # try again soon
        return
    _raise()


def _raise():
    signum, _state.pending, _state.raised = _state.pending, None, True
    raise Interrupted(signum)


def _unraisable(previous):
    """``sys.unraisablehook`` while signals raise: an ``Interrupted`` that Python would print and drop (raised in a
    finaliser the checks above do not see) is noted again, to be raised within ``RECHECK_S``; anything else goes
    to ``previous``."""

    def hook(unraisable):
        exc = unraisable.exc_value
        if isinstance(exc, Interrupted) and _state.installed:
            _state.pending, _state.raised = exc.signum, False
            signal.setitimer(signal.ITIMER_REAL, RECHECK_S)
            return
        previous(unraisable)

    return hook


@contextmanager
def uninterrupted():
    """A block that a signal does not stop half-way: it is raised when the block ends."""
    _state.depth += 1
    try:
        yield
    finally:
        _state.depth -= 1
        if not _state.depth and _state.pending is not None and not _state.raised and _state.installed:
            _raise()


@contextmanager
def signals_raise(then_ignore: bool = False):
    """While the block runs (in the main thread only, as Python requires), SIGINT, SIGTERM and SIGHUP raise
    :class:`Interrupted`; the previous handlers come back afterwards, or (``then_ignore``: a program about to exit
    with the command's status) the signals are ignored from then on, so that one in the last moments cannot turn a
    finished command into Python's traceback."""
    if threading.current_thread() is not threading.main_thread() or _state.installed:
        yield
        return
    previous = {sig: signal.signal(sig, _handler) for sig in SIGNALS + (signal.SIGALRM,)}
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _unraisable(previous_hook)
    _state.installed, _state.pending, _state.raised, _state.depth = True, None, False, 0
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        _state.installed = False
        sys.unraisablehook = previous_hook
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_IGN if then_ignore and sig in SIGNALS else handler)


def exit_when_threads_linger(code: int, wait_s: float = 2.0) -> None:
    """After an interrupt has unwound: give threads the command started (a thread pool's workers finishing their
    call) ``wait_s`` to end, then leave with ``code`` even if one still runs, instead of Python's exit waiting for it."""
    import os
    import time

    deadline = time.monotonic() + wait_s
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            try:
                t.join(max(0.0, deadline - time.monotonic()))
            except RuntimeError:  # still being started (``enumerate`` lists those too): nothing to wait for yet
                pass
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
