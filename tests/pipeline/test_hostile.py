"""Hostile input: each case a one-line error (exit 1 or 2) and nothing beside OUT, or a build that
matches onnxruntime.  The campaign over thousands of mutations is bench/fuzz.py (tests/fuzz)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest
from graphs import ort_reference, three_branch_model
from onnx import TensorProto, helper, numpy_helper

from parastream.launcher import load
from parastream.launcher.bundle import Bundle
from parastream.pipeline.cli import main


def cli(capsys, *argv):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:  # argparse refusing an option value
        code = e.code
    return code, capsys.readouterr().err.strip()


def build_cli(capsys, model, out, *extra):
    return cli(capsys, "build", model, "-o", out, "--backend", "onnxruntime", "--quiet", *extra)


def assert_refused(code, err, out=None, *needles, codes=(2,)):
    assert code in codes, err
    assert len(err.splitlines()) == 1 and err.startswith("parastream"), err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, err
    if out is not None:
        assert not out.exists()
        assert [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")] == []


def save(tmp_path, model, name="m.onnx"):
    p = tmp_path / name
    onnx.save(model, p)
    return p


def conv_model(group=1, channels=4, perm=None):
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((channels, channels // max(group, 1) or 1, 3, 3)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", group=group, pads=[1, 1, 1, 1])]
    last = "c"
    if perm is not None:
        nodes.append(helper.make_node("Transpose", ["c"], ["t"], name="transpose", perm=perm))
        last = "t"
    nodes.append(helper.make_node("Relu", [last], ["y"], name="relu"))
    return helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, channels, 8, 8])], [w]),
        opset_imports=[helper.make_opsetid("", 17)])


# -- the crash list -----------------------------------------------------------------------------------
def _layernorm_with_empty_bias() -> onnx.ModelProto:
    """A model onnxruntime segfaults on while it creates the session."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])
    s = numpy_helper.from_array(np.ones(8, np.float32), "s")
    return helper.make_model(helper.make_graph([helper.make_node("LayerNormalization", ["x", "s", ""], ["y"], name="ln")],
                                               "g", [x], [y], [s]), opset_imports=[helper.make_opsetid("", 17)])


def test_layernorm_with_empty_bias_does_not_crash_the_tool(tmp_path, capsys):
    """onnxruntime segfaults creating this session; the check runs in a child, so it is an error line."""
    m = _layernorm_with_empty_bias()
    out = tmp_path / "out"
    code, err = build_cli(capsys, save(tmp_path, m), out)
    assert_refused(code, err, out, "m.onnx")


def test_the_reference_check_started_as_the_build_begins_reports_the_crash_by_the_file(tmp_path, monkeypatch):
    """A GPU build checks that ONNX Runtime loads the original in a child started before the model loads
    (``check_reference_early``): the crash is still one error naming the file.  The torch backend stands in for a
    GPU build (its own check is nothing: the early child is the only check run)."""
    import importlib

    from parastream.launcher.engines import torch as tb
    from parastream.launcher.errors import ParastreamError
    from parastream.pipeline import BuildConfig

    b = importlib.import_module("parastream.pipeline.build")  # (the package's ``build`` is the function)
    monkeypatch.setattr(b, "in_child", lambda *a, **k: pytest.fail("checked after the load"))
    m = _layernorm_with_empty_bias()
    path = save(tmp_path, m)
    with pytest.raises(ParastreamError, match=r"m\.onnx: loading the model into onnxruntime: the library crashed"):
        b.load_and_check(path, BuildConfig(backend="torch"), tb, b._Progress(False), {})


def test_the_early_reference_check_is_not_taken_for_an_original_other_than_the_file(tmp_path, monkeypatch):
    """Where the original is not the file as read (two nodes of one name, which the loader makes unique), the
    early check's result is not taken: the original is checked after the load, and the build goes on."""
    import importlib

    from parastream.launcher.engines import torch as tb
    from parastream.pipeline import BuildConfig

    b = importlib.import_module("parastream.pipeline.build")
    m = three_branch_model()
    for node in m.graph.node[:2]:
        node.name = "same"
    calls = []
    real = b.in_child
    monkeypatch.setattr(b, "in_child", lambda *a, **k: calls.append(k["what"]) or real(*a, **k))
    built = b.load_and_check(save(tmp_path, m), BuildConfig(backend="torch"), tb, b._Progress(False), {})
    assert calls == ["loading the model into onnxruntime"] and built.loaded.original.graph.node[1].name != "same"


def test_in_child_reports_a_signal_and_an_error():
    from parastream.launcher.errors import ParastreamError
    from parastream.pipeline.isolate import in_child

    with pytest.raises(ParastreamError, match="crashed .SIGSEGV."):
        in_child(lambda: os.kill(os.getpid(), 11), what="a step")
    with pytest.raises(ParastreamError, match="^bad input$"):
        in_child(lambda: (_ for _ in ()).throw(ParastreamError("bad input")), what="a step")
    in_child(lambda: None, what="a step")  # and a step that succeeds raises nothing


