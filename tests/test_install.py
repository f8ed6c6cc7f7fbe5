"""Installs that work for users: no instruction names a package-index entry that does not exist (parastream is
not on one), every document the README points to is in the repository, and the wheel builds and runs."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sysconfig
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
USER_TEXTS = [ROOT / "README.md", ROOT / "Dockerfile", *sorted((ROOT / "docs").glob("*.md")),
              ROOT / "pipeline" / "templates" / "model.py"]
SOURCES = [p for d in ("pipeline", "launcher", "rewrite") for p in sorted((ROOT / d).rglob("*.py"))]

# `pip install parastream`, `pip install "parastream[trt]"`, `pip install 'parastream[torch]'` ...: an index lookup
INDEX_INSTALL = re.compile(r"""pip3? install[^\n`&;|]*?(?<![\w./-])["']?parastream(\[[^\]]*\])?["']?(?=[\s`'"&|)]|$)""")


@pytest.mark.parametrize("path", USER_TEXTS + SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_install_from_an_index_entry_that_does_not_exist(path):
    text = path.read_text()
    assert not INDEX_INSTALL.search(text), f"{path.name}: {INDEX_INSTALL.search(text).group(0)!r}"
    assert "parastream[" not in text.replace("whl[", ""), path.name


def test_the_pattern_catches_index_installs_and_spares_local_ones():
    for bad in ('pip install "parastream[trt]"', "pip install parastream", "pip install 'parastream[torch]' && x"):
        assert INDEX_INSTALL.search(bad), bad
    for good in ('pip install -e ".[torch]"', 'pip install "/wheels/parastream-0.1.0-py3-none-any.whl[trt]"',
                 "pip install ./parastream-0.1.0-py3-none-any.whl", "pip install tensorrt cuda-python"):
        assert not INDEX_INSTALL.search(good), good


def test_every_document_the_readme_points_to_is_in_the_repository():
    readme = (ROOT / "README.md").read_text()
    assert "shared/" not in readme
    named = set(re.findall(r"(?<![\w/])((?:docs|bench|tests|examples|launcher|pipeline|rewrite)/[\w./-]*\w)", readme))
    assert any(n.startswith("docs/architecture.md") for n in named)
    missing = [n for n in sorted(named) if not (ROOT / n).exists()]
    assert not missing, missing


def test_wheel_version_in_the_docs_is_the_projects():
    import tomllib

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for path in USER_TEXTS:
        for v in re.findall(r"parastream-(\d[\w.]*?)-py3-none-any\.whl", path.read_text()):
            assert v == version, f"{path.name} names a wheel of version {v}, the project is {version}"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("build") is None, reason="needs the `build` package (the [test] extra)")
def test_wheel_builds_installs_and_runs(tmp_path):
    """`python -m build --wheel`, then the wheel installed (without dependencies) into a fresh venv that sees this
    interpreter's packages: the console script runs and the Triton template is in the package."""
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(ROOT)], check=True,
                   capture_output=True, text=True, timeout=300)
    (wheel,) = dist.glob("parastream-*-py3-none-any.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "parastream/pipeline/templates/model.py" in names and "parastream/rewrite/rules/__init__.py" in names
    assert not any(n.startswith(("tests/", "bench/", "examples/")) for n in names)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    # the new venv sees this interpreter's packages (onnx, numpy, ...) after its own: a .pth file naming them.
    # (--system-site-packages would give the base interpreter's, which a venv running these tests does not have.)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    outer = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(site, "outer_packages.pth").write_text("\n".join(sorted(outer)) + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True, timeout=300)
    out = subprocess.run([str(venv / "bin" / "parastream"), "--version"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith(wheel.name.split("-")[1])
    where = subprocess.run([str(py), "-c", "import parastream.pipeline as p; print(p.__file__)"], capture_output=True,
                           text=True, cwd=tmp_path, check=True).stdout
    assert str(venv) in where  # the wheel's copy, not the editable checkout


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the check runs only beside torch")
def test_a_torchvision_that_does_not_import_stops_the_tests_in_one_line(tmp_path):
    # a torchvision built for another torch fails at import like this one; transformers would then fail
    # every test that builds a model, each with an unrelated-looking message
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n')
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--co",
                          str(ROOT / "tests" / "test_install.py")], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert run.returncode != 0
    lines = [line for line in (run.stdout + run.stderr).splitlines() if "torchvision" in line]
    assert len(lines) == 1 and "operator torchvision::nms does not exist" in lines[0], run.stdout + run.stderr


def test_without_a_broken_torchvision_the_tests_start():
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--co",
                          str(ROOT / "tests" / "test_install.py")], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
