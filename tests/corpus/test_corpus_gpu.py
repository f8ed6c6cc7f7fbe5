"""bench/corpus_gpu.py without a GPU: its options (``--batches``, ``--search-batches``), the build settings each
batch gets, the inputs at a batch, and the table of result files (rows per model and batch, old files without
batches, several files together)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import corpus_gpu  # noqa: E402


def _row(model: str, batch: int | None, ms: float, compile_ms: float, **extra) -> dict:
    """A timed row as the run writes it (``batch`` None: a file written before batches, which has no such key)."""
    r = {"model": model, "nodes": [100, 90], "streams": 1, "engines": 1, "parastream_ms": ms, "one_stream_ms": ms * 1.1,
         "compile_ms": compile_ms, "maxerr": {"logits": 1e-3}, "build_s": 60.0, "load_s": 2.0,
         "search": {"rules_chosen_count": {}}, "measured_choices": None, **extra}
    if batch is not None:
        r["batch"] = batch
    return r


def _conv_relu_round(won: str) -> dict:
    return {"choice": "conv+ReLU", "won": won,
            "timed_ms": {"cuDNN fused conv+bias+ReLU": 0.2, "Inductor's conv and epilogue": 0.3}}


def test_batches_parse_and_default():
    assert corpus_gpu.parse_args([]).batches == [1]
    args = corpus_gpu.parse_args(["--batches", "1,8,32,8", "--search-batches", "1"])
    assert args.batches == [1, 8, 32]
    assert args.search_batches == [1]
    assert corpus_gpu.parse_args(["--batches", "8"]).search_batches is None
    assert corpus_gpu.parse_args(["--batches", "8,32", "--search-batches", "none"]).search_batches == []


@pytest.mark.parametrize("argv, named", [
    (["--batches", "1,x"], "--batches"),
    (["--batches", "0,8"], "--batches"),
    (["--batches", "none"], "--batches none"),
    (["--batches", "1,8", "--search-batches", "32"], "--search-batches 32"),
])
def test_bad_batches_refused_naming_the_option(argv, named, capsys):
    with pytest.raises(SystemExit) as e:
        corpus_gpu.parse_args(argv)
    assert e.value.code == 2
    assert named in capsys.readouterr().err


def test_search_batches_decide_each_build():
    args = corpus_gpu.parse_args(["--batches", "1,8,32", "--search-batches", "1", "--measure-seconds", "30",
                                  "--top-k", "12"])
    assert corpus_gpu.build_settings(1, args) == (30, 12)
    assert corpus_gpu.build_settings(8, args) == (0.0, 1)
    assert corpus_gpu.build_settings(32, args) == (0.0, 1)
    every = corpus_gpu.parse_args(["--batches", "1,8,32", "--measure-seconds", "30", "--top-k", "12"])
    assert [corpus_gpu.build_settings(b, every) for b in (1, 8, 32)] == [(30, 12)] * 3
    nowhere = corpus_gpu.parse_args(["--batches", "8,32", "--search-batches", "none"])
    assert [corpus_gpu.build_settings(b, nowhere) for b in (8, 32)] == [(0.0, 1)] * 2


def test_inputs_at_a_batch():
    torch = pytest.importorskip("torch")
    from gpu import at_batch

    ids = torch.arange(6).reshape(1, 6)
    x = torch.randn(1, 3, 4, 4)
    one = {"x": x, "ids": ids}
    assert at_batch(one, 1) is one
    got = at_batch(one, 8)
    assert got["x"].shape == (8, 3, 4, 4) and got["x"].dtype == torch.float32
    assert not torch.equal(got["x"][0], got["x"][1])  # drawn afresh, not one image repeated
    assert got["ids"].shape == (8, 6) and all(torch.equal(row, ids[0]) for row in got["ids"])
    assert torch.equal(at_batch(one, 8)["x"], got["x"])  # the same inputs at the same batch


def test_table_rows_per_batch_and_summary_per_batch():
    rows = [
        _row("resnet50", 8, 1.0, 1.5, measured_choices={"rounds": [_conv_relu_round("Inductor's conv and epilogue")]},
             search_mode="cost model"),
        _row("bert", 1, 0.5, 0.6, search={"rules_chosen_count": {"fuse_attention": 12}}),
        _row("resnet50", 1, 0.3, 0.45, measured_choices={"rounds": [_conv_relu_round("cuDNN fused conv+bias+ReLU")]},
             conv_shapes={"shapes": 23, "unfused": ["relu|256,56,56|104,256,1,1|1,1|0,0|1,1|1",
                                                     "relu|52,28,28|52,52,3,3|1,1|1,1|1,1|1"]}),
        _row("bert", 8, 2.0, 1.6),
        {"model": "bert", "batch": 32, "error": "timing: OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB"},
    ]
    text = corpus_gpu.table(rows)
    lines = text.splitlines()
    header = lines[0]
    assert "| batch |" in header and "torch.compile ms" in header and "kept" in header
    body = [ln for ln in lines[2:] if ln.startswith("| ")]
    # each model's batches together, in the order the models first appear, batches ascending
    assert [ln.split(" | ")[0].strip("| ") + "@" + ln.split(" | ")[2] for ln in body] == [
        "resnet50@1", "resnet50@8", "bert@1", "bert@8", "bert@32"]
    assert all(ln.count("|") == header.count("|") for ln in body)  # error rows keep the table's columns
    r8 = body[1]
    assert "| 1.50x |" in r8 and "| 8,000 |" in r8  # ratio and items/s (8 items in 1 ms)
    assert "conv+ReLU unfused; search by cost model" in r8
    assert "conv+ReLU fused but 2 shapes" in body[0] and "rewrites fuse_attention ×12" in body[2]
    assert "OutOfMemoryError" in body[4]
    assert "batch 1: geometric mean over 2 models: 1.34x vs torch.compile" in text
    assert "batch 8: geometric mean over 2 models: 1.10x vs torch.compile" in text
    assert "slower than torch.compile on 1 of 2 (bert 0.80x)" in text
    assert "1 of 5 rows not timed (error)" in text


def test_a_row_with_streams_gives_its_critical_path_bound_and_its_time_over_it():
    """A plan with streams: the bound (its engines timed alone, along the longest dependent chain) and parastream's
    time over it in one column; a one-stream row has none, and a bound that could not be timed says so."""
    rows = [_row("inception_v3", 1, 0.5, 0.8, bound_ms=0.4, bound_chain=12, alone_sum_ms=0.9),
            _row("resnet50", 1, 0.3, 0.45), _row("googlenet", 1, 0.2, 0.4, bound_error="CudaError: x")]
    body = [ln for ln in corpus_gpu.table(rows).splitlines()[2:] if ln.startswith("| ")]
    assert "| 0.400 (1.25x) |" in body[0]
    assert body[1].split(" | ")[8] == "-" and body[2].split(" | ")[8] == "error"


def test_a_row_timed_both_ways_compares_held_with_held_and_as_called_with_as_called():
    """A row timed both ways: "vs compile" is torch.compile held over the bundle held (the GPU's work per call), the
    next column both as called; an older row (torch.compile as called, the bundle held) keeps its ratio and has no
    as-called figure, and the summary's as-called mean covers only the rows that have one."""
    new = _row("shufflenet_v2_x1_0", 1, 0.187, 0.635, compile_held_ms=0.318, parastream_as_called_ms=0.200)
    old = _row("resnet50", 1, 0.3, 0.45)
    text = corpus_gpu.table([new, old])
    header = [c.strip() for c in text.splitlines()[0].strip("|").split("|")]
    body = [[c.strip() for c in ln.strip("|").split("|")] for ln in text.splitlines()[2:] if ln.startswith("| ")]
    col = header.index("vs compile")
    called = header.index("as called: parastream / torch.compile ms (vs compile)")
    assert body[0][header.index("torch.compile ms")] == "0.318" and body[0][col] == "1.70x"
    assert body[0][called] == "0.200 / 0.635 (3.17x)"
    assert body[1][col] == "1.50x" and body[1][called] == "-"
    assert "geometric mean over 2 models: 1.60x vs torch.compile" in text
    assert "both as called: 3.17x over 1 models" in text


def test_a_held_block_opened_by_the_gate_timer_is_named_under_the_table():
    """A held timing whose block the gate's timer had to open (a call waiting on the host inside its block) is named
    under the table, with how many blocks; a row whose held blocks all ran on the GPU's own is not."""
    waited = _row("shufflenet_v2_x1_0", 1, 0.187, 0.635, compile_held_ms=0.318, parastream_as_called_ms=0.200,
                  timing={"blocks": 40, "held": 24, "opened_by_timer": 3, "held_block": 5})
    clean = _row("resnet50", 1, 0.3, 0.45, compile_held_ms=0.44, parastream_as_called_ms=0.31,
                 timing={"blocks": 40, "held": 24, "opened_by_timer": 0})
    text = corpus_gpu.table([waited, clean])
    assert "held blocks opened by the gate's timer: shufflenet_v2_x1_0 b1 (3)" in text
    assert "resnet50 b1 (" not in text
    assert "opened by the gate's timer" not in corpus_gpu.table([clean])


def test_timed_sets_whether_a_runner_is_held_and_forwards_the_rest():
    class Runner:
        captured = True
        origin = 7

        def launch(self):
            return "launched"

    as_called = corpus_gpu.Timed(Runner(), held=False)
    held = corpus_gpu.Timed(object.__new__(type("Compiled", (), {"origin": 3})), held=True)
    assert as_called.captured is False and as_called.origin == 7 and as_called.launch() == "launched"
    assert held.captured is True and held.origin == 3


def test_table_of_old_and_new_files(tmp_path, capsys):
    old = [_row("resnet50", None, 0.3, 0.45), _row("bert", None, 0.5, 0.6),
           {"model": "googlenet", "error": "not started (time)"}]
    new = [_row("resnet50", 8, 1.0, 1.5), _row("googlenet", 1, 0.2, 0.4),
           {"model": "bert", "batch": 1, "error": "not finished within --seconds 540"}]
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(new))
    assert corpus_gpu.main(["--table", str(tmp_path / "old.json")]) == 0
    alone = capsys.readouterr().out
    assert "batch 1: geometric mean over 2 models" in alone and "| resnet50 | chain | 1 |" in alone
    assert corpus_gpu.main(["--table", str(tmp_path / "old.json"), str(tmp_path / "new.json")]) == 0
    both = capsys.readouterr().out
    assert "| googlenet | branchy | 1 | 100 → 90 |" in both  # the later file's timed row replaced the error
    assert "| bert | transformer | 1 | 100 → 90 |" in both and "not finished" not in both  # an error does not replace
    assert "| resnet50 | chain | 8 |" in both
    assert "batch 1: geometric mean over 3 models" in both and "batch 8: geometric mean over 1 models" in both