@pytest.mark.parametrize("how", ["output_is_initializer", "initializer_shadows_input"])
def test_constant_outputs(tmp_path, capsys, how):
    m = three_branch_model()
    if how == "output_is_initializer":
        m.graph.output.append(helper.make_tensor_value_info("w0", TensorProto.FLOAT, [4, 4, 1, 1]))
    else:  # the input becomes a constant: every output depends on no input
        m.graph.initializer.append(numpy_helper.from_array(np.ones((1, 4, 8, 8), np.float32), "input"))
    out = tmp_path / "out"
    code, err = build_cli(capsys, save(tmp_path, m), out, "--no-search")
    assert_refused(code, err, out, "is a constant")


def test_names_that_are_not_utf8(tmp_path, capsys):
    m = three_branch_model()
    m.graph.node[0].name = "NAMEXX"
    p = tmp_path / "m.onnx"
    p.write_bytes(m.SerializeToString().replace(b"NAMEXX", b"NA\xff\xfeXX"))
    out = tmp_path / "out"
    code, err = build_cli(capsys, p, out)
    assert_refused(code, err, out, "node[0].name", "not UTF-8")


@pytest.mark.parametrize("where", ["input", "value_info", "initializer"])
def test_unknown_element_type(tmp_path, capsys, where):
    m = onnx.shape_inference.infer_shapes(three_branch_model())
    if where == "input":
        m.graph.input[0].type.tensor_type.elem_type = 999
    elif where == "value_info":
        m.graph.value_info[0].type.tensor_type.elem_type = 999
    else:
        m.graph.initializer[0].data_type = 999
    out = tmp_path / "out"
    code, err = build_cli(capsys, save(tmp_path, m), out)
    assert_refused(code, err, out, "999")


def test_unreadable_model(tmp_path, capsys):
    if os.geteuid() == 0:
        pytest.skip("root reads a file of mode 000")
    p = save(tmp_path, three_branch_model())
    p.chmod(0)
    out = tmp_path / "out"
    code, err = build_cli(capsys, p, out)
    assert_refused(code, err, out, "cannot read")


@pytest.mark.parametrize("group", [0, -1, 3])
@pytest.mark.parametrize("search", [True, False])
def test_conv_group_that_does_not_divide(tmp_path, capsys, group, search):
    out = tmp_path / "out"
    code, err = build_cli(capsys, save(tmp_path, conv_model(group=group)), out, *([] if search else ["--no-search"]))
    assert_refused(code, err, out, "m.onnx")
    # the same model with group 1 builds: the error is about the group
    code, err = build_cli(capsys, save(tmp_path, conv_model(group=1), "ok.onnx"), tmp_path / "ok", "--no-search")
    assert code == 0, err


def test_wrong_transpose_perm(tmp_path, capsys):
    out = tmp_path / "out"
    code, err = build_cli(capsys, save(tmp_path, conv_model(perm=[0, 1, 2])), out, "--no-search")
    assert_refused(code, err, out, "m.onnx")


def test_shapes_contradicting_the_weights(tmp_path, capsys):
    m = conv_model()
    m.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "C"
    out = tmp_path / "out"
    code, err = build_cli(capsys, save(tmp_path, m), out, "--no-search", "--shapes", "x:1x5x8x8")
    assert_refused(code, err, out, "m.onnx")


def test_duplicate_node_names_build_and_match(tmp_path, capsys):
    m = three_branch_model()
    for n in m.graph.node:
        n.name = "same"
    p = save(tmp_path, m)
    code, err = build_cli(capsys, p, tmp_path / "out", "--no-search")
    assert code == 0, err
    x = np.random.default_rng(5).standard_normal((1, 4, 8, 8)).astype(np.float32)
    got = load(tmp_path / "out")({"input": x})
    want = ort_reference(three_branch_model(), {"input": x})
    np.testing.assert_allclose(got["output"], want["output"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dim", [0, 2**31, 2**62])
def test_input_dimensions_zero_or_huge(tmp_path, capsys, dim):
    m = three_branch_model()
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_value = dim
    m.graph.output[0].type.tensor_type.shape.dim[0].dim_value = dim
    out = tmp_path / "out"
    code, err = build_cli(capsys, save(tmp_path, m), out, "--no-search")
    assert_refused(code, err, out, "m.onnx")


# -- options -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra,needle", [
    (["--seed", "-5"], "--seed"), (["--seed", str(2**70)], "--seed"), (["--streams", "99999999999999999999"], "--streams"),
    (["--streams", "1000"], "--streams"), (["--streams", "0"], "--streams"), (["--rtol", "nan"], "--rtol"),
    (["--rtol", "inf"], "--rtol"), (["--rtol", "-1"], "--rtol"), (["--atol", "nan"], "--atol"),
    (["--workspace-mb", "-1"], "--workspace-mb"), (["--opt-level", "99"], "--opt-level"),
    (["--shapes", "input:1x4x8x8,input:1x4x8x8"], "twice"), (["--shapes", "input:\uff11x4x8x8"], "digits"),
    (["--batch", "\uff11:2:3"], "--batch"),
])
def test_bad_options(tmp_path, capsys, extra, needle):
    out = tmp_path / "out"
    code, err = build_cli(capsys, save(tmp_path, three_branch_model()), out, *extra)
    assert_refused(code, err, out, needle)


