"""``parastream demo``: the main job end to end on a bundled example model.

Writes the example model, inspects it, builds a verified bundle (rewrite search,
branches on streams, one engine per branch), runs it on random inputs and
compares with ONNX Runtime on the original model.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import onnx


def run_demo(out: str | None = None, backend: str = "auto", model_name: str | None = None, console=None) -> int:
    from . import zoo

    name = model_name or zoo.DEMO_MODEL
    if name not in zoo.MODELS:
        from parastream.launcher.errors import ParastreamError

        raise ParastreamError(f"--model {name!r} is not an example model; choose one of {sorted(zoo.MODELS)}")
    # the example model, and the bundle unless -o named a folder; the object removes the folder however the block
    # ends (an interrupt too), and even if the signal came before the block began
    with tempfile.TemporaryDirectory(prefix="parastream-demo-", ignore_cleanup_errors=True) as work:
        return _demo(Path(work), name, out, backend, console)


def _demo(work: Path, name: str, out: str | None, backend: str, console) -> int:
    import onnxruntime as ort
    from rich.table import Table

    from parastream.launcher import load
    from parastream.launcher.words import plural

    from . import zoo
    from .build import build
    from .report import inspect_model, print_build_summary

    model_path = work / f"{name}.onnx"
    onnx.save(zoo.MODELS[name](), model_path)
    out_dir = Path(out) if out else work / "bundle"
    console.rule(f"parastream demo: {name}")
    console.print(f"example model written to {model_path}")
    console.rule("inspect: the cost model's estimates, before anything is built or timed")
    estimate = inspect_model(model_path, console=console)

    console.rule("build")
    t0 = time.perf_counter()
    bundle = build(model_path, out_dir, backend=backend, force=True, progress=True)
    console.print(f"built in {time.perf_counter() - t0:.1f} s")
    print_build_summary(bundle, console)
    built = (bundle.plan.num_streams, len(bundle.plan.branches))
    what = f"{plural(built[1], 'engine')} on {plural(built[0], 'stream')}"
    if built != (estimate["streams"], estimate["branches"]):
        what += (f", not the estimate's {plural(estimate['streams'], 'stream')} and {plural(estimate['branches'], 'branch')}"
                 f" ({'the CPU choice above says' if bundle.report.get('cpu_choice') else 'the timings above say'} why)")
    console.print(f"built: {what}")

    console.rule("run")
    runner = load(bundle.path)
    rng = np.random.default_rng(2026)
    feeds = {t.name: rng.standard_normal(t.shape).astype(t.dtype) for t in bundle.plan.inputs}
    sess = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    reference = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    outputs = runner(feeds)
    t = Table(title="bundle vs onnxruntime on the original model, fresh random input")
    for col in ("output", "shape", "max abs error", "max rel error"):
        t.add_column(col)
    for k, v in outputs.items():
        ref = reference[k]
        diff = np.abs(np.asarray(v, dtype=np.float64) - ref)
        rel = float((diff / np.maximum(np.abs(ref), 1e-6)).max())
        t.add_row(k, "x".join(map(str, ref.shape)), f"{float(diff.max()):.3g}", f"{rel:.3g}")
    console.print(t)
    if out:
        console.print(f"bundle: {bundle.path}  (run it: parastream run {bundle.path} --input NAME=x.npy --output-dir out/)")
    else:
        console.print("the bundle was written to a temporary folder, now removed; `parastream demo -o DIR` keeps it")
    runner_close = getattr(runner, "close", None)
    if runner_close:
        runner_close()
    return 0
