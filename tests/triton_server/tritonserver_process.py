"""NVIDIA's ``tritonserver`` as the ``nvidia-pytriton`` wheel ships it, started on free loopback ports.

Used by the server tier (tests/triton_server) and bench/triton_gpu.py.  This is Triton Inference
Server as NVIDIA builds it (2.51 in pytriton 0.7: ``pytriton/tritonserver/bin/tritonserver``, the
Python backend ``backends/python/libtriton_python.so`` and its stubs for Python 3.8-3.13), run as
it ships; nothing here serves anything itself.  pytriton's own Python API is not used: it wraps
Python callables as models, while we serve repositories that ``parastream export-triton`` wrote.

The one thing to solve is the Python backend's stub.  Each model instance runs in a
``triton_python_backend_stub`` process that embeds libpython3.X, and it must run *this*
interpreter, with the site-packages that hold parastream and its dependencies.  We do what
pytriton's ``TritonServer`` does (pytriton/server/triton_server.py, pytriton/triton.py) plus one
step it leaves to luck:

* the stub built for this Python version is copied into a backend folder of our own
  (``backends/python/triton_python_backend_stub`` beside a copy of ``libtriton_python.so``);
* ``LD_LIBRARY_PATH`` starts with a folder that holds *this* interpreter's libpython and nothing else
  (a link to ``sysconfig``'s LIBDIR/INSTSONAME, beside the stub).  Without it the stub loads whichever
  libpython3.X the dynamic linker finds first: on a build machine with Debian's
  /lib/x86_64-linux-gnu/libpython3.11.so (3.11.2) under a pyenv 3.11.7 venv, a second interpreter
  reading the first one's standard library.  Not LIBDIR itself: where LIBDIR is the system's library
  folder (/usr/lib/x86_64-linux-gnu for Ubuntu's python3.12), every library there would come before
  the ones a package ships, and on the device torch then ran the system's cuDNN 9.14 in the stub
  rather than its own 9.19 (and refused the cuDNN plans a bundle shipped for 9.19).  Then the wheel's
  own libraries (``nvidia_pytriton.libs``), which the copied stub no longer finds through its RPATH;
* ``PATH`` starts with this interpreter's bin folder: the embedded Python finds its prefix, and a
  venv's ``pyvenv.cfg`` with its site-packages, from ``python3`` on PATH (pytriton's method).
  PYTHONPATH passes through unchanged.

An interpreter without a shared libpython (``INSTSONAME`` in its LIBDIR) cannot be embedded by the
stub: ``unavailable()`` says so, and the tier skips (CI sets PARASTREAM_REQUIRE_TRITON_SERVER=1 to
fail instead).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Distribution:
    """Where the wheel put the server: its ``tritonserver`` folder and its bundled libraries."""

    root: Path  # .../site-packages/pytriton/tritonserver
    libs: Path  # .../site-packages/nvidia_pytriton.libs

    @property
    def binary(self) -> Path:
        return self.root / "bin" / "tritonserver"

    @property
    def python_backend(self) -> Path:
        return self.root / "backends" / "python"

    def stub(self, version: str | None = None) -> Path:
        version = version or f"{sys.version_info[0]}.{sys.version_info[1]}"
        return self.root / "python_backend_stubs" / version / "triton_python_backend_stub"


def distribution() -> Distribution | None:
    """The installed nvidia-pytriton wheel's server, without importing pytriton (its import is heavy)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    package = Path(list(spec.submodule_search_locations)[0])
    return Distribution(root=package / "tritonserver", libs=package.parent / "nvidia_pytriton.libs")


def python_library() -> Path | None:
    """This interpreter's shared libpython (what the stub must load), or None when it has none.

    Looked up by the interpreter's own build settings (INSTSONAME in LIBDIR), not by the linker's search
    path, which may hold another build of the same version.  Distributions that link their python3
    statically but ship the same build as libpython3.X.so (Debian's and Ubuntu's libpython3.X packages)
    are found there too.
    """
    name = sysconfig.get_config_var("INSTSONAME")
    libdir = sysconfig.get_config_var("LIBDIR")
    if not name or not libdir or ".so" not in name:
        return None
    for folder in (Path(libdir), Path(libdir) / (sysconfig.get_config_var("MULTIARCH") or "")):
        if (folder / name).is_file():
            return folder / name
    return None


