"""What a one-engine model's round alternatives cost to compile, one after another, each alone on the machine.

A GPU build of a one-stream model (MixNet-S, EfficientNet-B0, DenseNet-121) times its choices (GEMM epilogue,
depthwise kernels, conv+ReLU) on whole-model compiles: its input and every alternative is one Inductor compile of
the whole model, and a build runs up to ten of them side by side (bench/NOTES.md, "Open questions").  Two things
decide what would make them cheaper, and this measures both:

* how long one whole-model compile takes alone, cold (empty Inductor and Triton caches) and after the input's
  compile filled the caches (the alternatives share most of the input's kernels: a GEMM epilogue off changes the
  classifier's kernels only);
* whether those shared kernels are found in the caches: Inductor names each Triton kernel with a running index
  (``triton_poi_fused_add_12``), so a kernel after the first changed node differs in name, and so in Triton's
  cache key, even where its code is the same.  ``TORCHINDUCTOR_UNIQUE_KERNEL_NAMES=0`` names every kernel
  ``triton_`` instead (Inductor's own setting for caching).

Each compile runs in a fresh process of its own through the build's compile job (``Engines.precompile``: one
job compiles in the calling process, with Inductor's compile threads as a worker gives a large branch,
``large_compile_threads``), the sequence sharing one pair of cache folders per mode, with ``--modes`` the
kernel-name settings to run.  Prints and
writes per compile its seconds, whether it failed, the Triton cache's entries before and after, and the phases
torch times itself (``torch_phases``: lowering, scheduling, code generation, the wait for its kernels); with
``--profile``, Python's profile of the compile as well.

    python3 bench/whole_model_compiles.py --model mixnet_s --out $OUT          # on the device
    python3 bench/whole_model_compiles.py --onnx M.onnx --device cpu --out /tmp/wmc   # the plumbing only: a CPU
                                                                      # engine is not compiled at build (jobs 0)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: what ``--variants`` compiles by default: the input, then the alternatives of these rounds
DEFAULT_VARIANTS = "input,GEMM epilogue,depthwise convolutions,conv+ReLU"


def child(onnx_path: str, variant: str, device: str, profile: str = "") -> dict:
    """One compile of ``onnx_path`` as one engine, in this (fresh) process: the input, or the alternative the
    build's round ``variant`` races (``pipeline.measure.alternative_variants``, the build's own forms)."""
    from dataclasses import replace

    from parastream.launcher.engines import get_backend, require_backend
    from parastream.pipeline.build import BuildConfig, Engines, engine_options
    from parastream.pipeline.measure import Variant, alternative_variants
    from parastream.pipeline.model_io import load_model
    from parastream.rewrite.cost import RooflineCostModel

    # (on a CPU, the torch backend's CPU compile: ``require_backend`` refuses it, as a build does)
    backend = require_backend("torch") if device == "cuda" else get_backend("torch")
    loaded = load_model(onnx_path)
    options = replace(engine_options(BuildConfig(precision="fp16" if device == "cuda" else "fp32"), backend),
                      device=device, compile_workers=1)
    engines = Engines(backend, RooflineCostModel(), loaded, options.precision, blocks=False)
    v = Variant(loaded.model, loaded.graph, engines.plan(loaded.graph, 1, 1), options)
    if variant != "input":
        rounds = dict(alternative_variants(engines, v))
        if variant not in rounds:
            return {"variant": variant, "error": f"no such round for this model; its rounds: {sorted(rounds)}"}
        v = rounds[variant]
    prof = None
    if profile:  # Python's profiler around the compile (Inductor's own compile threads are processes it cannot see)
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    got = engines.precompile([v])
    row = {"variant": variant, "compile_s": round(time.perf_counter() - t0, 2), "jobs": got.get("jobs"),
           "failed": got.get("failed"), "engines": len(v.plan.branches)}
    if prof is not None:
        import io
        import pstats

        prof.disable()
        prof.dump_stats(profile)
        for sort in ("cumulative", "tottime"):
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats(sort).print_stats(25)
            row[f"profile_{sort}"] = [line for line in text.getvalue().splitlines() if line.strip()][-27:]
    # the phases torch times itself (``dynamo_timed``: lowering, scheduling, code generation, waiting for kernels)
    try:
        from torch._dynamo.utils import compile_times

        row["torch_phases"] = compile_times(repr="str", aggregate=True)
    except Exception as e:  # noqa: BLE001 - another torch: the row goes without
        row["torch_phases"] = f"{type(e).__name__}: {e}"
    return row


def _entries(folder: Path) -> int:
    return sum(1 for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def main() -> None:
    if sys.argv[1:2] == ["--child"]:  # one compile, in the fresh process the sequence started for it
        onnx_path, variant, device, profile = sys.argv[2:6]
        print("RESULT " + json.dumps(child(onnx_path, variant, device, profile)), flush=True)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a bench/gpu.py make_model name, exported here")
    src.add_argument("--onnx", help="an ONNX file")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS,
                    help="input, and the rounds whose alternatives to compile (pipeline.measure.ROUNDS)")
    ap.add_argument("--modes", default="1,0", help="TORCHINDUCTOR_UNIQUE_KERNEL_NAMES settings, one sequence each")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds one compile may take")
    ap.add_argument("--out", default="/tmp/whole_model_compiles")
    ap.add_argument("--profile", action="store_true",
                    help="each compile under cProfile: its top entries in the row, its stats in OUT/<mode>-<variant>.prof")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.model:
        sys.path.insert(0, str(Path(__file__).parent))
        from gpu import export, make_model

        model, inputs = make_model(a.model, 1)
        onnx_path = str(out / f"{a.model}.onnx")
        export(model, inputs, onnx_path)
    else:
        onnx_path = a.onnx
    from parastream.pipeline.measure import ROUNDS

    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v != "input" and v not in ROUNDS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; choose from input, {', '.join(ROUNDS)}")
    rows = []
    for mode in [m.strip() for m in a.modes.split(",") if m.strip()]:
        caches = Path(tempfile.mkdtemp(prefix=f"wmc-{mode}-", dir=out))
        env = dict(os.environ, TORCHINDUCTOR_UNIQUE_KERNEL_NAMES=mode, TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
                   TRITON_CACHE_DIR=str(caches / "triton"), PARASTREAM_COMPILE_WORKERS="1")
        for variant in variants:
            before = _entries(caches / "triton")
            t0 = time.perf_counter()
            try:
                prof = str(out / f"{mode}-{variant.replace(' ', '_').replace('+', '_')}.prof") if a.profile else ""
                p = subprocess.run([sys.executable, __file__, "--child", onnx_path, variant, a.device, prof],
                                   env=env, capture_output=True, text=True, timeout=a.timeout)
                got = next((json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")), None)
                row = got or {"variant": variant, "error": (p.stderr.strip().splitlines() or ["no result"])[-1][:400]}
            except subprocess.TimeoutExpired as e:
                tail = (e.stderr or b"").decode(errors="replace").strip().splitlines()[-5:] if e.stderr else []
                row = {"variant": variant, "error": f"over {a.timeout:.0f} s", "stderr_tail": tail}
            row.update(mode=mode, process_s=round(time.perf_counter() - t0, 2), triton_entries_before=before,
                       triton_entries_after=_entries(caches / "triton"))
            rows.append(row)
            print(json.dumps(row), flush=True)
            (out / "whole_model_compiles.json").write_text(json.dumps({"onnx": onnx_path, "device": a.device,
                                                                       "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
