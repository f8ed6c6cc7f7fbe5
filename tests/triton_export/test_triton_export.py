"""export-triton: repository layout, configs that parse strictly with Triton's ModelConfig, agreement with the
bundle, ensemble wiring (one producer per tensor), validate_repository, atomic writes, and the CLI."""

from __future__ import annotations

import shutil

import pytest
from google.protobuf import text_format
from triton_helpers import model_config_or_skip

from parastream.launcher.bundle import Bundle
from parastream.launcher.errors import ParastreamError
from parastream.pipeline.cli import main
from parastream.pipeline.triton import (
    P_BUNDLE,
    P_ENSEMBLE,
    TRITON_DTYPES,
    export_triton,
    read_config,
    validate_repository,
)

mc = model_config_or_skip()


def _type(name: str) -> str:
    return TRITON_DTYPES[name]


def _io_table(ios) -> dict:
    return {io.name: (mc.DataType.Name(io.data_type), list(io.dims)) for io in ios}


def _hidden(repo):
    return [p.name for p in repo.iterdir() if p.name.startswith(".")]


# -- graph mode ------------------------------------------------------------------------------------------
def test_graph_layout_and_config(bundles, tmp_path):
    bundle, _ = bundles["three"]
    repo = tmp_path / "repo"
    path = export_triton(bundle.path, repo, name="incep")
    assert path == repo / "incep"
    assert sorted(p.name for p in repo.iterdir()) == ["incep"]
    assert (path / "config.pbtxt").is_file() and (path / "1" / "model.py").is_file()
    # the bundle travels unchanged: its manifest hashes still hold
    inner = Bundle.open(path / "1" / "bundle")
    assert inner.plan.to_json() == bundle.plan.to_json()

    config = read_config(path / "config.pbtxt")
    assert config.name == "incep" and config.backend == "python" and config.platform == ""
    assert config.max_batch_size == 0
    plan = bundle.plan
    assert _io_table(config.input) == {t.name: (_type(t.dtype), t.shape) for t in plan.inputs}
    assert _io_table(config.output) == {t.name: (_type(t.dtype), t.shape) for t in plan.outputs}
    assert _io_table(config.input) == {"input": ("TYPE_FP32", [1, 4, 8, 8])}
    # onnxruntime engines run on the CPU: CPU instances
    assert [(mc.ModelInstanceGroup.Kind.Name(g.kind), g.count) for g in config.instance_group] == [("KIND_CPU", 1)]
    assert config.parameters[P_BUNDLE].string_value == "bundle"
    assert "FORCE_CPU_ONLY_INPUT_TENSORS" not in config.parameters
    assert not config.HasField("dynamic_batching")
    assert validate_repository(repo) == []
    assert _hidden(repo) == []


def test_configs_parse_strictly_and_unknown_fields_fail(bundles, tmp_path):
    repo = tmp_path / "repo"
    export_triton(bundles["three"][0], repo, name="m")
    text = (repo / "m" / "config.pbtxt").read_text()
    text_format.Parse(text, mc.ModelConfig())  # strict: would raise on anything unknown
    with pytest.raises(text_format.ParseError):
        text_format.Parse(text + "\nnot_a_field: 1\n", mc.ModelConfig())
    (repo / "m" / "config.pbtxt").write_text(text + "\nnot_a_field: 1\n")
    problems = validate_repository(repo)
    assert len(problems) == 1 and "does not parse" in problems[0] and "not_a_field" in problems[0]


def test_template_matches_packaged_file(bundles, tmp_path):
    from parastream.pipeline.triton import TEMPLATE

    repo = tmp_path / "repo"
    export_triton(bundles["three"][0], repo, name="m")
    assert (repo / "m" / "1" / "model.py").read_bytes() == TEMPLATE.read_bytes()
    compile(TEMPLATE.read_text(), str(TEMPLATE), "exec")


def test_two_outputs_and_instances(bundles, tmp_path):
    bundle, _ = bundles["two_output"]
    repo = tmp_path / "repo"
    export_triton(bundle, repo, name="two", instances=3)
    config = read_config(repo / "two" / "config.pbtxt")
    assert _io_table(config.output) == {"y": ("TYPE_FP32", [2, 16]), "aux": ("TYPE_FP32", [2, 16])}
    assert [g.count for g in config.instance_group] == [3]
    assert validate_repository(repo) == []


