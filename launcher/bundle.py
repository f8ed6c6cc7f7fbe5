"""Reading a deployment bundle (what ``parastream build`` writes, atomically).

    OUT/
      manifest.json   versions, device, precision, options, sha256 of every file
      model.onnx      the rewritten model
      plan.json       branches, streams, events, launch order, engine file names
      engines/        one serialized engine per branch
      report.json     search trace, schedule, verification figures
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from types import ModuleType
from typing import TYPE_CHECKING

from .errors import ParastreamError
from .plan import Branch, Plan

if TYPE_CHECKING:
    from .engines.base import BuildOptions

MANIFEST_VERSION = 1
BUNDLE_FILES = ("manifest.json", "model.onnx", "plan.json", "report.json")
#: the most files hashed at once when a bundle is opened (``Bundle.check_hashes``)
HASH_THREADS = 8
#: the most engine-file bytes a loading open keeps from its hashes for the load to take (``Bundle.engine_bytes``)
KEEP_HASHED_BYTES = 512 << 20


def sha256_file(path: Path) -> str:
    """The file's sha256, read and hashed in 16 MiB pieces: both let other threads run, and a load hashes its
    bundle while a thread imports what its engines need (``Bundle.open(loading=True)``); each piece then waits
    for the interpreter lock again, which with 1 MiB pieces made hashing a 412 MB bundle 2.2 s instead of 0.8
    (H100 host, Inception-v4)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def _sha256_kept(path: Path) -> tuple[str, bytes]:
    """The file's sha256 and its bytes, read in one piece (the read and the hash each let other threads run)."""
    with open(path, "rb") as f:
        data = f.read()
    return hashlib.sha256(data).hexdigest(), data


