#!/usr/bin/env python3
"""cuBLASLt's candidate kernels for the transformers' GEMMs, each timed in a CUDA Graph, against the one torch picks.

Why: BERT-base's four products (QKV, attention output, the GELU product, the MLP output) are ~21 of its ~34 µs of
kernels a layer on the H200, and the MLP output runs as cuBLAS's split-K (a 5.5 µs product, a 2.4 µs reduction and
a 0.8 µs memset: bench/NOTES.md).  torch's ``addmm`` and ``_addmm_activation`` (the bundles' "cuBLASLt GEMM with
fused bias and activation") run the first algorithm of cuBLASLt's heuristic; TensorRT times several per layer and
keeps the fastest, and torch 2.14's TunableOp does the same with cuBLASLt's candidates, but the device's torch is
2.11.  nvmath-python (NVIDIA's binding of cuBLASLt) lists the heuristic's candidates (``Matmul.plan``) and runs any
one of them (``Matmul.execute(algorithm=...)``).  This says how much faster the fastest candidate is, per shape,
before any engine is built on it.

Per problem (rows ``M`` = batch x sequence, a Linear's ``K`` and ``N``, its epilogue: bias, or bias and tanh GELU as
``_addmm_activation`` computes it), with ``--layers`` copies of the weights (so that, as in a model, each call reads
its weights from memory rather than from the L2 a repeated call would leave them in):

  torch      ``torch.addmm(bias, x, w)`` / ``torch._addmm_activation(bias, x, w, use_gelu=True)``, ``w`` [K, N] as
             the ONNX MatMul stores it: cuBLAS's problem m=N, n=M, k=K
  lt[i]      cuBLASLt's i-th heuristic candidate on the same problem (``a`` = w viewed [N, K] column-major, ``b`` =
             x viewed [K, M] column-major, so the result [N, M] is column-major, i.e. x·w row-major), with the
             BIAS or GELU_BIAS epilogue

Each form's ``--layers`` calls are captured in one CUDA Graph, replayed ``--replays`` times with CUDA events around
each replay after warm-up (``pipeline.bench.captured_us``); the figure is the median per call in µs.  The fastest candidate's result is checked
against torch's (max abs difference).

Run on the device from the repository root after ``source bench/device_env.sh``, with nvmath-python and its two
dependencies carried in a folder of their own (``pip download --no-deps --python-version 3.12 --only-binary=:all:
--platform manylinux_2_28_x86_64 nvmath-python cuda-core cuda-pathfinder -d .whl/gemm_lt``; device_env.sh does not
install them, and the carry's 64 MiB does not hold them beside Triton's wheels: carry ``.whl/gemm_lt`` and the
wheels parastream needs, or move Triton's aside):

    python3 -m pip install -q --no-deps --target /tmp/site-lt .whl/gemm_lt/*.whl
    PYTHONPATH=/tmp/site-lt:$PYTHONPATH python3 bench/gemm_lt.py --out $OUT

Prints one JSON line per problem and writes gemm_lt.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# (name, K, N, epilogue) of a BERT-base / ViT-B/16 layer
LINEARS = [("qkv", 768, 2304, "bias"), ("attn_out", 768, 768, "bias"), ("mlp_in", 768, 3072, "gelu"),
           ("mlp_out", 3072, 768, "bias")]


def graph_us(calls, replays: int) -> float:
    """Median µs per call of ``calls`` (zero-argument callables) captured in order, once each, in one CUDA Graph
    (``pipeline.bench.captured_us``: warm-up on a side stream, CUDA events around each replay)."""
    from parastream.pipeline.bench import captured_us

    return captured_us(lambda: [fn() for fn in calls], reps=1, replays=replays) / len(calls)


def algo_words(alg) -> dict:
    out = {}
    for k in ("algorithm_id", "tile", "stages", "split_k", "reduction_scheme", "cta_swizzling", "cluster_shape"):
        try:
            v = getattr(alg, k)
            out[k] = v if isinstance(v, (int, bool, str)) else str(v)
        except Exception as e:  # noqa: BLE001 - a property this cuBLASLt does not report
            out[k] = f"? {type(e).__name__}"
    return out


def problem(m: int, name: str, k: int, n: int, epi: str, *, layers: int, limit: int, replays: int) -> dict:
    import torch
    from nvmath.linalg.advanced import Matmul, MatmulEpilog

    torch.manual_seed(0)
    dev = "cuda"
    x = torch.randn(m, k, device=dev, dtype=torch.float16)
    ws = [torch.randn(k, n, device=dev, dtype=torch.float16) * k ** -0.5 for _ in range(layers)]
    bs = [torch.randn(n, device=dev, dtype=torch.float16) * 0.1 for _ in range(layers)]
    row = {"problem": name, "M": m, "K": k, "N": n, "epilogue": epi}

    if epi == "gelu":
        def torch_call(i):
            return lambda: torch._addmm_activation(bs[i], x, ws[i], use_gelu=True)
    else:
        def torch_call(i):
            return lambda: torch.addmm(bs[i], x, ws[i])
    row["torch_us"] = round(graph_us([torch_call(i) for i in range(layers)], replays), 3)
    ref = torch_call(0)()

    epilog = MatmulEpilog.GELU_BIAS if epi == "gelu" else MatmulEpilog.BIAS
    stream = torch.cuda.current_stream()
    mms = []
    try:
        for i in range(layers):
            mm = Matmul(ws[i].t(), x.t(), stream=stream)
            algs = mm.plan(preferences={"limit": limit}, epilog=epilog, epilog_inputs={"bias": bs[i]}, stream=stream)
            mms.append((mm, algs))
        first = mms[0][1]
        way_ok = {"execute": True}
        workspace = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
        outs = [torch.empty(m, n, device=dev, dtype=torch.float16).t() for _ in range(layers)]  # [N, M] column-major

        def public(mm, algs, j):
            return lambda: mm.execute(algorithm=algs[j], stream=torch.cuda.current_stream())

        def raw(mm, algs, j):
            # the call nvmath's own autotuning makes (Matmul.autotune): cublasLtMatmul with the plan's descriptors
            # and the j-th candidate, into a result and workspace of ours, on the stream being captured
            from nvmath.bindings import cublasLt as lt_api

            i = [q for q, _ in mms].index(mm)
            algo = mm.algorithms_buffer[j]["algo"]
            return lambda: lt_api.matmul(mm.handle, mm.mm_desc, mm.alpha.ctypes.data, mm.operands[0].data_ptr, mm.a_layout_ptr,
                                         mm.operands[1].data_ptr, mm.b_layout_ptr, mm.beta.ctypes.data, 0,
                                         mm.c_layout_ptr, outs[i].data_ptr(), mm.d_layout_ptr, algo.ctypes.data,
                                         workspace.data_ptr(), workspace.numel(), torch.cuda.current_stream().cuda_stream)
        row["candidates"] = len(first)
        lt = []
        for j, alg in enumerate(first):
            entry = {"index": j, **algo_words(alg)}
            for way in (("execute", "raw") if way_ok["execute"] else ("raw",)):
                try:
                    calls = [(public if way == "execute" else raw)(mm, algs, j) for mm, algs in mms]
                    entry["us"] = round(graph_us(calls, replays), 3)
                    entry["way"] = way
                    break
                except Exception as e:  # noqa: BLE001 - one candidate's failure is its entry
                    entry[f"error_{way}"] = f"{type(e).__name__}: {str(e)[:200]}"
                    if way == "execute":
                        way_ok["execute"] = False  # the public call does not capture: the raw call for the rest
                    torch.cuda.synchronize()
            lt.append(entry)
        row["lt"] = lt
        timed = [e for e in lt if "us" in e]
        if timed:
            best = min(timed, key=lambda e: e["us"])
            row["lt_first_us"] = lt[0].get("us")
            row["lt_best_us"] = best["us"]
            row["lt_best"] = {k: v for k, v in best.items() if k != "us"}
            row["torch_over_best"] = round(row["torch_us"] / best["us"], 3)
            got = mms[0][0].execute(algorithm=mms[0][1][best["index"]], stream=stream)
            torch.cuda.synchronize()
            row["maxerr_vs_torch"] = float((got.t().float() - ref.float()).abs().max())
    except Exception as e:  # noqa: BLE001 - the problem's row names what failed
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        for mm, _ in mms:
            try:
                mm.free()
            except Exception:  # noqa: BLE001
                pass
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="128,197,1024", help="M: BERT-base at batch 1 (128), ViT-B/16 (197), BERT at 8")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--limit", type=int, default=16, help="how many of cuBLASLt's heuristic candidates to time")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/gemm_lt_out"))
    args = ap.parse_args(argv)
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"device": torch.cuda.get_device_name(), "torch": torch.__version__,
             "cublas": torch.backends.cuda.preferred_blas_library().name if hasattr(torch.backends.cuda, "preferred_blas_library") else None}]
    t0 = time.perf_counter()
    for m in (int(s) for s in args.rows.split(",") if s):
        for name, k, n, epi in LINEARS:
            r = problem(m, name, k, n, epi, layers=args.layers, limit=args.limit, replays=args.replays)
            rows.append(r)
            print(json.dumps({kk: v for kk, v in r.items() if kk != "lt"}), flush=True)
            (out / "gemm_lt.json").write_text(json.dumps(rows, indent=1))
    print(f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
