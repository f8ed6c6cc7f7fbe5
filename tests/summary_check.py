"""The check that a build's summary describes the bundle that shipped: ``--json``'s summary and the printed lines
agree with the bundle's plan.json, model.onnx and report.json (engines, streams, nodes, rewrites), and a proposal
the CPU choice did not ship is called one.  Shared by the example models' tests and the public-model corpus."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import onnx

from parastream.launcher.bundle import Bundle


def ops(model: onnx.ModelProto) -> list[tuple[str, str]]:
    return [(n.op_type, n.name) for n in model.graph.node]


def one_json_line(stdout: str) -> dict:
    """The summary a build step parses: stdout must be exactly one line, and that line one JSON object."""
    lines = stdout.splitlines()
    assert len(lines) == 1 and stdout.endswith("\n"), f"stdout is not one line: {stdout!r}"
    summary = json.loads(lines[0])
    assert isinstance(summary, dict), lines[0]
    return summary


def summary_lines(out: Path) -> str:
    """The summary ``parastream build`` prints for the bundle at ``out`` (without --json), as in a build log."""
    from parastream.pipeline.cli import _console
    from parastream.pipeline.report import print_build_summary

    text = io.StringIO()
    with contextlib.redirect_stdout(text):  # _console() writes to stdout; not a terminal: lines as in a log
        print_build_summary(Bundle.open(out), _console())
    return text.getvalue()


def check_summary(out: Path, summary: dict, printed: str) -> None:
    """``summary`` (``build --json``) and ``printed`` (the summary's lines) describe the bundle at ``out``."""
    from parastream.pipeline.model_io import load_model

    bundle = Bundle.open(out)
    shipped = onnx.load(out / "model.onnx")
    report = json.loads((out / "report.json").read_text())
    assert summary["engines"] == len(bundle.plan.branches) == len(json.loads((out / "plan.json").read_text())["branches"])
    assert summary["engines"] == report["schedule"]["branches"]
    assert summary["streams"] == bundle.plan.num_streams == report["schedule"]["streams"]
    assert summary["nodes_out"] == len(shipped.graph.node) == report["model"]["nodes_out"]
    original = onnx.load(report["model"]["path"])
    loaded = load_model(report["model"]["path"], {t.name: t.shape for t in bundle.plan.inputs}).model
    if summary["rewrites"]:  # rewrites shipped: model.onnx is the search's model, not the loaded one
        assert ops(shipped) != ops(loaded), summary
        assert len(shipped.graph.node) == report["search"]["nodes_after"], summary
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