@dataclass
class Bundle:
    path: Path
    manifest: dict
    plan: Plan
    report: dict
    #: False while model.onnx's hash and external-data check wait for its first reader (``model_path``)
    _model_checked: bool = field(default=True, init=False, repr=False, compare=False)
    #: model.onnx's initializers by name, read at the first ``initializer`` call
    _initializers: dict | None = field(default=None, init=False, repr=False, compare=False)
    #: the engine files' paths as ``open`` resolved and checked them (plan.json's name -> real path): a load
    #: reads each without resolving it again (``engine_bytes``)
    _engines: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    #: every file manifest.json lists, resolved and checked by ``open`` (its name -> real path), for the hashes
    _real: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    #: engine files' bytes as a loading open hashed them (plan.json's name -> bytes), each taken by its first
    #: ``engine_bytes``: the load reads the bytes that were checked, once
    _hashed: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def open(cls, path: str | Path, *, check_hashes: bool = True, loading: bool = False,
             device: int | None = None) -> "Bundle":
        """Open the bundle at ``path``, refusing one whose files are not all inside it and listed by its manifest.

        Every path the bundle names (the manifest's files, the plan's engines) is relative, has no ``..``
        and resolves inside the bundle (no symbolic link leaving it); its manifest lists its files, and every
        file in the folder is listed; its ONNX files carry no external data.  ``check_hashes`` also compares
        each file with its sha256.  ``loading``: the caller loads its engines next; the backend's
        ``prepare_load(manifest, report)`` starts what they will need (the torch backend: torch's import and, for
        Inductor's own artifacts, its runtime imports, in threads) before the hashes are checked, and a GPU bundle
        loaded on ``device`` has that device's CUDA context created meanwhile (``cuda.initialize_in_background``).
        A load reads the engines, not model.onnx: its checks (hash, external data) are left to ``model_path``,
        the way every reader of it takes (for an Inception-v4, 170 of the bundle's 412 MB hashed, and a parse
        that held the interpreter for 0.2-0.4 s, while torch was being imported).
        """
        path = Path(path)
        if not path.is_dir():
            raise ParastreamError(f"{path}: not a parastream bundle (no such folder); create one with `parastream build`")
        root = path.resolve()
        for name in BUNDLE_FILES:
            f = path / name
            if f.is_symlink() or not f.is_file():
                raise ParastreamError(f"{path}: not a complete parastream bundle ({name} is missing or not a plain file)")
        try:
            manifest = json.loads((path / "manifest.json").read_text())
            report = json.loads((path / "report.json").read_text())
            plan = Plan.from_json((path / "plan.json").read_text())
        except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
            raise ParastreamError(f"{path}: unreadable bundle metadata: {e}") from None
        if not isinstance(manifest, dict) or manifest.get("version") != MANIFEST_VERSION:
            version = manifest.get("version") if isinstance(manifest, dict) else None
            raise ParastreamError(f"{path / 'manifest.json'}: version {version!r}, expected {MANIFEST_VERSION}")
        files = manifest.get("files")
        if not isinstance(files, dict) or not files or not all(isinstance(v, str) for v in files.values()):
            raise ParastreamError(f"{path / 'manifest.json'}: lists no files, so this is not a parastream bundle; rebuild it")
        # each name resolved once (a 332-engine bundle's paths, resolved component by component at the open and
        # again at every engine's read, were 0.4 s of a profiled fresh load): the manifest's files, then the
        # engines plan.json names, which are among them
        real = {rel: inside(path, rel, "manifest.json", real_root=root) for rel in files}
        present = _files_under(path)
        unlisted = sorted(present - set(files) - {"manifest.json"})
        if unlisted:
            raise ParastreamError(f"{path / unlisted[0]}: not listed in manifest.json; the bundle was modified, rebuild it")
        engines = {}
        for b in plan.branches:
            if not isinstance(b.engine, str) or not b.engine:
                raise ParastreamError(f"{path / 'plan.json'}: {b.name} names no engine file")
            f = real.get(b.engine) or inside(path, b.engine, f"plan.json ({b.name})", real_root=root)
            if f.relative_to(root).as_posix() not in files:
                raise ParastreamError(f"{path / 'plan.json'}: {b.name}'s engine {b.engine!r} is not listed in manifest.json")
            engines[b.engine] = f
        bundle = cls(path=path, manifest=manifest, plan=plan, report=report)
        bundle._engines, bundle._real = engines, real
        if loading:
            if device is not None and str(manifest.get("device", "")).startswith("cuda"):
                from .cuda import initialize_in_background

                initialize_in_background(device)
            from .engines import get_backend

            try:
                backend = get_backend(plan.backend)
            except ParastreamError:  # an unknown backend: the load names it
                backend = None
            if backend is not None:
                backend.prepare_load(manifest, report)
        if manifest.get("buckets"):
            bundle.bucket_bundles()  # a dynamic-batch bundle: every bucket's folder is a bundle inside this one
        if check_hashes:
            # the ONNX files' external-data check (a parse of model.onnx: 0.2-0.4 s for an Inception-v4) runs
            # beside the hashes rather than after them; a hash that differs is still the error named first
            from concurrent.futures import ThreadPoolExecutor

            later = ("model.onnx",) if loading else ()
            onnx_files = [rel for rel in files if rel.endswith(".onnx") and rel not in later]
            with ThreadPoolExecutor(1, thread_name_prefix="parastream-onnx-check") as pool:
                external = pool.submit(_check_no_external_data, path, onnx_files)
                bundle.check_hashes(skip=later, keep=bundle._engines_to_keep(root) if loading else None)
                external.result()
            bundle._model_checked = not loading
        return bundle

    def _engines_to_keep(self, root: Path) -> dict[str, str]:
        """{manifest name: plan.json's name} of the engine files a loading open keeps from its hashes, in plan
        order while their sizes sum to at most ``KEEP_HASHED_BYTES`` (a larger bundle's others are read again);
        ``root``: the bundle's folder resolved."""
        keep, total = {}, 0
        for name, f in self._engines.items():
            try:
                size = f.stat().st_size
            except OSError:
                continue  # (check_hashes names it)
            if total + size > KEEP_HASHED_BYTES:
                break
            total += size
            keep[f.relative_to(root).as_posix()] = name
        return keep

    def check_hashes(self, skip: tuple[str, ...] = (), keep: dict[str, str] | None = None) -> None:
        """Compare every file the manifest lists (but ``skip``) with its sha256, several files at a time: hashlib
        and file reads let go of the interpreter lock for large pieces, so threads hash in parallel (a 412 MB
        Inception-v4 bundle, model.onnx and 52 engine files: 0.8 s in one thread on the H100 host).  The first
        file in the manifest's order that differs is the one named, whichever thread found it.

        ``keep`` ({manifest name: plan.json's engine name}, a loading open's): those files' bytes, read whole and
        hashed, are kept for ``engine_bytes``, so that the load reads each engine once, in these threads while
        torch is imported, and runs the very bytes whose hash was checked."""
        keep = keep or {}
        files = []
        for rel, digest in self.manifest.get("files", {}).items():
            if rel in skip:
                continue
            f = self._real.get(rel) or inside(self.path, rel, "manifest.json")
            if not f.is_file():
                raise ParastreamError(f"{self.path / rel}: listed in manifest.json but missing; rebuild the bundle")
            files.append((rel, f, digest))
        from concurrent.futures import ThreadPoolExecutor

        def hashed(item):
            rel, f, _ = item
            if rel in keep:
                return _sha256_kept(f)
            return sha256_file(f), None

        workers = max(1, min(HASH_THREADS, len(files), os.cpu_count() or 1))
        with ThreadPoolExecutor(workers, thread_name_prefix="parastream-hash") as pool:
            found = list(pool.map(hashed, files))  # in the manifest's order
        for (rel, _, digest), (got, _) in zip(files, found):
            if got != digest:
                raise ParastreamError(f"{self.path / rel}: sha256 differs from manifest.json; the bundle was modified or is corrupt")
        for (rel, _, _), (_, data) in zip(files, found):
            if data is not None:
                self._hashed[keep[rel]] = data

    def bucket_bundles(self) -> dict[int, "Bundle"]:
        """A dynamic-batch bundle's buckets, batch size -> Bundle (the largest is this bundle itself; the others
        live in ``buckets/b<N>/``, their files listed and hashed by this bundle's manifest too)."""
        rec = self.manifest.get("buckets")
        where = self.path / "manifest.json"
        if isinstance(rec, dict) and "axes" in rec:  # a grid over named axes (--min/--max-shapes): key -> Bundle
            return _grid_bundles(self, rec)
        if not isinstance(rec, dict) or not isinstance(rec.get("folders"), dict) or not rec["folders"]:
            raise ParastreamError(f"{where}: 'buckets' does not list the buckets' folders; rebuild the bundle")
        out: dict[int, Bundle] = {}
        for size, folder in rec["folders"].items():
            if not str(size).isdigit() or not isinstance(folder, str):
                raise ParastreamError(f"{where}: bucket {size!r} -> {folder!r} is not a batch size and a folder")
            if folder == ".":
                out[int(size)] = self
                continue
            sub = Bundle.open(inside(self.path, folder, "manifest.json (buckets)"), check_hashes=False)
            if sub.manifest.get("buckets"):  # (this bundle's manifest hashes the bucket's files)
                raise ParastreamError(f"{sub.path}: a bucket is itself a bucketed bundle; rebuild the bundle")
            out[int(size)] = sub
        sizes = sorted(out)
        listed = rec.get("sizes")
        ints = isinstance(listed, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in listed)
        names = all(isinstance(rec.get(k), list) and all(isinstance(v, str) for v in rec[k]) for k in ("inputs", "outputs"))
        if (not ints or sorted(listed) != sizes or out[sizes[-1]] is not self or not names
                or rec.get("max") != sizes[-1] or not isinstance(rec.get("min"), int) or not 1 <= rec["min"] <= sizes[0]):
            raise ParastreamError(f"{where}: 'buckets' is inconsistent (sizes {listed!r}, folders for {sizes}, min "
                                  f"{rec.get('min')!r}, max {rec.get('max')!r}, the largest must be this bundle's own plan); "
                                  "rebuild the bundle")
        return out

    @property
    def model_path(self) -> Path:
        """model.onnx, its sha256 and external data checked on first use where the open left that to its readers
        (``loading``)."""
        path = self.path / "model.onnx"
        if not self._model_checked:
            self._check_model_digest(sha256_file(path))
            _check_no_external_data(self.path, ["model.onnx"])
            self._model_checked = True
        return path

    def initializer(self, name: str):
        """model.onnx's initializer ``name`` (a TensorProto), or None: the weights a torch engine leaves to the
        bundle's model (``slim_engine``), for an engine compiled again at load and for ``localize``.  model.onnx is
        read once, at the first call, after its hash is checked (``model_path``)."""
        if self._initializers is None:
            import onnx

            path = self.path / "model.onnx"
            if self._model_checked:
                model = onnx.load(str(path))
            else:  # read once for its hash, its check and its weights (``model_path`` reads it twice: 0.7 s of
                # a 340 MB model's 3.3 s load, ViT-B/16's onnxruntime bundle on the 2-core CPU machine)
                data = path.read_bytes()
                self._check_model_digest(hashlib.sha256(data).hexdigest())
                model = _readable(path, lambda: onnx.load_from_string(data))
                _refuse_external_data(model, path)
                self._model_checked = True
            self._initializers = {t.name: t for t in model.graph.initializer}
        return self._initializers.get(name)

    def _check_model_digest(self, digest: str) -> None:
        if digest != self.manifest["files"].get("model.onnx"):
            raise ParastreamError(f"{self.path / 'model.onnx'}: sha256 differs from manifest.json; the bundle was "
                                  "modified or is corrupt")

    def drop_weights(self) -> None:
        """Forget model.onnx's weights that ``initializer`` read (a launcher, once its engines are loaded: they
        hold what they took, and a serving process keeps its launcher, and so this bundle, for its lifetime), and
        the engine files' bytes the open kept that no load took."""
        self._initializers = None
        self.drop_kept_engines()

    def drop_kept_engines(self) -> None:
        """Forget the engine files' bytes a loading open kept from its hashes that no ``engine_bytes`` took (an
        elided branch's engine): a launcher, once its engines are loaded."""
        self._hashed.clear()

    def engine_path(self, branch: Branch) -> Path:
        f = self._engines.get(branch.engine)
        return f if f is not None else inside(self.path, branch.engine, f"plan.json ({branch.name})")

    def engine_bytes(self, branch: Branch) -> bytes:
        """The engine file's bytes: those a loading open hashed (taken once), else read from the path ``open``
        resolved inside the bundle, opened without following a link in its last component, so a file replaced by
        a link since the open is refused, not followed."""
        kept = self._hashed.pop(branch.engine, None)
        if kept is not None:
            return kept
        f = self.engine_path(branch)
        try:
            fd = os.open(f, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError as e:
            if f.is_symlink():
                raise ParastreamError(f"{f}: became a symbolic link after the bundle was opened; the bundle is refused") from None
            raise ParastreamError(f"{f}: unreadable engine file ({e.strerror}); rebuild the bundle") from None
        with os.fdopen(fd, "rb") as fh:
            return fh.read()

    def backend(self) -> ModuleType:
        from .engines import require_backend

        return require_backend(self.plan.backend)

    #: the build options a launcher loads engines with, as manifest.json's options record them
    LOAD_OPTIONS = ("compile", "optimization_level", "fuse_conv_relu", "fuse_attention", "fuse_gemm_epilogue",
                    "conv_kernels", "cudnn_plans", "torch_artifact", "inductor_format",
                    "conv_relu_unfused", "conv_channels_padded")

    def engine_options(self, device: str, **overrides) -> "BuildOptions":
        """The options to load this bundle's engines on ``device`` with: the build's (``LOAD_OPTIONS`` of
        manifest.json's options; a bundle that predates one gets its default), then ``overrides``."""
        from .engines.base import BuildOptions

        built = self.manifest.get("options", {}) or {}
        kw = {k: built[k] for k in self.LOAD_OPTIONS if built.get(k) is not None}
        for name in ("conv_relu_unfused", "conv_channels_padded"):
            listed = kw.get(name, [])
            if not (isinstance(listed, list) and all(isinstance(k, str) for k in listed)):
                raise ParastreamError(f"{self.path / 'manifest.json'}: options.{name} is not a list of "
                                      "convolution shapes; rebuild the bundle")
        return BuildOptions(**dict(kw, precision=self.plan.precision, device=device, **overrides))


def inside(root: Path, rel: str, named_in: str, *, real_root: Path | None = None) -> Path:
    """``root / rel`` resolved, refused unless it stays inside ``root`` (relative, no ``..``, no link leaving it).
    ``real_root``: ``root`` resolved already (a caller checking many names)."""
    if not isinstance(rel, str) or not rel or "\\" in rel or "\x00" in rel:
        raise ParastreamError(f"{root}: {named_in} names the path {rel!r}, which is not a file of the bundle")
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts:
        raise ParastreamError(f"{root}: {named_in} names {rel!r}, a path outside the bundle; the bundle is refused")
    real_root = real_root or Path(root).resolve()
    real = (real_root / p).resolve()
    if real_root not in real.parents:
        raise ParastreamError(f"{root}: {named_in} names {rel!r}, which resolves outside the bundle (a symbolic link); "
                              "the bundle is refused")
    return real


def _files_under(root: Path) -> set[str]:
    """Every file and symbolic link under ``root`` (links to folders are not followed), as relative POSIX paths."""
    out = set()
    for folder, dirs, names in os.walk(root):
        rel = Path(folder).relative_to(root)
        out |= {(rel / n).as_posix() for n in names}
        out |= {(rel / d).as_posix() for d in dirs if (Path(folder) / d).is_symlink()}
    return out


def _check_no_external_data(root: Path, files: list[str]) -> None:
    """parastream writes every tensor inside its ONNX files; external data in a bundle could name any file."""
    if not files:
        return
    import onnx

    for rel in files:
        model = _readable(root / rel, lambda rel=rel: onnx.load(str(root / rel), load_external_data=False))
        _refuse_external_data(model, root / rel)


def _readable(path: Path, parse):
    """``parse()``'s ONNX model, or the one-line error that names ``path``."""
    try:
        return parse()
    except Exception as e:  # noqa: BLE001 - protobuf raises several kinds
        raise ParastreamError(f"{path}: not a readable ONNX file ({type(e).__name__}); rebuild the bundle") from None


def _refuse_external_data(model, path: Path) -> None:
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    for t in _get_all_tensors(model):
        if uses_external_data(t):
            raise ParastreamError(f"{path}: tensor {t.name!r} keeps its data in an external file, which a "
                                  "parastream bundle never does; the bundle is refused")


def write_manifest(out: Path, manifest: dict, *, hashed: bool = True) -> None:
    """Hash every file under ``out`` (except the manifest) into ``manifest['files']`` and write it.

    ``hashed`` False lists the files with empty digests: a staging folder that this process loads with
    ``check_hashes=False`` before it writes the hashed manifest (a build's verification); hashing every
    file a second time, weights included, was wasted work."""
    files = {}
    for f in sorted(p for p in out.rglob("*") if p.is_file() and p != out / "manifest.json"):  # buckets' own too
        files[f.relative_to(out).as_posix()] = sha256_file(f) if hashed else ""
    manifest = dict(manifest, version=MANIFEST_VERSION, files=files)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))


