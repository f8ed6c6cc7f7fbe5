#!/usr/bin/env python3
"""The GPU benchmark behind the README's H100 table: run on the device machine, from the repository root,
after ``source bench/device_env.sh``.

For each model (torchvision Inception-v3, GoogLeNet, ResNet-50; transformers BERT-base,
sequence 128; random weights, batch 1, fp16), exported to ONNX here:
  (a) PyTorch eager, fp16
  (b) the engines of (d) on one stream, in one CUDA Graph
  (c) parastream without the rewrite (search=False)
  (d) parastream with the rewrite search, its top candidates measured on the GPU within --measure-seconds
  (e) the whole model under torch.compile(mode="reduce-overhead")
(a) and (e) run the model as its users run it: BERT with transformers' default attention (``sdpa``, torch's fused
kernels; ``users_model``); only the export builds it with ``attn_implementation="eager"``, whose ONNX is plain ops.
Milliseconds are medians of >= 200 CUDA-event timings after warm-up; errors are
||out - ref|| / ||ref|| against ONNX Runtime (CPU, fp32) on the original ONNX model.

Usage: python3 bench/gpu.py [--models inception_v3,googlenet,resnet50,bert] [--runs 200] [--streams N] [--out DIR]
(--models also takes the torchvision/timm classifiers of bench/corpus.py, e.g. squeezenet1_1,mixnet_s,dpn68)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

MODELS = ("inception_v3", "googlenet", "resnet50", "bert", "bert_sdpa", "llama")


def make_model(name: str, batch: int = 1):
    """(torch model in fp32 eval mode on the CPU, dict of example inputs at ``batch``).  The model is the same
    at every batch (its weights and BatchNorm statistics do not depend on it); see ``at_batch``."""
    model, inputs = _make_model(name)
    return model, at_batch(inputs, batch)


def at_batch(inputs: dict, batch: int) -> dict:
    """``inputs`` (batch 1) at ``batch``: float tensors drawn afresh (a generator seeded by the batch, so that
    the model's own random stream is untouched), integer ones (BERT's token ids and mask) repeated row by row."""
    import torch

    if batch == 1:
        return inputs
    gen = torch.Generator().manual_seed(batch)
    return {k: torch.randn((batch, *v.shape[1:]), generator=gen, dtype=v.dtype) if v.is_floating_point()
            else v.repeat(batch, *[1] * (v.dim() - 1)) for k, v in inputs.items()}


def _make_model(name: str):
    """The model and its batch-1 inputs, every zero-initialised Linear bias drawn at random as a trained model's
    (``corpus.init_zero_biases``)."""
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    import corpus

    model, inputs = _make_model_as_initialised(name)
    corpus.init_zero_biases(model)
    return model, inputs


def _make_model_as_initialised(name: str):
    import torch

    torch.manual_seed(0)
    if name in ("bert", "bert_sdpa"):
        from transformers import BertConfig, BertModel

        # bert: exported with eager attention (plain MatMul/Softmax ops); bert_sdpa: with transformers' default,
        # as a user exports it (SDPA with a boolean mask, written out by the exporter with its IsNaN guard)
        cfg = BertConfig(attn_implementation="eager") if name == "bert" else BertConfig()
        model = BertModel(cfg).eval()
        ids = torch.randint(0, cfg.vocab_size, (1, 128))
        mask = torch.ones(1, 128, dtype=torch.int64)
        mask[:, -16:] = 0
        return model, {"input_ids": ids, "attention_mask": mask}
    if name == "llama":
        from transformers import LlamaConfig, LlamaModel

        # A decoder LM of Llama's architecture at a real layer size (TinyLlama's head layout halved: hidden
        # 1024, 16 heads, 4 key/value heads, MLP 2816, 12 layers; 168M parameters), transformers' default
        # attention (sdpa), prompt of 128 tokens, left-padded by 16 (those queries see no key: the export's
        # IsNaN guard sets them to 0)
        cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                          num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=512, use_cache=False)
        model = LlamaModel(cfg).eval()
        ids = torch.randint(0, cfg.vocab_size, (1, 128))
        mask = torch.ones(1, 128, dtype=torch.int64)
        mask[:, :16] = 0
        return model, {"input_ids": ids, "attention_mask": mask}
    import torchvision

    if name not in MODELS:
        # any vision classifier of the public-model corpus (bench/corpus.py: torchvision/timm, BatchNorm calibrated)
        import corpus

        try:
            spec = corpus.spec_of(name)  # a corpus model, or timm:NAME / torchvision:NAME outside it
        except KeyError:
            spec = None
        if spec is None or spec.source == "transformers" or spec.family in ("detection", "segmentation"):
            raise SystemExit(f"unknown model {name}: {', '.join(MODELS)}, a torchvision/timm classifier of "
                             "bench/corpus.py, or one outside it as timm:NAME or torchvision:NAME")
        model, inputs = corpus.make_model(name)
        return model, {"x": inputs["x"]}
    if name == "inception_v3":
        model = torchvision.models.inception_v3(weights=None, aux_logits=False, init_weights=True)
        x = torch.randn(1, 3, 299, 299)
    elif name == "googlenet":
        model = torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=True)
        x = torch.randn(1, 3, 224, 224)
    elif name == "resnet50":
        model = torchvision.models.resnet50(weights=None)
        x = torch.randn(1, 3, 224, 224)
    else:
        raise SystemExit(f"unknown model {name}")
    # Calibrate the BatchNorm statistics on random images, as training would: with random weights and
    # default statistics activations grow layer by layer and overflow fp16 (Inception-v3 gave NaN).
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None  # cumulative average over the calibration batches
    model.train()
    with torch.no_grad():
        for _ in range(2):
            model(torch.randn(8, *x.shape[1:]))
    model.eval()
    return model, {"x": x}


def users_model(name: str, model):
    """``model`` (``make_model``'s, built for the export) as its users run it, for the PyTorch baselines: BERT
    with transformers' default attention implementation (``sdpa``) and the same weights; other models (bert_sdpa
    and llama are built with that default) as they are.
    The export keeps ``attn_implementation="eager"`` so that its ONNX is MatMul/Softmax rather than an opaque
    kernel; compiling that eager module would handicap torch.compile with an attention no user would choose."""
    if name != "bert":
        return model
    config = type(model.config).from_dict(model.config.to_dict())  # to_dict() leaves the implementation out
    user = type(model)(config).eval()
    user.load_state_dict(model.state_dict())
    return user


def exported_tensors(out):
    """The tensors of a model's output that ``export`` writes, in its order: a transformers encoder's last hidden
    state and its pooler's output (BERT), a decoder's last hidden state, a classifier's logits.  The PyTorch
    baselines return the same (``corpus_gpu.HalfInput``): a baseline that returned less would let torch.compile
    drop the rest as dead code (BERT's pooler) and time less work than the bundle does."""
    if getattr(out, "pooler_output", None) is not None:
        return out.last_hidden_state, out.pooler_output
    if hasattr(out, "last_hidden_state"):
        return out.last_hidden_state
    return out


def export(model, inputs: dict, path: Path, *, dynamic_batch: bool = False) -> list[str]:
    """torch.onnx.export (TorchScript exporter, opset 17) of the model's tensors (BERT: last_hidden_state and
    pooler_output); ``dynamic_batch``: every input and output with a dynamic first dimension "N".  The output
    names."""
    import torch

    names = list(inputs)
    args = tuple(inputs[n] for n in names)

    class Wrap(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, *a):
            return exported_tensors(self.m(*a))

    pooled = "input_ids" in inputs and getattr(getattr(model, "config", None), "model_type", "") == "bert"
    outs = ["last_hidden_state", "pooler_output"] if pooled else ["last_hidden_state"] if "input_ids" in inputs else ["logits"]
    axes = {n: {0: "N"} for n in names + outs} if dynamic_batch else None
    import corpus

    with corpus.mha_fastpath_off(), torch.no_grad():  # torchvision ViT's fast path has no ONNX export
        torch.onnx.export(Wrap(model).eval(), args, str(path), input_names=names, output_names=outs, opset_version=17,
                          dynamo=False, do_constant_folding=True, dynamic_axes=axes)
    model.eval()  # export restores the wrapper's mode; make sure nothing is left in training mode
    return outs


def export_with_reference(name: str, folder: Path, batch: int = 1) -> tuple:
    """(model, inputs, onnx path, numpy feeds, onnxruntime's outputs on them, export seconds) of one of
    ``make_model``'s models at ``batch`` (static shapes), exported into ``folder`` (``NAME.onnx`` at batch 1,
    ``NAME_bN.onnx`` at batch N)."""
    model, inputs = make_model(name, batch)
    onnx_path = folder / (f"{name}.onnx" if batch == 1 else f"{name}_b{batch}.onnx")
    t0 = time.perf_counter()
    export(model, inputs, onnx_path)
    export_s = time.perf_counter() - t0
    feeds = {k: v.numpy() for k, v in inputs.items()}
    return model, inputs, onnx_path, feeds, ort_reference(onnx_path, feeds), export_s


def cuda_median_ms(fn, runs: int, warmup: int, before=None) -> float:
    """Median of per-call CUDA-event timings (``before(i)`` runs outside the timed region)."""
    import torch

    for i in range(warmup):
        if before:
            before(i)
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    for i in range(runs):
        if before:
            before(i)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return float(np.median([s.elapsed_time(e) for s, e in zip(starts, ends)]))


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def max_err(out, ref) -> float:
    """max |out - ref| / max |ref|: the error on the scale of the output."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))


def errors_by_rows(out, ref, feeds: dict) -> dict | None:
    """``max_err`` of ``out`` over the rows of tokens and over the rows of padding, apart, each on the scale of all
    of ``ref``: {"tokens", "padding"}, where ``feeds`` hold an ``attention_mask`` [batch, tokens] (0 at padding)
    and ``out`` a row per token ([batch, tokens, ...]); None otherwise.  Why: a padded query of a causal mask sees
    no key, and implementations give such a row what they like (the export's guard 0, CUDA's fused attention
    kernels their own), which no caller reads; an error over all rows says nothing of the rows that
    count (torch.compile's Llama output differed from ONNX Runtime's by 1.4 of its scale, H200)."""
    mask = feeds.get("attention_mask")
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if mask is None or out.shape != ref.shape or out.ndim < 2 or tuple(out.shape[:2]) != tuple(np.shape(mask)):
        return None
    keep = np.asarray(mask) != 0
    scale = max(float(np.max(np.abs(ref))), 1e-30)
    err = np.abs(out - ref).reshape(*keep.shape, -1).max(axis=-1)
    return {"tokens": float(err[keep].max(initial=0.0) / scale), "padding": float(err[~keep].max(initial=0.0) / scale)}


def ort_reference(path: Path, feeds: dict) -> dict:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def build_bundle(onnx_path: Path, out: Path, *, search: bool, streams: int | None, log: dict, precision: str = "fp16",
                 measure_seconds: float = 120.0, cache_dir: str | None = None, optimization_level: int = 3):
    """A bundle from ``parastream.pipeline.build`` (search, stream choice, engines, verification against
    onnxruntime; ``cache_dir``: the build's --cache-dir; ``optimization_level``: its --opt-level); with
    ``--handmade``, from tests/handmade_bundles.py (the launcher-only path of earlier runs)."""
    t0 = time.perf_counter()
    if log.get("handmade"):
        from handmade_bundles import make_bundle

        log["builder"] = "handmade"
        bundle = make_bundle(onnx_path, out, backend="torch", streams=streams or 4, precision=precision,
                             sync_cost=log.get("sync_cost", 2e-6))
    else:
        from parastream.pipeline import build

        bundle = build(onnx_path, out, backend="torch", precision=precision, search=search, force=True, streams=streams,
                       measure_seconds=measure_seconds, search_options={"top_k": log.get("top_k", 20)}, cache_dir=cache_dir,
                       optimization_level=optimization_level)
        log["builder"] = "pipeline.build"
        rep = bundle.report
        log["schedule"] = {k: rep["schedule"].get(k) for k in ("streams", "branches", "estimated_s", "streams_tried")}
        s = rep.get("search", {})
        if s.get("enabled"):
            log["search"] = {k: s.get(k) for k in ("summary", "decided_by", "decision", "nodes_before", "nodes_after",
                                                   "rules_chosen_count", "timings", "confirmed")}
            log["search"]["measured"] = [{k: c.get(k) for k in ("rank", "input", "chosen", "estimated_s", "measured_s",
                                                                "timings_s", "error")}
                                         for c in s.get("candidates", []) if c.get("measured_s") is not None or c.get("error")]
            # each timing as timed: the reference's first median, both medians of each timing in blocks
            log["search"]["measure_log"] = s.get("measure_log")
        v = rep.get("verification") or {}
        log["verification"] = {"passed": v.get("passed"), "criterion": v.get("criterion"),
                               "max_scaled": {k: o.get("max_scaled") for k, o in v.get("outputs", {}).items()}}
        log["timings"] = rep.get("timings")
    log["build_s"] = time.perf_counter() - t0
    return bundle


def run_model(name: str, args, outdir: Path) -> dict:
    import torch

    from parastream.pipeline.bench import bench_bundle
    from parastream.launcher.gpu import GpuLauncher

    res: dict = {"model": name}
    model, inputs, onnx_path, feeds, ref, res["export_s"] = export_with_reference(name, outdir)
    ref_list = list(ref.values())

    # (a) eager fp16 and (e) torch.compile reduce-overhead, on rotating input sets
    user = users_model(name, model)
    res["torch_attention"] = getattr(getattr(user, "config", None), "_attn_implementation", None)
    model_h = user.half().cuda() if "input_ids" not in inputs else user.cuda().half()
    sets = []
    rng = np.random.default_rng(1)
    for i in range(4):
        if "input_ids" in inputs:
            ids = torch.from_numpy(rng.integers(0, user.config.vocab_size, (1, 128))).cuda()
            sets.append((ids, inputs["attention_mask"].cuda()))
        else:
            sets.append((torch.from_numpy(rng.standard_normal(tuple(inputs["x"].shape)).astype(np.float16)).cuda(),))
    cur = {"i": 0}

    def pick(i):
        cur["i"] = i % len(sets)

    def first(out):
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out

    with torch.no_grad():
        dev_in = tuple(v.cuda() if v.dtype != torch.float32 else v.cuda().half() for v in inputs.values())
        eager_out = first(model_h(*dev_in)).float().cpu().numpy()
        res["err_eager"] = rel_err(eager_out, ref_list[0])
        res["maxerr_eager"] = max_err(eager_out, ref_list[0])
        if args.only_parastream:
            res["a_eager_ms"] = float("nan")
    if not args.only_parastream:
        with torch.no_grad():
            res["a_eager_ms"] = cuda_median_ms(lambda: model_h(*sets[cur["i"]]), args.runs, 20, pick)
            if not args.skip_compile:
                t0 = time.perf_counter()
                compiled = torch.compile(model_h, mode="reduce-overhead")
                for _ in range(3):
                    compiled(*sets[0])
                torch.cuda.synchronize()
                res["e_compile_s"] = time.perf_counter() - t0
                res["e_compile_ms"] = cuda_median_ms(lambda: compiled(*sets[cur["i"]]), args.runs, 20, pick)
                del compiled
                torch._dynamo.reset()
    del model_h
    torch.cuda.empty_cache()

    # (c) and (d)
    variants = [(t, t == "d") for t in args.variants.split(",")]
    for tag, search in variants:
        log: dict = {"sync_cost": args.sync_cost, "handmade": args.handmade, "top_k": args.top_k}
        try:
            bundle = build_bundle(onnx_path, outdir / f"{name}_{tag}", search=search, streams=streams_for(name, args), log=log,
                                  measure_seconds=args.measure_seconds)
        except Exception as e:  # noqa: BLE001 - report and go on with the next variant
            res[f"{tag}_error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            continue
        for key in ("builder", "build_s", "schedule", "search", "verification", "timings"):
            if key in log:
                res[f"{tag}_{key}"] = log[key]
        t0 = time.perf_counter()
        la = GpuLauncher(bundle)
        res[f"{tag}_load_s"] = time.perf_counter() - t0
        got = la(feeds)
        res[f"{tag}_err"] = {k: rel_err(got[k], ref[k]) for k in ref}
        res[f"{tag}_maxerr"] = {k: max_err(got[k], ref[k]) for k in ref}
        png = outdir / f"timeline_{name}_{tag}.png" if tag == variants[-1][0] else None
        b = bench_bundle(bundle, runs=args.runs, warmup=20, timeline=png, launcher=la, whole_model=False,
                         concat_ablation=args.concat_ablation)
        res[f"{tag}_ms"] = b["parastream_ms"]
        res[f"{tag}_concats_in_place"] = b["concats_in_place"]
        if "concat_copies_ms" in b:
            res[f"{tag}_concat_copies_ms"] = b["concat_copies_ms"]
        res[f"b_{tag}_ms"] = b["single_stream_ms"]
        res[f"{tag}_streams"] = b["streams"]
        res[f"{tag}_branches"] = b["branches"]
        if "busy_fraction" in b:
            res[f"{tag}_busy"] = b["busy_fraction"]
            spans = la.run_timed()
            res[f"{tag}_spans"] = spans
        la.close()
    if name in args.fp32_check.split(","):
        # the converter itself, without fp16 rounding: fp32 engines against ONNX Runtime fp32
        log = {"sync_cost": args.sync_cost, "handmade": args.handmade}
        bundle = build_bundle(onnx_path, outdir / f"{name}_fp32", search=False, streams=streams_for(name, args), log=log, precision="fp32",
                              measure_seconds=0)
        with GpuLauncher(bundle) as la:
            got = la(feeds)
        res["fp32_err"] = {k: rel_err(got[k], ref[k]) for k in ref}
        res["fp32_maxerr"] = {k: max_err(got[k], ref[k]) for k in ref}
    return res


def streams_for(name: str, args) -> int | None:
    for item in filter(None, args.streams_per_model.split(",")):
        model, _, k = item.partition("=")
        if model == name:
            return int(k)
    return args.streams


def table(results: list[dict]) -> str:
    hdr = ("model", "(a) eager", "(b) 1-stream", "(c) no rewrite", "(d) rewrite", "(e) compile", "b/d", "e/d", "c/d",
           "streams/eng (d)", "maxerr(d)", "build s (d)")
    rows = [hdr]
    for r in results:
        d = r.get("d_ms")
        f = (lambda k: f"{r[k]:.3f}" if isinstance(r.get(k), float) else "-")
        err = max(r["d_maxerr"].values()) if isinstance(r.get("d_maxerr"), dict) else float("nan")
        rows.append((r["model"], f("a_eager_ms"), f("b_d_ms"), f("c_ms"), f("d_ms"), f("e_compile_ms"),
                     f"{r['b_d_ms'] / d:.2f}" if d and r.get("b_d_ms") else "-",
                     f"{r['e_compile_ms'] / d:.2f}" if d and r.get("e_compile_ms") else "-",
                     f"{r['c_ms'] / d:.2f}" if d and r.get("c_ms") else "-",
                     f"{r.get('d_streams', '-')}/{r.get('d_branches', '-')}", f"{err:.1e}",
                     f"{r.get('d_build_s', 0) + r.get('d_load_s', 0):.0f}"))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(hdr))]
    lines = ["  ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in rows]
    for r in results:
        for tag in ("c", "d"):
            if r.get(f"{tag}_concat_copies_ms") and r.get(f"{tag}_ms"):
                lines.append(f"{r['model']} ({tag}): {r[f'{tag}_concats_in_place']} Concats in place {r[f'{tag}_ms']:.3f} ms, "
                             f"as engines {r[f'{tag}_concat_copies_ms']:.3f} ms: {r[f'{tag}_concat_copies_ms'] / r[f'{tag}_ms']:.3f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--streams", type=int, default=None)
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--only-parastream", action="store_true", help="skip (a) and (e)")
    ap.add_argument("--handmade", action="store_true", help="partition with tests/handmade_bundles.py even where pipeline.build runs")
    ap.add_argument("--sync-cost", type=float, default=2e-6, help="handmade partition: cost of one cross-stream event (s)")
    ap.add_argument("--streams-per-model", default="", help="e.g. bert=1,resnet50=2 (overrides --streams)")
    ap.add_argument("--variants", default="c,d", help="which of the parastream variants to build: c, d or c,d")
    ap.add_argument("--measure-seconds", type=float, default=120.0, help="(d): GPU time budget for measuring search candidates")
    ap.add_argument("--top-k", type=int, default=20, help="(d): candidates the search assembles (measured within the budget)")
    ap.add_argument("--fp32-check", default="", help="models also built in fp32 and compared with onnxruntime")
    ap.add_argument("--concat-ablation", action="store_true",
                    help="also time each bundle with every Concat as its own engine (the launcher's concat_in_place=False)")
    ap.add_argument("--tag", default="", help="suffix of result files")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_out"))
    args = ap.parse_args(argv)
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/bench_work")
    work.mkdir(exist_ok=True)
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    results = []
    for name in args.models.split(","):
        t0 = time.perf_counter()
        try:
            r = run_model(name, args, work)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            r = {"model": name, "error": f"{type(e).__name__}: {e}"}
        r["total_s"] = time.perf_counter() - t0
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if not k.endswith("_spans")}, default=str), flush=True)
        (out / f"results{args.tag}.json").write_text(json.dumps(results, indent=1, default=str))
    if not args.only_parastream:
        for p in work.glob("timeline_*.png"):
            (out / p.name).write_bytes(p.read_bytes())
    print(table([r for r in results if "error" not in r]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
