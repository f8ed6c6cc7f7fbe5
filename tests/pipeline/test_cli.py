"""The command line: build, run, verify, inspect, demo — as a person would type them."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from graphs import ort_reference, three_branch_model

from parastream.pipeline.cli import main


@pytest.fixture
def model_path(tmp_path):
    p = tmp_path / "m.onnx"
    onnx.save(three_branch_model(), p)
    return p


@pytest.fixture
def bundle(model_path, tmp_path, capsys):
    out = tmp_path / "bundle"
    assert main(["build", str(model_path), "-o", str(out), "--backend", "onnxruntime", "--no-search", "--streams", "3"]) == 0
    printed = capsys.readouterr().out
    assert "on 3 streams" in printed and "verification: passed" in printed
    assert "branch_000" not in printed and len(printed.strip().splitlines()) <= 8  # short by default
    return out


def test_run_writes_outputs(bundle, model_path, tmp_path, capsys):
    x = np.random.default_rng(0).standard_normal((1, 4, 8, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    res = tmp_path / "results"
    assert main(["run", str(bundle), "--input", f"input={tmp_path / 'x.npy'}", "--output-dir", str(res)]) == 0
    got = np.load(res / "output.npy")
    ref = ort_reference(onnx.load(model_path), {"input": x})["output"]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_run_rejects_wrong_shape(bundle, tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.ones((1, 4, 9, 9), np.float32))
    code = main(["run", str(bundle), "--input", f"input={tmp_path / 'x.npy'}", "--output-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and "'input'" in err and "[1, 4, 8, 8]" in err
    assert not (tmp_path / "r").exists()


def _tree(folder):
    """Every file of a folder with its bytes and modification time."""
    return {p.relative_to(folder): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.rglob("*")) if p.is_file()}


def _verify_json(argv, capsys):
    code = main(["verify", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_verify_passes_prints_and_never_writes_the_bundle(bundle, capsys):
    before = _tree(bundle)
    assert main(["verify", str(bundle)]) == 0
    assert "PASSED" in capsys.readouterr().out
    code, ver = _verify_json([str(bundle)], capsys)
    assert code == 0 and ver["passed"] and ver["status"] == "passed" and ver["iterations"] == 3
    assert ver["outputs"]["output"]["passed"] and ver["outputs"]["output"]["meaningful"]
    assert _tree(bundle) == before  # no report or manifest rewritten
    from parastream.launcher.bundle import Bundle

    Bundle.open(bundle)


def test_verify_exits_1_on_mismatch(bundle, model_path, tmp_path, capsys):
    """Verify against a different model (other weights): the comparison must fail with exit 1."""
    other = tmp_path / "other.onnx"
    onnx.save(three_branch_model(seed=99), other)
    before = _tree(bundle)
    code = main(["verify", str(bundle), "--model", str(other)])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAILED" in out
    assert _tree(bundle) == before


def _mark_precision(bundle, precision, **options):
    """Record another precision in plan.json (and build options in the manifest; re-hash), as a bundle built so would."""
    from parastream.launcher.bundle import Bundle, write_manifest

    plan = json.loads((bundle / "plan.json").read_text())
    plan["precision"] = precision
    (bundle / "plan.json").write_text(json.dumps(plan))
    manifest = {k: v for k, v in Bundle.open(bundle, check_hashes=False).manifest.items() if k not in ("files", "version")}
    manifest["options"] = dict(manifest.get("options", {}), **options)
    write_manifest(bundle, manifest)


def test_verify_judges_fp16_by_scaled_error(bundle, capsys):
    _mark_precision(bundle, "fp16")
    assert main(["verify", str(bundle)]) == 0
    out = capsys.readouterr().out
    assert "PASSED (scaled error max|out-ref|/max|ref| <= 0.1" in out
    code, ver = _verify_json([str(bundle)], capsys)
    assert ver["criterion"] == "scaled" and ver["scale_tol"] == 0.1
    assert 0.0 <= ver["outputs"]["output"]["max_scaled"] < 1e-5


def test_verify_fp32_default_is_scaled(bundle, capsys):
    code, ver = _verify_json([str(bundle)], capsys)
    assert code == 0 and ver["criterion"] == "scaled" and ver["scale_tol"] == 1e-3


def test_verify_explicit_rtol_judges_fp16_elementwise(bundle, capsys):
    _mark_precision(bundle, "fp16")
    code, ver = _verify_json([str(bundle), "--rtol", "1e-3"], capsys)
    assert code == 0 and ver["criterion"] == "elementwise" and ver["scale_tol"] is None and ver["rtol"] == 1e-3


def test_verify_uses_the_tolerances_the_bundle_was_built_with(bundle, model_path, tmp_path, capsys):
    """A bundle built with --scale-tol 0.5 is verified at 0.5 (not the precision's default) unless told otherwise."""
    _mark_precision(bundle, "fp32", scale_tol=0.5)
    code, ver = _verify_json([str(bundle)], capsys)
    assert code == 0 and ver["criterion"] == "scaled" and ver["scale_tol"] == 0.5
    code, ver = _verify_json([str(bundle), "--scale-tol", "0.01"], capsys)
    assert ver["scale_tol"] == 0.01
    _mark_precision(bundle, "fp32", scale_tol=None, rtol=1e-3, atol=1e-4)
    code, ver = _verify_json([str(bundle)], capsys)
    assert ver["criterion"] == "elementwise" and ver["rtol"] == 1e-3 and ver["atol"] == 1e-4


def test_verify_scale_tol_option(bundle, model_path, tmp_path, capsys):
    """--scale-tol picks the scaled criterion with its bound; other weights fail it (exit 1)."""
    code, ver = _verify_json([str(bundle), "--scale-tol", "0.05"], capsys)
    assert code == 0 and ver["criterion"] == "scaled" and ver["scale_tol"] == 0.05
    other = tmp_path / "other.onnx"
    onnx.save(three_branch_model(seed=99), other)
    code, ver = _verify_json([str(bundle), "--model", str(other), "--scale-tol", "0.05"], capsys)
    assert code == 1 and ver["status"] == "failed"
    assert ver["outputs"]["output"]["max_scaled"] > 0.05


def test_verify_scale_tol_with_rtol_is_refused(bundle, capsys):
    code = main(["verify", str(bundle), "--scale-tol", "0.1", "--atol", "1e-3"])
    err = capsys.readouterr().err
    assert code == 2 and "--scale-tol" in err and err.strip().count("\n") == 0


def test_console_script_exit_code(tmp_path):
    """The installed `parastream` entry point exits 2 on bad input, with one line on stderr."""
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00garbage")
    proc = subprocess.run([sys.executable, "-m", "parastream.pipeline.cli", "build", str(bad), "-o", str(tmp_path / "o")],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "bad.onnx" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_the_program_leaves_its_objects_to_the_exit(model_path):
    """As the program (no argv) main freezes the collector's objects once the command is done, since the process
    exits next; called with arguments (a test, a caller that goes on) it leaves the collector alone."""
    code = ("import gc, sys\n"
            "from parastream.pipeline.cli import main\n"
            "gc.freeze = lambda: print('frozen')\n"
            "assert main(['inspect', sys.argv[1]]) == 0\n"
            "print('argv given: done')\n"
            "sys.argv = ['parastream', 'inspect', sys.argv[1]]\n"
            "sys.exit(main())\n")
    proc = subprocess.run([sys.executable, "-c", code, str(model_path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("frozen") == 1 and proc.stdout.index("argv given: done") < proc.stdout.index("frozen")


def test_the_program_ends_idle_compile_workers_before_its_exit(model_path):
    """As the program, main ends the torch backend's idle compile workers once the command is done (the
    interpreter's exit would otherwise wait while each one tears down its own interpreter); called with arguments
    (a caller that goes on and builds again) it leaves them running."""
    code = ("import multiprocessing.connection, sys, time\n"
            "from parastream.launcher.engines import torch as tb\n"
            "from parastream.pipeline.cli import main\n"
            "pool = tb._pool(2)\n"
            "[f.result() for f in [pool.submit(abs, -1) for _ in range(2)]]\n"
            "procs = list(pool._processes.values())\n"
            "assert main(['inspect', sys.argv[1]]) == 0\n"
            "print('argv given:', sum(p.is_alive() for p in procs), 'alive', file=sys.stderr, flush=True)\n"
            "sys.argv = ['parastream', 'inspect', sys.argv[1]]\n"
            "code = main()\n"
            "left, t0 = {p.sentinel for p in procs}, time.monotonic()\n"
            "while left and time.monotonic() - t0 < 30:\n"
            "    left -= set(multiprocessing.connection.wait(list(left), 1))\n"
            "print('as the program:', len(left), 'left', tb._POOL, file=sys.stderr, flush=True)\n"
            "sys.exit(code)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(model_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "argv given: 2 alive" in proc.stderr and "as the program: 0 left {}" in proc.stderr


@pytest.mark.parametrize("argv,whole,ablation", [([], True, False), (["--no-whole-model", "--concat-ablation"], False, True)])
def test_bench_options_reach_bench_bundle(monkeypatch, tmp_path, argv, whole, ablation):
    import parastream.pipeline.bench as bench

    seen = {}
    monkeypatch.setattr(bench, "bench_bundle", lambda path, **kw: seen.update(kw, path=path) or {})
    assert main(["bench", str(tmp_path / "b"), "--runs", "7", *argv]) == 0
    assert seen["path"] == str(tmp_path / "b") and seen["runs"] == 7
    assert seen["whole_model"] is whole and seen["concat_ablation"] is ablation


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"parastream {version('parastream')}"


def test_build_verbose_json_and_progress_lines(model_path, tmp_path, capsys):
    """--verbose adds the per-branch table; --json prints one JSON line; on a non-terminal, progress comes as lines
    on stderr, one per stage."""
    out = tmp_path / "v"
    assert main(["build", str(model_path), "-o", str(out), "--backend", "onnxruntime", "--no-search", "--streams", "3",
                 "--verbose"]) == 0
    cap = capsys.readouterr()
    # the CPU choice is timed on a quiet machine (a table), or not on a busy one (the decision says why)
    assert "branch_000" in cap.out and "CPU: kept plan: 3 streams" in cap.out and "max scaled error" in cap.out
    assert ("CPU alternatives timed" in cap.out) == ("not timed" not in cap.out)
    stages = [line for line in cap.err.splitlines() if line.startswith("parastream build: [")]
    assert any("load and check" in line for line in stages) and any("verify" in line for line in stages)
    assert main(["build", str(model_path), "-o", str(tmp_path / "j"), "--backend", "onnxruntime", "--no-search",
                 "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    summary = json.loads(lines[0])
    assert summary["bundle"] == str(tmp_path / "j") and summary["verification"]["status"] == "passed"
    assert summary["engines"] >= 1 and summary["peak_rss_mb"] > 0 and summary["search"] == "skipped"


def test_piped_tables_are_not_cut_at_80_columns(bundle, capsys):
    """Output that goes to a log (not a terminal) is 160 columns wide: a long title survives whole."""
    from parastream.pipeline.cli import _console

    con = _console()
    assert con.width == 160


def test_demo_leaves_no_temporary_folder_behind(tmp_path, monkeypatch, capsys):
    import tempfile

    import importlib

    build_module = importlib.import_module("parastream.pipeline.build")

    real_build = build_module.build
    monkeypatch.setattr(build_module, "build", lambda *a, **kw: real_build(*a, search=False, cpu_runs=3, **kw))  # fast
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # mkdtemp's default folder
    assert main(["demo", "--backend", "onnxruntime"]) == 0
    assert "now removed" in capsys.readouterr().out
    assert not list(tmp_path.glob("parastream-demo-*"))
    kept = tmp_path / "kept"
    assert main(["demo", "--backend", "onnxruntime", "-o", str(kept)]) == 0
    assert (kept / "plan.json").is_file() and not list(tmp_path.glob("parastream-demo-*"))


def test_build_takes_the_measurement_budget_and_refuses_a_bad_one(model_path, tmp_path, monkeypatch, capsys):
    import importlib

    build_module = importlib.import_module("parastream.pipeline.build")
    seen = []

    def fake_build(model, out, config=None, progress=True):
        seen.append(config)
        raise SystemExit(0)

    monkeypatch.setattr(build_module, "build", fake_build)
    for argv, want in ((["--measure-seconds", "15"], 15.0), ([], build_module.BuildConfig().measure_seconds)):
        with pytest.raises(SystemExit):
            main(["build", str(model_path), "-o", str(tmp_path / "b"), *argv])
        assert seen[-1].measure_seconds == want
    assert build_module.BuildConfig().measure_seconds == 25.0
    with pytest.raises(SystemExit) as e:
        main(["build", str(model_path), "-o", str(tmp_path / "b"), "--measure-seconds", "-5"])
    assert e.value.code == 2 and "--measure-seconds" in capsys.readouterr().err


def test_measure_seconds_help_gives_the_default_the_build_uses(capsys):
    import importlib

    default = importlib.import_module("parastream.pipeline.build").BuildConfig().measure_seconds
    with pytest.raises(SystemExit):
        main(["build", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"(default {default:g};" in text


def test_the_original_is_recorded_absolute_and_a_missing_one_is_said(tmp_path, monkeypatch, capsys):
    """A build given a relative model path records it absolute: verify and bench find it from another folder; once
    it is gone, both say so (bench does not silently compare with the bundle's model.onnx) and verify --json
    prints its error as one JSON line, exit status unchanged."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    onnx.save(three_branch_model(), work / "m.onnx")
    monkeypatch.chdir(work)
    assert main(["build", "m.onnx", "-o", "b", "--backend", "onnxruntime", "--no-search", "--quiet"]) == 0
    report = json.loads((work / "b" / "report.json").read_text())
    assert report["model"]["path"] == str(work / "m.onnx")
    monkeypatch.chdir(elsewhere)
    assert main(["verify", str(work / "b"), "--iterations", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == str(work / "m.onnx")
    assert main(["bench", str(work / "b"), "--runs", "2", "--warmup", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == str(work / "m.onnx")
    (work / "m.onnx").unlink()
    assert main(["verify", str(work / "b"), "--json"]) == 2
    captured = capsys.readouterr()
    line = json.loads(captured.out)
    assert line["passed"] is False and "m.onnx is not there" in line["error"] and "--model" in line["error"]
    assert len(captured.out.splitlines()) == 1 and "m.onnx is not there" in captured.err
    assert main(["bench", str(work / "b"), "--runs", "2"]) == 2
    err = capsys.readouterr().err
    assert "m.onnx is not there" in err and "--model" in err and "model.onnx" in err