def unavailable() -> str | None:
    """Why the server cannot be started here (None: it can)."""
    if not sys.platform.startswith("linux"):
        return f"tritonserver from nvidia-pytriton runs on Linux only, not {sys.platform}"
    dist = distribution()
    if dist is None:
        return "tritonserver needs the nvidia-pytriton wheel: pip install nvidia-pytriton (the [triton-server] extra)"
    for path in (dist.binary, dist.python_backend / "libtriton_python.so", dist.stub()):
        if not path.is_file():
            return f"{path}: missing from the nvidia-pytriton wheel (no stub for Python {sys.version_info[0]}.{sys.version_info[1]}?)"
    if python_library() is None:
        return (f"{sys.executable} has no shared libpython ({sysconfig.get_config_var('INSTSONAME')} in "
                f"{sysconfig.get_config_var('LIBDIR')}), which Triton's Python backend stub must load")
    return None


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports that were free a moment ago (the server may still lose a race: see start())."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def backend_folder(dist: Distribution, where: Path) -> Path:
    """A ``--backend-directory`` whose Python backend has this interpreter's stub (pytriton copies it the same way),
    and beside it ``libpython/``, a folder holding only a link to this interpreter's libpython (``libpython_folder``)."""
    python = where / "python"
    python.mkdir(parents=True, exist_ok=True)
    for f in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy2(dist.python_backend / f, python / f)
    shutil.copy2(dist.stub(), python / "triton_python_backend_stub")
    libpython = python_library()
    if libpython is not None:
        folder = libpython_folder(where)
        folder.mkdir(exist_ok=True)
        link = folder / libpython.name
        if not link.is_symlink():
            link.symlink_to(libpython)
    return where


def libpython_folder(backends: Path) -> Path:
    """The folder of ``backends`` (``backend_folder``) that puts this interpreter's libpython first on the stub's
    library path, and nothing else: not LIBDIR, which may be the system's library folder (module docstring)."""
    return backends / "libpython"