def test_table_of_a_missing_file_is_one_line_error(tmp_path, capsys):
    assert corpus_gpu.main(["--table", str(tmp_path / "none.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"--table {tmp_path / 'none.json'}:") and "\n" not in err


class _FakeBuild:
    """A build child that has finished: it wrote the prep.json (or rebuild.json) a real child writes."""

    launched: list[list[str]] = []

    def __init__(self, cmd, **_):
        self.launched.append(cmd)
        self.pid, self.returncode = 0, 0
        opt = {cmd[i]: cmd[i + 1] for i in range(2, len(cmd) - 1) if cmd[i].startswith("--")}
        work, model, batch = Path(opt["--work"]), opt.get("--prepare") or opt["--rebuild-of"], int(opt["--batch"])
        key = corpus_gpu.job_key(model, batch)
        if "--rebuild-of" in opt:
            (work / f"{key}.rebuild.json").write_text(json.dumps({"build_s": 9.0, "compile_jobs": 0}))
        elif model == "broken":
            self.returncode = 1  # died without a prep.json
        else:
            (work / f"{key}.prep.json").write_text(json.dumps({"model": model, "batch": batch, "nodes": [5, 5],
                                                               "build_s": 1.0, "search": {}, "measured_choices": None}))

    def poll(self):
        return self.returncode


def _fake_timing(name, batch, work, row, args, children):
    if batch == 32:
        raise RuntimeError("CUDA out of memory. Tried to allocate 4.00 GiB\nmore lines")
    return dict(row, parastream_ms=0.1 * batch, one_stream_ms=0.1 * batch, compile_ms=0.12 * batch, maxerr={"y": 0.0},
                streams=1, engines=1, load_s=0.5)


@pytest.fixture
def fake_run(monkeypatch):
    """``main``'s run with its builds as ``_FakeBuild`` processes (each launch recorded) and ``_fake_timing``."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "fake GPU")
    monkeypatch.setattr(corpus_gpu.subprocess, "Popen", _FakeBuild)
    monkeypatch.setattr(corpus_gpu, "time_model", _fake_timing)
    monkeypatch.setattr(corpus_gpu, "free_gpu", lambda: None)
    _FakeBuild.launched = []


def test_a_run_that_cannot_import_parastream_stops_before_any_build(tmp_path, fake_run, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "parastream.pipeline.bench", None)  # as if parastream were not on its path
    assert corpus_gpu.main(["--models", "resnet50", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "cannot import parastream" in err and "device_env.sh" in err and len(err.strip().splitlines()) == 1
    assert _FakeBuild.launched == []


def test_run_one_row_per_model_and_batch(tmp_path, fake_run, capsys):
    out = tmp_path / "out"
    assert corpus_gpu.main(["--models", "resnet50,broken", "--batches", "1,8,32", "--search-batches", "1",
                            "--measure-seconds", "25", "--top-k", "7", "--fresh-loads", "0", "--rebuild",
                            "--workers", "2", "--work", str(tmp_path / "work"), "--out", str(out)]) == 0
    capsys.readouterr()
    builds = [c for c in _FakeBuild.launched if "--prepare" in c]
    settings = {(c[c.index("--prepare") + 1], c[c.index("--batch") + 1]):
                (c[c.index("--measure-seconds") + 1], c[c.index("--top-k") + 1]) for c in builds}
    assert settings == {("resnet50", "1"): ("25.0", "7"), ("resnet50", "8"): ("0.0", "1"), ("resnet50", "32"): ("0.0", "1"),
                        ("broken", "1"): ("25.0", "7"), ("broken", "8"): ("0.0", "1"), ("broken", "32"): ("0.0", "1")}
    rows = {(r["model"], r["batch"]): r for r in json.loads((out / "corpus_gpu.json").read_text())}
    assert set(rows) == {(m, b) for m in ("resnet50", "broken") for b in (1, 8, 32)}
    assert rows[("resnet50", 8)]["compile_ms"] == pytest.approx(0.96)
    assert rows[("resnet50", 8)]["search_mode"] == "cost model" and rows[("resnet50", 1)]["search_mode"] == "measured"
    assert rows[("resnet50", 32)]["error"] == "timing: RuntimeError: CUDA out of memory. Tried to allocate 4.00 GiB"
    assert rows[("broken", 8)]["error"].startswith("build process exited 1")
    assert rows[("resnet50", 1)]["rebuild"] == {"build_s": 9.0, "compile_jobs": 0}
    assert "rebuild" in rows[("resnet50", 32)]  # rebuilt too: the build was fine, its timing was not
    md = (out / "corpus_gpu.md").read_text()
    assert "batch 1: geometric mean over 1 models: 1.20x" in md and "4 of 6 rows not timed (error)" in md


def test_a_fresh_load_row_gives_the_replay_time_of_that_process():
    """Named for what it times: replays back to back, not a call's latency (the table's other columns)."""
    rows = [_row("bert", 1, 0.45, 0.58, fresh_load={"median_s": 3.1, "each_s": [3.1],
                                                    "median_rep": {"replay_ms": 0.4134}}),
            _row("vit_b_16", 1, 0.6, 0.68, fresh_load={"median_s": 2.5, "each_s": [2.5], "median_rep": {}})]
    body = [ln for ln in corpus_gpu.table(rows).splitlines()[2:] if ln.startswith("| ")]
    assert "| 3.1 (3.1); back to back 0.413 ms |" in body[0] and "| 2.5 (2.5) |" in body[1]


def test_each_build_starts_with_compiler_caches_of_its_own(tmp_path, monkeypatch):
    """A build's Inductor and Triton caches are its own and empty (the same model's build of another tree, or an
    earlier call's on the same machine, shares no kernels with it); its rebuild takes them as that build left
    them; the caches of the process are back after either."""
    import os

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/machine/inductor")
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    with corpus_gpu.build_caches("bert_b1", tmp_path, empty=True):
        inductor = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
        assert inductor == tmp_path / "compiler-caches" / "bert_b1" / "inductor"
        assert Path(os.environ["TRITON_CACHE_DIR"]).parent == inductor.parent
        inductor.mkdir(parents=True)
        (inductor / "kernel").write_text("compiled")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/machine/inductor" and "TRITON_CACHE_DIR" not in os.environ
    with corpus_gpu.build_caches("bert_b1", tmp_path, empty=False):
        assert (Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) / "kernel").is_file()  # the rebuild: as it was left
    with corpus_gpu.build_caches("bert_b1", tmp_path, empty=True):
        assert not (Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) / "kernel").exists()  # a first build: empty


def test_a_costs_row_has_no_baseline_and_stays_out_of_the_geometric_mean():
    """``--costs`` rows time the bundle against its own engines only: no torch.compile column, no ratio to it."""
    costs = _row("nasnetalarge", 1, 1.5, 0.0, fresh_load={"median_s": 2.8, "each_s": [2.8, 2.9, 2.7]},
                 rebuild={"build_s": 9.0, "compile_jobs": 0})
    del costs["compile_ms"]
    text = corpus_gpu.table([costs, _row("resnet50", 1, 0.3, 0.45)])
    body = [ln for ln in text.splitlines()[2:] if ln.startswith("| ")]
    cells = [c.strip() for c in body[0].strip("|").split("|")]
    header = [c.strip() for c in text.splitlines()[0].strip("|").split("|")]
    assert cells[header.index("torch.compile ms")] == "-" and cells[header.index("vs compile")] == "-"
    assert cells[header.index("vs one stream")] == "1.10x"
    assert cells[header.index("fresh load s")].startswith("2.8 (2.8, 2.9, 2.7)")
    assert cells[header.index("rebuild s")] == "9 (0 compile jobs)"
    assert "batch 1: geometric mean over 1 models: 1.50x" in text  # resnet50 alone


def test_costs_reaches_every_build_process(tmp_path, fake_run, capsys):
    assert corpus_gpu.main(["--models", "resnet50", "--costs", "--rebuild", "--fresh-loads", "0", "--workers", "1",
                            "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    assert len(_FakeBuild.launched) == 2 and all("--costs" in c for c in _FakeBuild.launched)