def test_graph_max_batch_drops_the_batch_dim(bundles, tmp_path):
    bundle, _ = bundles["three_b4"]
    repo = tmp_path / "repo"
    export_triton(bundle, repo, name="b", max_batch=4)
    config = read_config(repo / "b" / "config.pbtxt")
    assert config.max_batch_size == 4
    assert _io_table(config.input) == {"input": ("TYPE_FP32", [4, 8, 8])}
    assert _io_table(config.output) == {"output": ("TYPE_FP32", [12, 8, 8])}
    assert config.HasField("dynamic_batching")
    assert validate_repository(repo) == []
    # a smaller max batch is fine: model.py pads the batch up to the bundle's 4
    export_triton(bundle, repo, name="b2", max_batch=2)
    assert read_config(repo / "b2" / "config.pbtxt").max_batch_size == 2
    assert validate_repository(repo) == []


def test_a_bucketed_bundle_batches_to_max_with_its_buckets_preferred(tmp_path):
    """A --batch 1:2:4 bundle: max_batch_size MAX (by default), preferred batch sizes the buckets, dims without
    the batch; model.py hands the launcher the requests' rows unpadded (bucketed)."""
    import onnx
    from graphs import three_branch_model

    from parastream.pipeline import build

    onnx.save(three_branch_model(batch="N"), tmp_path / "dyn.onnx")
    bundle = build(tmp_path / "dyn.onnx", tmp_path / "bundle", backend="onnxruntime", batch=(1, 2, 4), search=False,
                   measure=False)
    repo = tmp_path / "repo"
    export_triton(bundle, repo, name="b")
    config = read_config(repo / "b" / "config.pbtxt")
    assert config.max_batch_size == 4
    assert list(config.dynamic_batching.preferred_batch_size) == [1, 2, 4]
    assert _io_table(config.input) == {"input": ("TYPE_FP32", [4, 8, 8])}
    assert (repo / "b" / "1" / "bundle" / "buckets" / "b2" / "plan.json").is_file()
    assert Bundle.open(repo / "b" / "1" / "bundle").manifest["buckets"]["sizes"] == [1, 2, 4]
    assert validate_repository(repo) == []
    export_triton(bundle, repo, name="b2", max_batch=2)  # a smaller max batch prefers the buckets it can reach
    assert list(read_config(repo / "b2" / "config.pbtxt").dynamic_batching.preferred_batch_size) == [1, 2]


def test_graph_max_batch_beyond_the_bundle_batch_is_refused(bundles, tmp_path):
    bundle, _ = bundles["three_b4"]
    with pytest.raises(ParastreamError, match=r"--max-batch 8 exceeds the batch 4.*--shapes input:8x4x8x8"):
        export_triton(bundle, tmp_path / "repo", name="b", max_batch=8)
    with pytest.raises(ParastreamError, match="exceeds the batch 1"):
        export_triton(bundles["three"][0], tmp_path / "repo", name="b", max_batch=2)
    assert not (tmp_path / "repo").exists() or list((tmp_path / "repo").iterdir()) == []


def test_bad_options(bundles, tmp_path):
    b = bundles["three"][0]
    for kwargs, pattern in [({"name": ""}, "--name"), ({"name": "a/b"}, "--name"), ({"name": ".hidden"}, "--name"),
                            ({"name": "m", "mode": "fast"}, "--mode"), ({"name": "m", "instances": 0}, "--instances"),
                            ({"name": "m", "max_batch": -1}, "--max-batch")]:
        with pytest.raises(ParastreamError, match=pattern):
            export_triton(b, tmp_path / "repo", **kwargs)
    with pytest.raises(ParastreamError, match="not a parastream bundle"):
        export_triton(tmp_path / "nothing", tmp_path / "repo", name="m")


# -- ensemble mode --------------------------------------------------------------------------------------
def test_ensemble_needs_a_tensorrt_bundle(bundles, tmp_path):
    with pytest.raises(ParastreamError, match="--mode ensemble.*--backend onnxruntime.*--backend tensorrt"):
        export_triton(bundles["three"][0], tmp_path / "repo", name="m", mode="ensemble")
    assert not (tmp_path / "repo").exists() or list((tmp_path / "repo").iterdir()) == []