def server_environment(dist: Distribution, base: dict | None = None, python_bin: Path | None = None,
                       backends: Path | None = None) -> dict:
    """The server's environment; ``python_bin``: the bin folder of a venv of this interpreter whose
    site-packages the stubs use (default: this interpreter's); ``backends``: the server's backend folder
    (``backend_folder``), whose ``libpython/`` leads the library path."""
    env = dict(os.environ if base is None else base)
    lib_path = [str(libpython_folder(backends))] if backends is not None and python_library() else []
    lib_path.append(str(dist.libs))
    if env.get("LD_LIBRARY_PATH"):
        lib_path.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(lib_path)
    env["PATH"] = os.pathsep.join([str(python_bin or Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started the server dies, even by SIGKILL
    (a killed test run leaves no server behind; stop() is the normal way)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _stubs_of(parent: int | None, among: list[int] | None = None) -> list[int]:
    """Live Python backend stubs: children of ``parent``, or (``parent`` None) those of ``among`` still running."""
    pids = []
    for pid in among if among is not None else [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]:
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        comm, fields = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
        if comm.startswith("triton_python") and fields[0] != "Z" and (parent is None or int(fields[1]) == parent):
            pids.append(pid)
    return pids


class ServerError(RuntimeError):
    """The server exited or did not come up in time; the message ends with its log."""


class TritonServer:
    """One ``tritonserver`` process serving ``repo`` on free loopback ports; a context manager that always stops it.

    ``workdir`` holds the backend folder and the log (``log_path``).  ``start()`` waits, bounded by
    ``timeout``, until the server is live, which Triton reports only after the initial loads (a model
    that fails to load does not stop the server, unless ``exit_on_error``: Triton's own default).
    """

    def __init__(self, repo: str | Path, workdir: str | Path, *, exit_on_error: bool = False, python_bin: Path | None = None):
        reason = unavailable()
        if reason:
            raise ServerError(reason)
        self.dist = distribution()
        self.repo = Path(repo).resolve()
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        token = f"{os.getpid()}_{secrets.token_hex(4)}"
        # a folder of its own: a stub that another server runs cannot be overwritten ("text file busy")
        self.backends = backend_folder(self.dist, self.workdir / f"backends_{token}")
        self.log_path = self.workdir / f"tritonserver_{token}.log"
        self.exit_on_error = exit_on_error
        self.python_bin = python_bin
        # the Python backend names its shared-memory regions by this prefix: unique, so that servers
        # of other test runs on the same machine do not collide, and so that stop() can remove leftovers
        self.shm_prefix = f"parastream_{token}_"
        self.proc: subprocess.Popen | None = None
        self.http_port = self.grpc_port = self.metrics_port = 0

    # -- addresses ---------------------------------------------------------------------------------
    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def command(self) -> list[str]:
        return [
            str(self.dist.binary),
            f"--model-repository={self.repo}",
            f"--backend-directory={self.backends}",
            "--http-address=127.0.0.1", f"--http-port={self.http_port}",
            "--grpc-address=127.0.0.1", f"--grpc-port={self.grpc_port}",
            "--metrics-address=127.0.0.1", f"--metrics-port={self.metrics_port}",
            f"--exit-on-error={'true' if self.exit_on_error else 'false'}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
        ]

    # -- life --------------------------------------------------------------------------------------
    def start(self, timeout: float = 120.0, attempts: int = 3) -> "TritonServer":
        for attempt in range(attempts):
            self.http_port, self.grpc_port, self.metrics_port = free_ports(3)
            offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            with open(self.log_path, "ab") as log:
                log.write(f"--- parastream: start {attempt + 1}: {' '.join(self.command())}\n".encode())
                log.flush()
                self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             env=server_environment(self.dist, python_bin=self.python_bin, backends=self.backends),
                                             start_new_session=True,
                                             preexec_fn=_die_with_parent)
            try:
                self._wait_live(timeout)
                return self
            except ServerError:
                self.stop()
                # a port taken between free_ports() and the server's bind ("Socket '127.0.0.1:N' already in use"):
                # try other ports
                if "already in use" in self.log()[offset:] and attempt + 1 < attempts:
                    continue
                raise
        raise AssertionError("unreachable")

    def _wait_live(self, timeout: float) -> None:
        import tritonclient.http as httpclient

        deadline = time.monotonic() + timeout
        client = httpclient.InferenceServerClient(self.http_url, connection_timeout=2.0, network_timeout=2.0)
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise ServerError(f"tritonserver exited with status {self.proc.returncode} while starting\n{self.log_tail()}")
                try:
                    if client.is_server_live():
                        return
                except Exception:  # noqa: BLE001 - not listening yet
                    pass
                time.sleep(0.25)
        finally:
            client.close()
        raise ServerError(f"tritonserver was not live after {timeout:.0f} s\n{self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (Triton unloads its models and ends their stubs); SIGKILL after ``timeout``, then to any of
        its stubs still alive.  Shared-memory regions left by failed loads (Triton leaves those) are removed."""
        proc, self.proc = self.proc, None
        if proc is not None:
            stubs = _stubs_of(proc.pid)  # while the server lives: they are its children
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
            for pid in _stubs_of(None, among=stubs):  # the same processes, still alive
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for leftover in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
            leftover.unlink(missing_ok=True)

    def __enter__(self) -> "TritonServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- what it did -------------------------------------------------------------------------------
    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def stub_pids(self) -> list[int]:
        """The Python backend stubs the server started (one per model instance)."""
        return _stubs_of(self.proc.pid) if self.proc is not None else []

    @staticmethod
    def libpythons(pid: int) -> set[str]:
        """The libpython files mapped into process ``pid``."""
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            return set()
        return {line.split()[-1] for line in maps.splitlines() if "/libpython3" in line}


@contextlib.contextmanager
def serving(repo: Path, workdir: Path, **kwargs):
    """tritonserver on ``repo`` (``TritonServer``'s keywords), started for the block and stopped after it, its
    log's path printed (pytest shows it with a failure)."""
    srv = TritonServer(repo, workdir, **kwargs)
    try:
        srv.start(timeout=180)
        yield srv
    finally:
        srv.stop()
        print(f"tritonserver log: {srv.log_path}")


@contextlib.contextmanager
def built_and_served(model: Path, work: Path, server_dir: Path, name: str, *build_args: str, **server_kwargs):
    """``model`` built with the onnxruntime backend (``build_args`` added), exported as Triton model ``name`` and
    served (``serving``)."""
    from parastream.pipeline.cli import main as cli

    assert cli(["build", str(model), "-o", str(work / f"{name}.bundle"), "--backend", "onnxruntime", "--no-search",
                "--quiet", *build_args]) == 0
    assert cli(["export-triton", str(work / f"{name}.bundle"), str(work / "repo"), "--name", name]) == 0
    with serving(work / "repo", server_dir, **server_kwargs) as srv:
        yield srv