def test_verify_iterations_zero(tmp_path, capsys):
    code, err = cli(capsys, "verify", tmp_path, "--iterations", "0")
    assert_refused(code, err, None, "--iterations")


@pytest.mark.parametrize("out_name", ["proc", "long", "parent_is_file"])
def test_outputs_that_cannot_be_written(tmp_path, capsys, out_name):
    (tmp_path / "file").write_text("x")
    out = {"proc": "/proc/parastream-test/out", "long": str(tmp_path / ("x" * 300)),
           "parent_is_file": str(tmp_path / "file" / "out")}[out_name]
    code, err = build_cli(capsys, save(tmp_path, three_branch_model()), out, "--no-search")
    assert_refused(code, err, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "m.onnx"]


def test_validate_triton_on_a_binary_config(tmp_path, capsys):
    pytest.importorskip("tritonclient.grpc")
    (tmp_path / "repo" / "m").mkdir(parents=True)
    (tmp_path / "repo" / "m" / "config.pbtxt").write_bytes(b"\x00\xff\xfe\x80binary")
    code = main(["validate-triton", str(tmp_path / "repo")])
    assert code == 1 and "not text" in capsys.readouterr().out


def test_log_lines_only_with_debug(tmp_path, capfd):
    """A model onnxruntime fails to run prints its one error line; onnxruntime's own log lines only with --debug."""
    p = save(tmp_path, conv_model(group=3))
    argv = ["build", str(p), "-o", str(tmp_path / "out"), "--backend", "onnxruntime", "--quiet", "--no-search"]
    r = subprocess.run([sys.executable, "-m", "parastream.pipeline.cli", *argv], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = subprocess.run([sys.executable, "-m", "parastream.pipeline.cli", "--debug", *argv], capture_output=True, text=True)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) > 1


# -- faults ------------------------------------------------------------------------------------------
def test_stale_partial_folders_are_removed_but_not_a_running_builds(tmp_path, capsys):
    p = save(tmp_path, three_branch_model())
    stale = tmp_path / ".out.dead1234.partial"
    (stale / "engines").mkdir(parents=True)
    live = tmp_path / ".out.live5678.partial"
    live.mkdir()
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as a running build holds its folder
    try:
        code, err = build_cli(capsys, p, tmp_path / "out", "--no-search")
        assert code == 0, err
        assert not stale.exists() and live.exists()
    finally:
        os.close(fd)
    Bundle.open(tmp_path / "out")


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_signal_during_the_build_leaves_nothing(tmp_path, sig):
    import signal

    p = save(tmp_path, three_branch_model())
    proc = subprocess.Popen([sys.executable, "-m", "parastream.pipeline.cli", "build", str(p), "-o", str(tmp_path / "out"),
                             "--backend", "onnxruntime", "--quiet"], stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not list(tmp_path.glob(".out.*.partial")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)  # until the build is writing its folder
    proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=60)
    if proc.returncode == 0:
        pytest.skip("the build finished before the signal")
    assert proc.returncode == 128 + getattr(signal, sig), err
    assert "Traceback" not in err
    left = sorted(x.name for x in tmp_path.iterdir())
    if left == ["m.onnx", "out"]:
        # the signal came while the finished bundle was being renamed into place (a rename is not stopped half-way):
        # the bundle is whole, and the one line says it was written
        from parastream.launcher.bundle import Bundle

        assert f"{tmp_path / 'out'} was written before it" in err, err
        Bundle.open(tmp_path / "out")  # every file its manifest names, with its hash
    else:
        assert left == ["m.onnx"], err