def test_ensemble_layout_and_wiring(bundles, tmp_path):
    bundle, _ = bundles["three_trt"]
    plan = bundle.plan
    repo = tmp_path / "repo"
    export_triton(bundle, repo, name="ens", mode="ensemble", instances=2)
    branch_models = [f"ens_{b.name}" for b in plan.branches]
    assert sorted(p.name for p in repo.iterdir()) == sorted(["ens", *branch_models])
    assert (repo / "ens" / "1").is_dir()

    configs = {n: read_config(repo / n / "config.pbtxt") for n in ["ens", *branch_models]}
    for b in plan.branches:
        cfg = configs[f"ens_{b.name}"]
        assert cfg.platform == "tensorrt_plan" and cfg.max_batch_size == 0
        assert (repo / cfg.name / "1" / "model.plan").read_bytes() == bundle.engine_path(b).read_bytes()
        assert _io_table(cfg.input) == {t: (_type(plan.tensors[t].dtype), plan.tensors[t].shape) for t in b.inputs}
        assert _io_table(cfg.output) == {t: (_type(plan.tensors[t].dtype), plan.tensors[t].shape) for t in b.outputs}
        assert [(mc.ModelInstanceGroup.Kind.Name(g.kind), g.count) for g in cfg.instance_group] == [("KIND_GPU", 2)]
        assert cfg.parameters[P_ENSEMBLE].string_value == "ens"

    ens = configs["ens"]
    assert ens.platform == "ensemble" and not ens.instance_group
    assert _io_table(ens.input) == {t.name: (_type(t.dtype), t.shape) for t in plan.inputs}
    assert _io_table(ens.output) == {t.name: (_type(t.dtype), t.shape) for t in plan.outputs}
    steps = ens.ensemble_scheduling.step
    assert sorted(s.model_name for s in steps) == sorted(branch_models)

    # every ensemble tensor has exactly one producer; every consumed tensor has one or is an ensemble input
    producers: dict[str, list[str]] = {}
    for s in steps:
        for key, tensor in s.output_map.items():
            producers.setdefault(tensor, []).append(s.model_name)
    assert all(len(p) == 1 for p in producers.values()), producers
    inputs = {io.name for io in ens.input}
    assert not inputs & set(producers)
    for s in steps:
        sub = configs[s.model_name]
        assert set(s.input_map) == {io.name for io in sub.input}
        assert set(s.output_map) == {io.name for io in sub.output}
        for tensor in s.input_map.values():
            assert tensor in producers or tensor in inputs
    assert {io.name for io in ens.output} <= set(producers)
    # the three convolution branches of the model are independent steps: none reads another's output
    independent = [s for s in steps if set(s.input_map.values()) <= inputs]
    assert len(independent) >= 2
    assert validate_repository(repo) == []


def test_ensemble_refuses_max_batch(bundles, tmp_path):
    with pytest.raises(ParastreamError, match="static shapes"):
        export_triton(bundles["three_trt"][0], tmp_path / "repo", name="e", mode="ensemble", max_batch=1)


def _ensemble_repo(bundles, tmp_path):
    repo = tmp_path / "repo"
    export_triton(bundles["three_trt"][0], repo, name="ens", mode="ensemble")
    return repo, read_config(repo / "ens" / "config.pbtxt")


def _rewrite(repo, config):
    (repo / config.name / "config.pbtxt").write_text(text_format.MessageToString(config))


def test_validator_finds_two_producers(bundles, tmp_path):
    repo, ens = _ensemble_repo(bundles, tmp_path)
    steps = ens.ensemble_scheduling.step
    # a second step writes one of its own outputs into the first step's output tensor
    first_out = next(iter(steps[0].output_map.items()))
    own_key = next(iter(steps[1].output_map))
    steps[1].output_map[own_key] = first_out[1]
    _rewrite(repo, ens)
    problems = validate_repository(repo)
    assert any("producers" in p and repr(first_out[1]) in p for p in problems), problems


def test_validator_finds_a_missing_producer(bundles, tmp_path):
    repo, ens = _ensemble_repo(bundles, tmp_path)
    # the step that writes the model output no longer does
    out = ens.output[0].name
    for s in ens.ensemble_scheduling.step:
        for key, tensor in list(s.output_map.items()):
            if tensor == out:
                s.output_map[key] = "renamed"
    _rewrite(repo, ens)
    problems = validate_repository(repo)
    assert any(f"ensemble output {out!r} is produced by no step" in p for p in problems), problems


