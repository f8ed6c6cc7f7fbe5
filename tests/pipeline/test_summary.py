"""The summary describes the build that shipped: the printed lines, ``--json`` and report.json agree with the
bundle's plan.json and model.onnx, and what the rewrite search proposed but the CPU choice did not ship is said as
such; the CPU profile's stream estimates are called estimates."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import onnx
import pytest

from parastream.launcher.bundle import Bundle
from parastream.pipeline.cli import main

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples" / "models").glob("*.onnx"))


def ops(model: onnx.ModelProto) -> list[tuple[str, str]]:
    return [(n.op_type, n.name) for n in model.graph.node]


def check_summary(out: Path, summary: dict, printed: str) -> None:
    bundle = Bundle.open(out)
    shipped = onnx.load(out / "model.onnx")
    assert summary["engines"] == len(bundle.plan.branches) == len(json.loads((out / "plan.json").read_text())["branches"])
    assert summary["streams"] == bundle.plan.num_streams
    assert summary["nodes_out"] == len(shipped.graph.node) == bundle.report["model"]["nodes_out"]
    original = onnx.load(bundle.report["model"]["path"])
    from parastream.pipeline.model_io import load_model

    loaded = load_model(bundle.report["model"]["path"], {t.name: t.shape for t in bundle.plan.inputs}).model
    if summary["rewrites"]:  # rewrites shipped: model.onnx is not the loaded model
        assert ops(shipped) != ops(loaded), summary
    else:  # none shipped: model.onnx holds the loaded model's nodes
        assert ops(shipped) == ops(loaded) or len(shipped.graph.node) == len(original.graph.node), summary
    first = printed.strip().splitlines()[0]
    n_eng, n_str = (int(x) for x in re.search(r": (\d+) \w+ engines? on (\d+) streams?", first).groups())
    assert (n_eng, n_str) == (summary["engines"], summary["streams"])
    line = next(x for x in printed.splitlines() if "rewrite search" in x)
    if summary["rewrites_proposed"] and not summary["rewrites"]:
        assert "proposed" in line and "not shipped" in line, line
    elif summary["rewrites"]:
        assert "not shipped" not in line and "proposed" not in line, line
    assert not re.search(r"\b1 (streams|engines|pieces|rewrites|branches)\b", printed), printed


@pytest.mark.parametrize("model", EXAMPLES, ids=[m.stem for m in EXAMPLES])
def test_summary_describes_the_shipped_bundle(model, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["build", str(model), "-o", str(out), "--backend", "onnxruntime", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    check_summary(out, summary, _summary_lines(out, capsys))


def _summary_lines(out: Path, capsys) -> str:
    from parastream.pipeline.cli import _console
    from parastream.pipeline.report import print_build_summary

    print_build_summary(Bundle.open(out), _console())
    return capsys.readouterr().out


def test_a_proposal_the_cpu_choice_did_not_ship_is_called_a_proposal(tmp_path, capsys, monkeypatch):
    """The CPU choice keeps the original model (as on a loaded machine, or where the rewrite was timed no faster):
    the summary's rewrites are 0, and the search's rewrites are its proposal."""
    build_module = importlib.import_module("parastream.pipeline.measure")
    monkeypatch.setattr(build_module, "CPU_BUSY_SHARE", -1.0)  # every machine counts as busy: the default is kept
    model = next(m for m in EXAMPLES if m.stem == "small_net")
    out = tmp_path / "out"
    assert main(["build", str(model), "-o", str(out), "--backend", "onnxruntime", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["rewrites_proposed"] > 0 and summary["rewrites"] == 0
    assert summary["nodes_out"] == summary["nodes_in"]
    check_summary(out, summary, _summary_lines(out, capsys))


def test_without_cpu_timing_the_search_ships(tmp_path, capsys):
    from parastream.pipeline import build

    model = next(m for m in EXAMPLES if m.stem == "small_net")
    out = tmp_path / "out"
    build(model, out, backend="onnxruntime", measure=False)
    from parastream.pipeline.report import build_summary

    summary = build_summary(Bundle.open(out))
    assert summary["rewrites"] == summary["rewrites_proposed"] > 0
    check_summary(out, summary, _summary_lines(out, capsys))


def test_inspect_calls_the_cpu_stream_estimates_estimates(capsys):
    model = next(m for m in EXAMPLES if m.stem == "inception_block")
    assert main(["inspect", str(model), "--device-profile", "CPU"]) == 0
    printed = capsys.readouterr().out
    assert "not measured" in printed and "ships one session unless the plan is timed faster" in printed


def test_devices_calls_the_cpu_profile_nominal(capsys):
    assert main(["devices"]) == 0
    printed = capsys.readouterr().out
    assert "not measured" in printed and "CPU measured" not in printed
