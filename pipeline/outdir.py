"""Folders parastream writes (a bundle, ``run``'s outputs, a Triton model folder): what ``--force`` may
replace, and the atomic swap into place.

``--force`` replaces only what parastream itself wrote, recognised by what it left there:

* a bundle: its ``manifest.json`` (a parastream manifest: ``version`` and ``files``);
* ``run``'s output folder and each model folder of a Triton export: the marker ``.parastream.json``
  (``{"written_by": ..., "files": [...]}``).

and only when every file in the folder is one that record lists, so that a user's file put into an
old bundle is never deleted with it.  A target that is a plain file, someone else's folder, the
current directory, or a folder that holds (or is) one of the inputs is refused with a one-line error
before anything is written, and nothing is touched.
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

from parastream.launcher.errors import ParastreamError

from .interrupts import uninterrupted

MARKER = ".parastream.json"
MANIFEST = "manifest.json"
KINDS = {"bundle": "a parastream bundle (manifest.json)", "run": "an output folder of `parastream run`",
         "triton": "a model folder of `parastream export-triton`"}


def check_writable_folder(path: str | Path, option: str) -> Path:
    """Refuse ``path`` (a folder the command writes into, such as --cache-dir) with a one-line error naming
    ``option`` unless it is a writable folder or can be made one (its nearest existing ancestor a writable
    folder): checked before anything runs, rather than after a build's work when its first file is written.
    Nothing is created here."""
    path = Path(path)
    probe = path
    while not probe.exists() and probe != probe.parent:
        if probe.is_symlink():  # a dangling link: nothing can be made there
            raise ParastreamError(f"{option} {path}: {probe} is a symbolic link to nothing")
        probe = probe.parent
    if not probe.is_dir():
        where = "" if probe == path else f" ({probe} is not a folder)"
        raise ParastreamError(f"{option} {path}: not a folder{where}")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ParastreamError(f"{option} {path}: {'not writable' if probe == path else f'cannot be made in {probe}'}")
    return path


def write_marker(folder: Path, written_by: str) -> None:
    """Record in ``folder`` that parastream wrote it, with every file it holds (call it last)."""
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                   if (p.is_file() or p.is_symlink()) and p.name != MARKER)
    (folder / MARKER).write_text(json.dumps({"written_by": written_by, "files": files}, indent=1))


def _recorded_files(folder: Path, kind: str) -> set[str] | None:
    """The files parastream recorded writing into ``folder`` as ``kind``; None when it holds no such record."""
    record = folder / (MANIFEST if kind == "bundle" else MARKER)
    if record.is_symlink() or not record.is_file():
        return None
    try:
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("files"), (dict, list)):
        return None
    if kind == "bundle":
        if "version" not in data:
            return None
    elif not str(data.get("written_by", "")).startswith("parastream"):
        return None
    return {str(f) for f in data["files"]} | {record.name}


def _bytecode_of_recorded(rel: str, recorded: set[str]) -> bool:
    """Whether ``rel`` is Python's bytecode cache of a recorded source (``d/__pycache__/m.cpython-312.pyc`` of
    ``d/m.py``): serving a Triton model folder imports its model.py, and the server's Python writes that cache
    beside it (found on a real tritonserver), so it belongs to the folder parastream wrote."""
    parts = rel.split("/")
    if len(parts) < 2 or parts[-2] != "__pycache__" or not parts[-1].endswith(".pyc"):
        return False
    source = "/".join(parts[:-2] + [parts[-1].split(".", 1)[0] + ".py"])
    return source in recorded


def why_not_ours(folder: Path, kind: str) -> str | None:
    """Why ``folder`` is not something parastream wrote as ``kind`` (None: it is, and --force may replace it)."""
    if folder.is_symlink():
        return "it is a symbolic link"
    if not folder.is_dir():
        return "it is not a folder"
    recorded = _recorded_files(folder, kind)
    if recorded is None:
        return f"it is not {KINDS[kind]}"
    for p in folder.rglob("*"):
        if p.is_dir() and not p.is_symlink():
            continue
        rel = p.relative_to(folder).as_posix()
        if rel not in recorded and not _bytecode_of_recorded(rel, recorded):
            return f"it holds {rel}, which parastream did not write"
    return None


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_target(target: str | Path, *, kind: str, force: bool, protect: tuple = (), option: str = "OUT") -> Path:
    """Refuse ``target`` unless it is absent, or ``force`` and parastream wrote it as ``kind``.

    ``protect``: paths (inputs) that must not be inside the target.  The current directory is never a
    target, nor inside one.  Returns ``target`` as a Path.
    """
    target = Path(target)
    try:
        real = target.resolve()
    except (OSError, RuntimeError) as e:
        raise ParastreamError(f"{option} {target}: cannot resolve the path ({e})") from None
    guarded = [(Path.cwd().resolve(), "the current directory")]
    for p in protect:
        try:
            p = Path(p).resolve()
        except (OSError, RuntimeError):  # a link loop: the input's own check reports it
            p = Path(os.path.abspath(p))
        folder = p if p.is_dir() else p.parent
        guarded.append((folder, f"{folder}, an input of this command" if folder == p else f"{folder}, which holds the input {p.name}"))
    for folder, what in guarded:
        if _inside(folder, real):
            raise ParastreamError(f"{option} {target}: would replace {what}; choose a new folder for {option}")
    if not (target.exists() or target.is_symlink()):
        return target
    reason = why_not_ours(target, kind)
    if reason:  # with or without --force: one message that says what --force would and would not replace
        raise ParastreamError(f"{target} exists and --force replaces only {KINDS[kind]} that parastream wrote, but "
                              f"{reason}; remove it yourself or choose another folder")
    if not force:
        raise ParastreamError(f"{target} already exists; pass --force to replace it")
    return target


_STAGING: set[Path] = set()  # staging folders of this process, for remove_staging()
WRITTEN: list[Path] = []  # targets this process put in place (what an interrupted command says it wrote)


def _new_staging_folder(target: Path) -> Path:
    """``.NAME.<random>.partial`` beside ``target``, made 0700 like ``tempfile.mkdtemp`` does, but named and listed
    in ``_STAGING`` before it exists: a signal handled between a mkdtemp and the listing (the CLI's handler runs
    between any two bytecodes, whichever thread the signal reached) left the folder behind."""
    import secrets

    for _ in range(100):
        tmp = target.parent / f".{target.name}.{secrets.token_hex(4)}.partial"
        _STAGING.add(tmp)
        try:
            tmp.mkdir(mode=0o700)
            return tmp
        except FileExistsError:
            _STAGING.discard(tmp)
        except OSError as e:
            _STAGING.discard(tmp)
            raise ParastreamError(f"{target}: cannot write beside it ({e.strerror or e})") from None
    raise ParastreamError(f"{target}: cannot write beside it (no free temporary name)")


def remove_staging() -> list[Path]:
    """Remove this process's staging folders that are still there (after an interrupt has unwound: one whose
    ``staging`` block never began); return those that could not be removed."""
    for tmp in list(_STAGING):
        shutil.rmtree(tmp, ignore_errors=True)
        if not tmp.exists():
            _STAGING.discard(tmp)
    return sorted(_STAGING)


def make_parent(target: Path) -> None:
    """Create ``target``'s parent folder, or say in one line why it cannot be."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ParastreamError(f"{target}: cannot create its folder {target.parent} ({e.strerror or e})") from None
    if not target.parent.is_dir():
        raise ParastreamError(f"{target}: its parent {target.parent} is not a folder")


