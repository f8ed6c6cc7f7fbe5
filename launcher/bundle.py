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
import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from .errors import ParastreamError
from .plan import Branch, Plan

MANIFEST_VERSION = 1
BUNDLE_FILES = ("manifest.json", "model.onnx", "plan.json", "report.json")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class Bundle:
    path: Path
    manifest: dict
    plan: Plan
    report: dict

    @classmethod
    def open(cls, path: str | Path, *, check_hashes: bool = True) -> "Bundle":
        path = Path(path)
        if not path.is_dir():
            raise ParastreamError(f"{path}: not a parastream bundle (no such folder); create one with `parastream build`")
        for name in BUNDLE_FILES:
            if not (path / name).is_file():
                raise ParastreamError(f"{path}: not a complete parastream bundle ({name} is missing)")
        try:
            manifest = json.loads((path / "manifest.json").read_text())
            report = json.loads((path / "report.json").read_text())
            plan = Plan.from_json((path / "plan.json").read_text())
        except (ValueError, KeyError, TypeError) as e:
            raise ParastreamError(f"{path}: unreadable bundle metadata: {e}") from None
        if manifest.get("version") != MANIFEST_VERSION:
            raise ParastreamError(f"{path / 'manifest.json'}: version {manifest.get('version')!r}, expected {MANIFEST_VERSION}")
        bundle = cls(path=path, manifest=manifest, plan=plan, report=report)
        if check_hashes:
            bundle.check_hashes()
        return bundle

    def check_hashes(self) -> None:
        for rel, digest in self.manifest.get("files", {}).items():
            f = self.path / rel
            if not f.is_file():
                raise ParastreamError(f"{f}: listed in manifest.json but missing; rebuild the bundle")
            if sha256_file(f) != digest:
                raise ParastreamError(f"{f}: sha256 differs from manifest.json; the bundle was modified or is corrupt")

    @property
    def model_path(self) -> Path:
        return self.path / "model.onnx"

    def engine_path(self, branch: Branch) -> Path:
        return self.path / branch.engine

    def engine_bytes(self, branch: Branch) -> bytes:
        return self.engine_path(branch).read_bytes()

    def backend(self) -> ModuleType:
        from .engines import require_backend

        return require_backend(self.plan.backend)


def write_manifest(out: Path, manifest: dict) -> None:
    """Hash every file under ``out`` (except the manifest) into ``manifest['files']`` and write it."""
    files = {}
    for f in sorted(p for p in out.rglob("*") if p.is_file() and p.name != "manifest.json"):
        files[f.relative_to(out).as_posix()] = sha256_file(f)
    manifest = dict(manifest, version=MANIFEST_VERSION, files=files)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