def grid_key(text) -> tuple[int, ...]:
    """A grid bucket's key in manifest.json (``"1x16"``: one size per axis, in the axes' order) as a tuple."""
    return tuple(int(v) for v in str(text).split("x"))


def _grid_bundles(bundle: "Bundle", rec: dict) -> dict:
    """A grid bundle's buckets, key (one size per axis) -> Bundle: the key of every axis's MAX is this bundle
    itself, the others live in their folders (their files listed and hashed by this bundle's manifest)."""
    where = bundle.path / "manifest.json"
    axes, grid = rec.get("axes"), rec.get("grid")
    if (not isinstance(axes, list) or not axes or not isinstance(grid, dict) or not grid
            or not all(isinstance(a, dict) and isinstance(a.get("inputs"), dict) and isinstance(a.get("sizes"), list)
                       and isinstance(a.get("pad"), dict) for a in axes)):
        raise ParastreamError(f"{where}: 'buckets' does not list the axes and the grid's folders; rebuild the bundle")
    out: dict = {}
    for text, folder in grid.items():
        if not isinstance(folder, str) or not all(v.isdigit() for v in str(text).split("x")) or len(str(text).split("x")) != len(axes):
            raise ParastreamError(f"{where}: bucket {text!r} -> {folder!r} is not one size per axis and a folder")
        key = grid_key(text)
        if folder == ".":
            out[key] = bundle
            continue
        sub = Bundle.open(inside(bundle.path, folder, "manifest.json (buckets)"), check_hashes=False)
        if sub.manifest.get("buckets"):
            raise ParastreamError(f"{sub.path}: a bucket is itself a bucketed bundle; rebuild the bundle")
        out[key] = sub
    expected = set(itertools.product(*[sorted(int(s) for s in a["sizes"]) for a in axes]))
    top = tuple(int(a["max"]) for a in axes)
    if set(out) != expected or out.get(top) is not bundle:
        raise ParastreamError(f"{where}: 'buckets' is inconsistent (the grid's folders are not every combination of the "
                              "axes' sizes, or the largest is not this bundle's own plan); rebuild the bundle")
    return out
