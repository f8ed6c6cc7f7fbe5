#!/usr/bin/env python3
"""Dynamic shapes: a sequence grid against static bundles at exactly each length (and torch.compile on a GPU).

On the device machine, from the repository root after ``source bench/device_env.sh``, one model per call:

    python3 bench/dynamic_shapes.py --models bert --out bench_results/dynshapes
    python3 bench/dynamic_shapes.py --models gpt2 --buckets 64,128,256,384,512 --out bench_results/dynshapes

and on the CPU (ONNX Runtime engines, 2-layer configs) as a smoke run of the same code:

    python3 bench/dynamic_shapes.py --models bert --tiny --backend onnxruntime --max-seq 128 --lengths 17,100,128 --out /tmp/ds

For each model (transformers BERT-base or GPT-2 without a KV cache, random weights; ``--tiny``: 2 layers,
hidden 128), exported with a dynamic batch and sequence, one bundle is built with ``--min-shapes
input_ids:1x1 --max-shapes input_ids:BxMAX`` (B: ``--max-batch``, default 1; ``--buckets`` the sequence's buckets,
default the powers of two; ``--batch-buckets`` the batch's, default 1 and B) and, for each shape of ``--lengths``
(L at batch 1, or BxL), a static bundle built at exactly that shape (where it is a bucket below the top, that
bucket's own bundle, which is one).  At each shape: the median call latency (host wall clock of
``launcher(feeds)``, inputs already on the device on a GPU: padding, replay, synchronise; variants alternating in
blocks) of the grid bundle, of the static bundle and, on a GPU, of ``torch.compile(mode="reduce-overhead")`` on
the PyTorch model (transformers' default attention) in fp16 at that shape; the grid's outputs against onnxruntime
(CPU, fp32) on the unpadded input (scaled error).  On a GPU, the device memory of the grid and of one static
bundle at MAX (built for it), each loaded alone.  Targets (docs/dynamic-shapes.md):
grid / static <= 1.15 and grid <= torch.compile at every length.  At a length between buckets the grid call's
steps are also timed apart (``bucket_in_place`` or ``pad_only``, ``bucket_launcher``, ``cut_only``): where the padded
call's cost goes.  Writes ``OUT/<model>_dynshapes.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make(name: str, tiny: bool, max_seq: int, attention: str = "eager"):
    """(torch model in eval mode, its vocabulary size); outputs the last hidden state.  ``attention`` is
    transformers' ``attn_implementation``: "eager" for the export (plain ONNX ops), "sdpa" (transformers'
    default, what a user compiles) for torch.compile; the seed makes both the same weights."""
    import torch
    import transformers as tf

    size = dict(hidden=128, layers=2, heads=2, ff=256) if tiny else dict(hidden=768, layers=12, heads=12, ff=3072)
    torch.manual_seed(0)
    if name == "bert":
        cfg = tf.BertConfig(vocab_size=30522, hidden_size=size["hidden"], num_hidden_layers=size["layers"],
                            num_attention_heads=size["heads"], intermediate_size=size["ff"],
                            max_position_embeddings=max(512, max_seq), attn_implementation=attention)
        core = tf.BertModel(cfg, add_pooling_layer=False)
    else:
        cfg = tf.GPT2Config(vocab_size=50257, n_embd=size["hidden"], n_layer=size["layers"], n_head=size["heads"],
                            n_positions=max(1024, max_seq), use_cache=False, attn_implementation=attention)
        core = tf.GPT2Model(cfg)

    class Hidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = core

        def forward(self, input_ids, attention_mask):
            return self.m(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    return Hidden().eval(), cfg.vocab_size


def export(model, path: Path) -> None:
    import torch

    ids, mask = torch.randint(0, 1000, (1, 16)), torch.ones(1, 16, dtype=torch.int64)
    axes = {0: "batch", 1: "seq"}
    with torch.no_grad():
        torch.onnx.export(model, (ids, mask), str(path), input_names=["input_ids", "attention_mask"],
                          output_names=["hidden"], dynamic_axes={"input_ids": axes, "attention_mask": axes, "hidden": axes},
                          opset_version=17, dynamo=False)


def device_used() -> int:
    """Bytes in use on the current GPU (cudaMemGetInfo through torch; torch's pools are never given back, so the
    difference around one load is what that load took)."""
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def loaded_bytes(bundle: Path) -> int:
    """Device bytes a load of ``bundle`` takes, measured alone: loaded, measured, closed and given back."""
    import gc

    import torch

    from parastream.launcher import load

    gc.collect()
    torch.cuda.empty_cache()
    used = device_used()
    la = load(bundle)
    got = device_used() - used
    la.close()
    del la
    gc.collect()
    torch.cuda.empty_cache()
    return got


def median_ms(calls: dict, runs: int, warmup: int, block: int = 10) -> dict:
    """Median wall-clock ms of each no-argument call, ``runs`` each after ``warmup``, alternating in blocks."""
    for _ in range(warmup):
        for f in calls.values():
            f()
    times = {k: [] for k in calls}
    while any(len(t) < runs for t in times.values()):
        for k, f in calls.items():
            for _ in range(min(block, runs - len(times[k]))):
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
    return {k: float(np.median(v)) * 1e3 for k, v in times.items()}


def run_model(name: str, args, outdir: Path) -> dict:
    import onnxruntime as ort
    import torch

    from parastream.core.accuracy import scaled_error
    from parastream.launcher import load
    from parastream.pipeline import build

    gpu = args.backend != "onnxruntime"
    model, vocab = make(name, args.tiny, args.max_seq)
    path = outdir / f"{name}_dyn.onnx"
    export(model, path)
    common = dict(backend=args.backend, precision=args.precision, search=args.search, force=True)
    if gpu:
        common.update(measure=False)
    t0 = time.perf_counter()
    buckets = {("input_ids", 1): [int(v) for v in args.buckets.split(",")]} if args.buckets else {}
    if args.max_batch > 1:
        buckets[("input_ids", 0)] = [int(v) for v in (args.batch_buckets or f"1,{args.max_batch}").split(",")]
    grid = build(path, outdir / f"{name}_grid", min_shapes={"input_ids": [1, 1]},
                 max_shapes={"input_ids": [args.max_batch, args.max_seq]}, shape_buckets=buckets, **common)
    res: dict = {"model": name, "tiny": args.tiny, "backend": args.backend, "precision": args.precision,
                 "max_batch": args.max_batch, "grid_build_s": time.perf_counter() - t0,
                 "memory": grid.report["buckets"]["memory"],
                 "sizes": {ax["name"]: ax["sizes"] for ax in grid.manifest["buckets"]["axes"]}, "lengths": []}
    log(f"{name}: grid built in {res['grid_build_s']:.0f} s, buckets {res['sizes']}")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    statics: dict = {}

    def static(batch: int, length: int) -> Path:
        if (batch, length) not in statics:
            statics[batch, length] = build(path, outdir / f"{name}_static_{batch}x{length}",
                                           shapes={"input_ids": [batch, length], "attention_mask": [batch, length]},
                                           **common).path
        return statics[batch, length]

    if gpu:
        # device memory of one static bundle at MAX loaded alone, then of the whole grid loaded alone: engines of
        # one process share equal weights, so loaded side by side the second would not count its own
        res["device_memory_bytes"] = {"static_at_max": loaded_bytes(static(args.max_batch, args.max_seq))}
        res["device_memory_bytes"]["grid"] = loaded_bytes(grid.path)
    la = load(grid.path)
    compiled = None
    if gpu:
        # what a user compiles: transformers' default attention (sdpa), the same weights as the exported model
        user, _ = make(name, args.tiny, args.max_seq, attention="sdpa")
        user.load_state_dict(model.state_dict())
        compiled = torch.compile(user.half().cuda(), mode="reduce-overhead")
    try:
        # a bucket below the top is a static bundle of its own (buckets/b...): built exactly as a static build at
        # that shape (the same options), so it serves as the static bundle there and saves a build
        exact = {}
        for bd in grid.bucket_bundles().values():
            shape = next(t.shape for t in bd.plan.inputs if t.name == "input_ids")
            if bd.path.resolve() != grid.path.resolve():
                exact[(int(shape[0]), int(shape[1]))] = bd.path
        for batch, length in (_shape(v) for v in args.lengths.split(",")):
            ls = load(exact.get((batch, length)) or static(batch, length))
            rng = np.random.default_rng(length * 16 + batch)
            feeds = {"input_ids": rng.integers(0, vocab, (batch, length)).astype(np.int64),
                     "attention_mask": np.ones((batch, length), np.int64)}
            err = scaled_error(np.asarray(_host(la(feeds)["hidden"]), np.float32), sess.run(None, feeds)[0])
            dev = {k: torch.from_numpy(v).cuda() for k, v in feeds.items()} if gpu else feeds
            calls = {"grid": lambda: la(dev), "static": lambda: ls(dev)}
            if compiled is not None:
                def eager(c=compiled, f=dev):
                    with torch.no_grad():
                        c(**f)
                    torch.cuda.synchronize()
                calls["torch_compile"] = eager
            key = tuple(la.bucket_for(la.point_of(feeds)))
            if key != la.point_of(feeds):  # padded: the call's steps timed apart (where its cost goes)
                calls.update(padded_steps(la, dev))
            ms = median_ms(calls, args.runs, args.warmup)
            ls.close()
            row = {"batch": batch, "length": length, "bucket": list(key),
                   "static": "the grid's bucket" if (batch, length) in exact else "built", "ms": ms,
                   "grid_over_static": ms["grid"] / ms["static"],
                   "grid_over_torch_compile": ms["grid"] / ms["torch_compile"] if "torch_compile" in ms else None,
                   "scaled_error_vs_ort_unpadded": err}
            res["lengths"].append(row)
            log(f"{name} {batch}x{length} (bucket {key}): {json.dumps({k: round(v, 4) for k, v in ms.items()})} "
                f"grid/static {row['grid_over_static']:.3f} err {err:.2g}")
            (outdir / f"{name}_dynshapes.json").write_text(json.dumps(res, indent=2, default=str))
    finally:
        la.close()
    return res


def _shape(token: str) -> tuple[int, int]:
    """``--lengths`` entry: ``L`` (batch 1) or ``BxL``."""
    b, _, n = token.strip().rpartition("x")
    return int(b or 1), int(n)


def padded_steps(la, feeds: dict) -> dict:
    """A grid call's steps on ``feeds`` timed apart, each ending with a synchronise as the whole call does: where
    the call writes device feeds straight into the bucket's buffers (``BucketedLauncher.leading_parts``), the
    bucket's launcher doing so (``bucket_in_place``) and the bucket's launcher on inputs already padded
    (``bucket_launcher``); else padding the inputs to the bucket (``pad_only``) and that launcher; then cutting
    its outputs back (``cut_only``)."""
    point = la.point_of(feeds)
    key = la.bucket_for(point)
    ready = la.pad_to_bucket(feeds, point, key)
    sub = la.launchers[key]
    outs = sub(ready)
    sync = _synchronise()
    steps = {"bucket_launcher": lambda: sub(ready), "cut_only": lambda: (la.cut_to_point(dict(outs), point, key), sync())}
    parts = la.leading_parts(feeds, point, key)
    if parts is not None:
        shapes = {n: shape for n, (shape, _) in parts.items()}
        fills = la._fills(key, parts)
        steps["bucket_in_place"] = lambda: sub.run_padded(feeds, shapes, fills)
    else:
        steps["pad_only"] = lambda: (la.pad_to_bucket(feeds, point, key), sync())
    return steps


def _synchronise():
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.synchronize
    except ImportError:
        pass
    return lambda: None


def _host(v):
    if isinstance(v, np.ndarray):
        return v
    t = v.torch() if hasattr(v, "torch") else v
    return t.float().cpu().numpy()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="bert", help="bert, gpt2 (comma-separated)")
    p.add_argument("--tiny", action="store_true", help="2 layers, hidden 128 (a CPU smoke run)")
    p.add_argument("--backend", default="torch", choices=["torch", "tensorrt", "onnxruntime"])
    p.add_argument("--precision", default=None, help="default fp16 on a GPU, fp32 on onnxruntime")
    p.add_argument("--max-seq", type=int, default=512)
    p.add_argument("--buckets", default=None, help="the sequence's buckets (default: powers of two, MIN and MAX)")
    p.add_argument("--lengths", default="17,100,128,384,512",
                   help="the shapes timed: L (batch 1) or BxL, comma-separated")
    p.add_argument("--max-batch", type=int, default=1, help="the grid's batch range 1..N (default 1: sequence only)")
    p.add_argument("--batch-buckets", default=None, help="the batch's buckets (default: 1 and --max-batch)")
    p.add_argument("--search", action="store_true", help="run the rewrite search per bucket (off: shorter builds)")
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    args.precision = args.precision or ("fp32" if args.backend == "onnxruntime" else "fp16")
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    results = [run_model(m.strip(), args, outdir) for m in args.models.split(",")]
    (outdir / "results.json").write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