def test_validator_finds_type_and_dims_disagreement(bundles, tmp_path):
    repo, ens = _ensemble_repo(bundles, tmp_path)
    ens.input[0].data_type = mc.DataType.Value("TYPE_FP16")
    ens.output[0].dims[0] = 7
    _rewrite(repo, ens)
    problems = validate_repository(repo)
    assert any("TYPE_FP16" in p and "TYPE_FP32" in p for p in problems), problems
    assert any("has dims [7" in p for p in problems), problems


def test_validator_finds_missing_files_and_unknown_models(bundles, tmp_path):
    repo, ens = _ensemble_repo(bundles, tmp_path)
    first = ens.ensemble_scheduling.step[0].model_name
    (repo / first / "1" / "model.plan").unlink()
    ens.ensemble_scheduling.step[1].model_name = "nowhere"
    _rewrite(repo, ens)
    problems = validate_repository(repo)
    assert any("model.plan: missing" in p for p in problems), problems
    assert any("'nowhere'" in p for p in problems), problems


def test_validator_checks_graph_models_against_their_bundle(bundles, tmp_path):
    repo = tmp_path / "repo"
    export_triton(bundles["three"][0], repo, name="m")
    config = read_config(repo / "m" / "config.pbtxt")
    config.input[0].dims[1] = 5
    config.output[0].name = "other"
    _rewrite(repo, config)
    problems = validate_repository(repo)
    assert any("'input' has dims [1, 5, 8, 8]" in p for p in problems), problems
    assert any("outputs ['other']" in p for p in problems), problems
    # a modified bundle fails its hash check
    export_triton(bundles["three"][0], repo, name="m", force=True)
    (repo / "m" / "1" / "bundle" / "plan.json").write_text((repo / "m" / "1" / "bundle" / "plan.json").read_text() + " ")
    assert any("sha256" in p for p in validate_repository(repo))
    (repo / "m" / "1" / "model.py").unlink()
    assert any("model.py: missing" in p for p in validate_repository(repo))


def test_validator_reports_hidden_folders(bundles, tmp_path):
    """tritonserver takes a hidden folder for a model too, and does not start when it fails to load
    (tests/triton_server shows it on the real server); a valid export leaves none behind."""
    repo = tmp_path / "repo"
    export_triton(bundles["three"][0], repo, name="m")
    (repo / ".notes.txt").write_text("a hidden file is no folder: Triton ignores it")
    assert validate_repository(repo) == []
    # what an export that died before its rename leaves: the staging folder, holding the model
    leftover = repo / ".m.k2j4.partial"
    shutil.copytree(repo / "m", leftover / "m")
    problems = validate_repository(repo)
    assert problems == [f"{leftover}: a hidden folder, which Triton still loads as a model (and fails on); "
                        "remove it (an interrupted export-triton leaves one behind)"]
    shutil.rmtree(repo / "m")
    problems = validate_repository(repo)
    assert problems[0].startswith(f"{leftover}: a hidden folder") and problems[1] == f"{repo}: no model folders"


def test_validator_on_no_repository(tmp_path):
    assert validate_repository(tmp_path / "none") == [f"{tmp_path / 'none'}: no such folder"]
    (tmp_path / "empty").mkdir()
    assert "no model folders" in validate_repository(tmp_path / "empty")[0]
    (tmp_path / "empty" / "x").mkdir()
    assert "config.pbtxt: missing" in validate_repository(tmp_path / "empty")[0]


# -- atomic writes, --force -------------------------------------------------------------------------------
def test_existing_model_needs_force(bundles, tmp_path):
    repo = tmp_path / "repo"
    export_triton(bundles["three"][0], repo, name="m")
    before = (repo / "m" / "config.pbtxt").read_text()
    with pytest.raises(ParastreamError, match="already exists; pass --force"):
        export_triton(bundles["two_output"][0], repo, name="m")
    assert (repo / "m" / "config.pbtxt").read_text() == before
    export_triton(bundles["two_output"][0], repo, name="m", force=True)
    assert {io.name for io in read_config(repo / "m" / "config.pbtxt").output} == {"y", "aux"}
    assert _hidden(repo) == [] and validate_repository(repo) == []