def test_concurrent_force_builds_to_one_out(tmp_path):
    p = save(tmp_path, three_branch_model())
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "parastream.pipeline.cli", "build", str(p), "-o", str(out), "--backend", "onnxruntime",
           "--quiet", "--no-search", "--force"]
    for _ in range(3):
        procs = [subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        results = [(q.wait(timeout=120), q.stderr.read()) for q in procs]
        assert all(code == 0 for code, _ in results), results
        Bundle.open(out)
        assert sorted(x.name for x in tmp_path.iterdir()) == ["m.onnx", "out"]


def test_triton_export_failing_after_the_build_says_the_bundle_is_there(tmp_path, capsys, monkeypatch):
    pytest.importorskip("tritonclient.grpc")
    from parastream.launcher.errors import ParastreamError
    from parastream.pipeline import triton

    def broken(*a, **k):
        raise ParastreamError("the disk is full")

    monkeypatch.setattr(triton, "export_triton", broken)
    out = tmp_path / "out"
    code, err = build_cli(capsys, save(tmp_path, three_branch_model()), out, "--no-search", "--triton-repo", tmp_path / "repo")
    assert code == 2 and len(err.splitlines()) == 1 and f"the bundle {out} was written" in err and "disk is full" in err
    Bundle.open(out)


def test_a_tensor_declared_twice(tmp_path, capsys):
    """Two declarations that disagree on a fixed dimension are refused (graphsurgeon kept one, onnxruntime the
    other); symbolic names that differ are not a disagreement, and that model builds and matches."""
    m = onnx.shape_inference.infer_shapes(three_branch_model(batch="N"))
    m.graph.value_info.append(helper.make_tensor_value_info("output", TensorProto.FLOAT, ["unk", 12, 8, 8]))
    code, err = build_cli(capsys, save(tmp_path, m, "ok.onnx"), tmp_path / "ok", "--no-search", "--shapes", "input:1x4x8x8")
    assert code == 0, err
    x = np.random.default_rng(2).standard_normal((1, 4, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(load(tmp_path / "ok")({"input": x})["output"],
                               ort_reference(three_branch_model(), {"input": x})["output"], rtol=1e-4, atol=1e-5)
    m.graph.value_info[-1].type.tensor_type.shape.dim[1].dim_value = 13
    out = tmp_path / "out"
    code, err = build_cli(capsys, save(tmp_path, m), out, "--no-search", "--shapes", "input:1x4x8x8")
    assert_refused(code, err, out, "'output' is declared twice")


def test_conv_group_zero_in_a_multi_stream_model(tmp_path, capsys):
    """Where several alternatives are timed on the CPU before verification, the run's error is one line too."""
    m = three_branch_model()
    m.graph.node[0].attribute.append(helper.make_attribute("group", 0))
    out = tmp_path / "out"
    code, err = build_cli(capsys, save(tmp_path, m), out, "--no-search")
    assert_refused(code, err, out, "m.onnx", "conv0")


def test_a_signal_handled_right_after_the_staging_folder_is_made_removes_it(tmp_path, monkeypatch):
    """The CLI's signal handler (``remove_staging`` then exit) can run between any two bytecodes: here right after
    the staging folder is created, before anything else.  The folder is listed before it exists, so the handler
    removes it (a folder made by mkdtemp and listed after was left behind about once in fifty SIGHUPs)."""
    from pathlib import Path

    from parastream.pipeline import outdir

    real_mkdir = Path.mkdir

    def mkdir_then_signal(self, *a, **k):
        real_mkdir(self, *a, **k)
        if self.name.endswith(".partial"):
            outdir.remove_staging()  # what _terminate does, before os._exit
            raise SystemExit(129)

    monkeypatch.setattr(Path, "mkdir", mkdir_then_signal)
    with pytest.raises(SystemExit):
        with outdir.staging(tmp_path / "out", "bundle"):
            pass
    assert not list(tmp_path.glob(".out.*.partial"))


def test_a_staging_folder_a_writer_refilled_while_it_was_removed_is_removed_after_the_interrupt(tmp_path, monkeypatch):
    """An interrupt unwinds the staging block while something still writes into the folder (a child process the
    CLI stops only after the unwinding): the removal leaves it, and it stays listed, so that ``remove_staging``,
    which the CLI calls once the children are stopped, removes it (it was dropped from the list before, and a
    ``.partial`` folder outlived an interrupted export-triton)."""
    import shutil

    from parastream.pipeline import outdir

    real_rmtree = shutil.rmtree
    calls = []

    def rmtree_beside_a_writer(path, ignore_errors=False):
        calls.append(path)
        real_rmtree(path, ignore_errors=ignore_errors)
        if len(calls) == 1:  # the writer puts a file back as the folder goes
            path.mkdir()
            (path / "engine.part").write_bytes(b"x")

    monkeypatch.setattr(outdir.shutil, "rmtree", rmtree_beside_a_writer)
    with pytest.raises(KeyboardInterrupt):
        with outdir.staging(tmp_path / "out", "bundle"):
            raise KeyboardInterrupt
    (left,) = tmp_path.glob(".out.*.partial")
    assert left in outdir._STAGING
    assert outdir.remove_staging() == [] and not left.exists() and left not in outdir._STAGING