def _flock(path: Path, *, blocking: bool = True) -> int | None:
    """An exclusive flock on the folder ``path`` itself (no lock file is left anywhere); its fd, or None when
    ``blocking`` is False and someone else holds it.  The lock goes with the process, however it ends."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextmanager
def _parent_locked(target: Path):
    """Hold the lock of ``target``'s parent folder: creating, cleaning and swapping folders beside ``target``
    happen one process at a time (each takes milliseconds; engines are built outside it)."""
    try:
        fd = _flock(target.parent)
    except OSError as e:
        raise ParastreamError(f"{target}: cannot lock its folder {target.parent} ({e.strerror or e})") from None
    try:
        yield
    finally:
        os.close(fd)


def _clean_stale(target: Path) -> None:
    """Remove what a killed run left beside ``target`` (call under the parent's lock): ``.NAME.*.partial``
    folders that no live process holds locked, and ``.NAME.old-*`` folders (a swap is done under the lock)."""
    for p in target.parent.glob(f".{glob.escape(target.name)}.*"):
        if p.is_symlink() or not p.is_dir():
            continue
        if p.name.endswith(".partial"):
            fd = _flock(p, blocking=False)
            if fd is None:
                continue  # a running build's folder
            try:
                shutil.rmtree(p, ignore_errors=True)
            finally:
                os.close(fd)
        elif p.name.startswith(f".{target.name}.old-"):
            shutil.rmtree(p, ignore_errors=True)


def move_into_place(tmp: Path, target: Path, kind: str) -> None:
    """Rename the finished ``tmp`` to ``target`` (call under the parent's lock); an old target goes only once
    the new one is in place, and only when parastream wrote it (checked again: it may have changed since)."""
    if target.exists() or target.is_symlink():
        reason = why_not_ours(target, kind)
        if reason:
            raise ParastreamError(f"{target} changed during the run and --force replaces only {KINDS[kind]}, "
                                  f"but {reason}; nothing was replaced")
        old = target.with_name(f".{target.name}.old-{os.getpid()}-{int(time.time() * 1000)}")
        target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(target)


@contextmanager
def staging(target: Path, kind: str, install=None):
    """Yield a fresh folder beside ``target`` (same file system, so the final rename is atomic); when the block
    succeeds, ``install(tmp)`` (default: rename it to ``target``) runs under the parent folder's lock.

    The folder is ``.NAME.<random>.partial`` and stays flock-ed while this process lives, so that a later run
    removes it only once its owner is gone (kill -9, a power cut); any error, Ctrl-C, SIGTERM or SIGHUP
    removes it at once (the CLI turns those signals into an exception, ``interrupts``).  Folders a killed run left
    beside ``target`` are cleaned here first.  The swap into place is not stopped half-way by a signal.
    """
    target = Path(target)
    make_parent(target)
    with _parent_locked(target):
        _clean_stale(target)
        tmp = _new_staging_folder(target)
        fd = _flock(tmp)
    try:
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it 0700; a bundle is as readable as any folder the user makes
        yield tmp
        with uninterrupted(), _parent_locked(target):
            (install or (lambda t: move_into_place(t, target, kind)))(tmp)
            WRITTEN.append(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        # listed until it is gone: a writer still at work in it (a child process the interrupt has not stopped
        # yet) can leave it behind this removal, and ``remove_staging`` tries again once the children are stopped
        if not tmp.exists():
            _STAGING.discard(tmp)
        os.close(fd)
