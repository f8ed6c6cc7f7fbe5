"""Run a native library's risky step in a forked child, so that its crash becomes a one-line error.

ONNX Runtime can die of a signal on some malformed models (a LayerNormalization whose optional bias
is the empty name segfaults while the session is created): in our own process that ends the tool with
no message and possibly a half-written folder.  ``in_child`` runs such a step in a ``fork`` of this
process (the libraries are already imported, so it costs milliseconds), passes a ParastreamError back
through a pipe, and turns a death by signal into a ParastreamError naming the step.  Where ``fork``
does not exist (Windows) the step runs in-process.
"""

from __future__ import annotations

import os
import signal
import sys

from parastream.launcher.errors import ParastreamError

from .interrupts import SIGNALS, Interrupted


_CHILDREN: set[int] = set()


def stop_children() -> None:
    """Kill the children ``in_child`` is still waiting for (the CLI, after an interrupt has unwound: ``in_child``
    kills its own child when the exception passes, so this finds one only if the signal came between the fork
    and that ``try``)."""
    for pid in list(_CHILDREN):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def in_child(step, *args, what: str) -> None:
    """``step(*args)`` in a forked child; its ParastreamError is raised here, as is its death by a signal."""
    Child(step, *args, what=what).wait()


class Child:
    """``step(*args)`` started in a forked child, while this process goes on: ``wait()`` raises the child's
    ParastreamError, or its death by a signal, as ``in_child`` does; ``stop()`` kills it (its result no longer
    needed).  Where ``fork`` does not exist the step runs in-process, in ``wait()``."""

    def __init__(self, step, *args, what: str):
        self.what, self.pid, self._r, self._inline = what, None, None, None
        if not hasattr(os, "fork"):
            self._inline = (step, args)
            return
        sys.stdout.flush()
        sys.stderr.flush()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report and leave without running the parent's cleanups (atexit, finally)
            code = 0
            try:
                for sig in SIGNALS:  # not the parent's handlers (which raise): just die
                    signal.signal(sig, signal.SIG_DFL)
                os.close(r)
                try:
                    step(*args)
                except ParastreamError as e:
                    os.write(w, str(e).encode("utf-8", "replace")[:65536])
                    code = 3
                except BaseException as e:  # noqa: BLE001 - reported by the parent in one line
                    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                    os.write(w, f"{what} failed: {type(e).__name__}: {first}".encode("utf-8", "replace")[:65536])
                    code = 3
            finally:
                os._exit(code)
        os.close(w)
        _CHILDREN.add(pid)
        self.pid, self._r = pid, r

    def wait(self) -> None:
        if self._inline is not None:
            step, args = self._inline
            self._inline = None
            step(*args)
            return
        if self.pid is None:  # waited for or stopped already
            return
        pid, chunks = self.pid, []
        try:
            with os.fdopen(self._r, "rb") as f:
                while chunk := f.read(65536):
                    chunks.append(chunk)
            _, status = os.waitpid(pid, 0)
        except BaseException:  # interrupted (Ctrl-C, SIGTERM): the child goes too
            self._kill(pid)
            raise
        finally:
            _CHILDREN.discard(pid)
            self.pid = self._r = None
        message = b"".join(chunks).decode("utf-8", "replace")
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            if sig in SIGNALS:  # a Ctrl-C reaches the whole process group: the child went first, this process follows
                raise Interrupted(sig)
            name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else f"signal {sig}"
            raise ParastreamError(f"{self.what}: the library crashed ({name}); the model is malformed in a way it does not check")
        if message or os.WEXITSTATUS(status) != 0:
            raise ParastreamError(message or f"{self.what} failed (exit status {os.WEXITSTATUS(status)})")

    def stop(self) -> None:
        """Kill the child and forget its result."""
        self._inline = None
        if self.pid is None:
            return
        pid, r = self.pid, self._r
        self.pid = self._r = None
        try:
            os.close(r)
        except OSError:
            pass
        self._kill(pid)
        _CHILDREN.discard(pid)

    @staticmethod
    def _kill(pid: int) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except OSError:
            pass
