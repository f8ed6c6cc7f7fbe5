"""stdout holds the command's own output alone: with --json exactly one JSON line, with --quiet nothing; the
libraries' log lines (onnx-graphsurgeon's "[W] colored module is not installed" and "[W] It looks like this model
contains foldable nodes ...", polygraphy's) go to stderr, and only with --debug or --verbose.

Real processes: the loggers print() to the process's stdout, and print their "colored" line once per process."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper


def foldable_model() -> onnx.ModelProto:
    """A foldable node (W + W) whose output is over 1 MiB: graphsurgeon's constant folding warns about it."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((600, 600)).astype(np.float32), "W")
    nodes = [helper.make_node("Add", ["W", "W"], ["W2"], name="fold_me"),
             helper.make_node("MatMul", ["x", "W2"], ["y"], name="mm"),
             helper.make_node("Relu", ["y"], ["z"], name="relu")]
    g = helper.make_graph(nodes, "fold", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 600])],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 600])], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def cli(tmp_path, *argv):
    return subprocess.run([sys.executable, "-m", "parastream.pipeline.cli", *argv], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture
def model(tmp_path):
    onnx.save(foldable_model(), tmp_path / "fold.onnx")
    return "fold.onnx"


def test_json_stdout_is_one_json_line(tmp_path, model):
    r = cli(tmp_path, "build", model, "-o", "out", "--backend", "onnxruntime", "--json")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1, r.stdout
    assert json.loads(lines[0])["engines"] == 1
    assert "[W]" not in r.stderr  # without --debug/--verbose the libraries' warnings are not printed at all


def test_quiet_prints_nothing_on_stdout(tmp_path, model):
    r = cli(tmp_path, "build", model, "-o", "out", "--backend", "onnxruntime", "--quiet")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and r.stderr == ""


def test_debug_shows_the_library_warnings_on_stderr(tmp_path, model):
    r = cli(tmp_path, "--debug", "build", model, "-o", "out", "--backend", "onnxruntime", "--json")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 1 and json.loads(r.stdout)
    assert "foldable nodes" in r.stderr and "colored module is not installed" in r.stderr


def test_verify_json_is_one_line_too(tmp_path, model):
    assert cli(tmp_path, "build", model, "-o", "out", "--backend", "onnxruntime", "--quiet").returncode == 0
    r = cli(tmp_path, "verify", "out", "--json", "--iterations", "1")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 1 and json.loads(r.stdout)["passed"] is True


def test_progress_lines_agree_in_number(tmp_path, model):
    """The progress lines on stderr count as the summary does: "build 1 onnxruntime engine", not "1 ... engines"."""
    r = cli(tmp_path, "build", model, "-o", "out", "--backend", "onnxruntime", "--json")
    assert r.returncode == 0, r.stderr
    assert "build 1 onnxruntime engine\n" in r.stderr, r.stderr
    assert not re.search(r"\b1 (\w+ )?(streams|engines|pieces|rewrites|branches)\b", r.stderr), r.stderr