def test_force_replaces_an_ensemble_and_its_branch_models(bundles, tmp_path):
    repo = tmp_path / "repo"
    export_triton(bundles["three_trt"][0], repo, name="ens", mode="ensemble")
    (repo / "other").mkdir()  # someone else's folder stays
    with pytest.raises(ParastreamError, match="already exists"):
        export_triton(bundles["three"][0], repo, name="ens")
    export_triton(bundles["three"][0], repo, name="ens", force=True)
    assert sorted(p.name for p in repo.iterdir()) == ["ens", "other"]
    assert read_config(repo / "ens" / "config.pbtxt").backend == "python"


def test_failure_leaves_nothing_behind(bundles, tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    export_triton(bundles["three"][0], repo, name="keep")

    def broken_copytree(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(shutil, "copytree", broken_copytree)
    with pytest.raises(OSError, match="disk full"):
        export_triton(bundles["three"][0], repo, name="new")
    with pytest.raises(OSError, match="disk full"):
        export_triton(bundles["three"][0], repo, name="keep", force=True)
    assert sorted(p.name for p in repo.iterdir()) == ["keep"]
    assert validate_repository(repo) == []


# -- CLI ---------------------------------------------------------------------------------------------------
def test_cli_export_triton(bundles, tmp_path, capsys):
    bundle = bundles["three_b4"][0]
    repo = tmp_path / "repo"
    assert main(["export-triton", str(bundle.path), str(repo), "--name", "cli", "--max-batch", "4", "--instances", "2"]) == 0
    config = read_config(repo / "cli" / "config.pbtxt")
    assert config.max_batch_size == 4 and config.instance_group[0].count == 2
    assert main(["export-triton", str(bundle.path), str(repo), "--name", "cli"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["export-triton", str(bundle.path), str(repo), "--name", "cli", "--force"]) == 0
    assert main(["export-triton", str(bundle.path), str(repo), "--name", "e", "--mode", "ensemble"]) == 2
    assert "--backend tensorrt" in capsys.readouterr().err


def test_cli_build_with_triton_repo(tmp_path):
    import onnx
    from graphs import three_branch_model

    model = three_branch_model()
    model.ir_version = 8
    onnx.save(model, tmp_path / "blocks.onnx")
    repo = tmp_path / "repo"
    assert main(["build", str(tmp_path / "blocks.onnx"), "-o", str(tmp_path / "out"), "--backend", "onnxruntime", "--no-search",
                 "--streams", "2", "--quiet", "--triton-repo", str(repo)]) == 0
    assert sorted(p.name for p in repo.iterdir()) == ["blocks"]  # named after the model file
    assert validate_repository(repo) == []


def test_cli_validate_triton_valid_repository(bundles, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # rich folds long lines at the terminal width
    repo = tmp_path / "repo"
    export_triton(bundles["three"][0], repo, name="m")
    export_triton(bundles["three_trt"][0], repo, name="e", mode="ensemble")
    assert main(["validate-triton", str(repo)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ok: ") and out.strip().count("\n") == 0
    models = sorted(d.name for d in repo.iterdir())
    assert len(models) > 2 and "m" in models and "e" in models  # the ensemble brings its branch models
    assert f"{repo} is a valid Triton model repository ({len(models)} models: {', '.join(models)})" in out


def test_cli_validate_triton_lists_problems_and_exits_1(bundles, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")
    repo = tmp_path / "repo"
    export_triton(bundles["three"][0], repo, name="m")
    (repo / "m" / "1" / "model.py").unlink()
    config = read_config(repo / "m" / "config.pbtxt")
    config.input[0].dims[1] = 5
    _rewrite(repo, config)
    expected = validate_repository(repo)
    assert len(expected) >= 2
    assert main(["validate-triton", str(repo)]) == 1
    out = capsys.readouterr().out
    assert f"{len(expected)} problems" in out and "ok:" not in out
    assert "m/1/model.py" in out and "missing" in out  # paths shown relative to the repository
    assert "'input' has dims [1, 5, 8, 8]" in out
    assert str(repo / "m") not in out


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_cli_validate_triton_without_a_folder_exits_2(tmp_path, capsys, kind):
    target = tmp_path / "repo"
    if kind == "file":
        target.write_text("not a repository")
    assert main(["validate-triton", str(target)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip().count("\n") == 0 and str(target) in captured.err
    assert ("no such folder" if kind == "missing" else "not a folder") in captured.err
