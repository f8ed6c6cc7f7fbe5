#!/usr/bin/env python3
"""What a fresh process pays for torch's GPU libraries before its first results, and what opening cuDNN's
sub-libraries beside torch's import would take off it.

Each case runs in a new process, the cases interleaved rep by rep. A process creates the device's context in a
thread as a bundle's load does (``cuda.initialize_in_background``), then, by case:

  plain     imports torch; nothing opened early
  preload   opens cuDNN's sub-libraries (``cudnn_part_paths``) in a thread first (libc's ``dlopen`` through
            ctypes, which lets go of the interpreter lock, where ``ctypes.CDLL`` holds it), then imports torch
  after     imports torch, then opens the sub-libraries in the main thread (what they cost alone, timed)

and then times, each synchronized: a first 3x3 convolution (fp16, channels-last; cuDNN's handle, its
sub-libraries where not opened yet, the shape's plan), a second shape (a plan alone), a depthwise convolution, a
first fp16 GEMM (cuBLASLt's handle). It records the seconds from the process's first line to torch imported and
to each result (``*_at_s``), each step's own seconds, and when the preload thread ended.

Run on the device after ``source bench/device_env.sh``:
    python3 bench/library_starts.py --reps 5 --out $OUT
Prints a JSON line per process and a table of medians per case; writes library_starts.json to --out.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

CASES = ("plain", "preload", "after")
#: cuDNN's sub-libraries a convolution's first call opens, in the order it needs them (cuDNN 9 splits itself into
#: a small front library, which torch's own library links, and these, which it opens at first use)
CUDNN_PARTS = ("graph", "engines_precompiled", "heuristic", "ops", "cnn", "engines_runtime_compiled")
PRELOAD_TIMES: dict[str, tuple[float, float, bool]] = {}


def cudnn_part_paths() -> list[str]:
    """The files of ``CUDNN_PARTS`` torch's cuDNN would open, found without importing torch: the nvidia-cudnn
    wheel's lib folder, else torch's."""
    import importlib.util

    folders = []
    for name in ("nvidia.cudnn", "torch"):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        folders += [Path(p) / "lib" for p in (spec.submodule_search_locations or [])] if spec else []
    for folder in folders:
        found = [sorted(folder.glob(f"libcudnn_{part}.so.*")) for part in CUDNN_PARTS]
        if all(found):
            return [str(f[0]) for f in found]
    return []


def preload_in_background(paths: list[str]) -> None:
    import ctypes
    import threading

    def run():
        dlopen = ctypes.CDLL(None).dlopen
        dlopen.restype, dlopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_int]
        for p in paths:
            t0 = time.perf_counter()
            ok = bool(dlopen(p.encode(), os.RTLD_NOW | os.RTLD_GLOBAL))
            PRELOAD_TIMES[os.path.basename(p)] = (t0, time.perf_counter(), ok)

    threading.Thread(target=run, daemon=True).start()


def child(case: str) -> dict:
    from parastream.launcher import cuda

    out: dict = {"case": case}
    cuda.initialize_in_background(0)
    paths = cudnn_part_paths()
    out["parts"] = [os.path.basename(p) for p in paths]
    if case == "preload":
        preload_in_background(paths)
    t = time.perf_counter()
    import torch

    out["import_torch_s"] = time.perf_counter() - t
    out["torch_at_s"] = time.perf_counter() - T_START
    if case == "after":
        import ctypes

        t = time.perf_counter()
        for p in paths:
            ctypes.CDLL(p, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
        out["open_parts_s"] = time.perf_counter() - t
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)

    def step(name, fn):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out[f"{name}_s"] = time.perf_counter() - t0
        out[f"{name}_at_s"] = time.perf_counter() - T_START

    def conv(c_in, c_out, k, hw, groups=1):
        x = torch.randn(1, c_in, hw, hw, device=dev, dtype=torch.float16).to(memory_format=torch.channels_last)
        w = torch.randn(c_out, c_in // groups, k, k, device=dev, dtype=torch.float16).to(memory_format=torch.channels_last)
        return lambda: torch.nn.functional.conv2d(x, w, padding=k // 2, groups=groups)

    step("context", lambda: torch.zeros(1, device=dev))
    step("first_conv", conv(64, 64, 3, 56))
    step("second_conv", conv(128, 256, 1, 28))
    step("depthwise_conv", conv(96, 96, 3, 56, groups=96))
    a = torch.randn(1, 768, device=dev, dtype=torch.float16)
    b = torch.randn(768, 3072, device=dev, dtype=torch.float16)
    step("first_gemm", lambda: a @ b)
    done = list(PRELOAD_TIMES.values())
    if done:
        out["preload_ended_at_s"] = max(e for _, e, _ in done) - T_START
        out["preload_s"] = max(e for _, e, _ in done) - min(s for s, _, _ in done)
        out["preload_ok"] = all(ok for _, _, ok in done)
    out["ready_at_s"] = time.perf_counter() - T_START
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="/tmp/library_starts_out")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for rep in range(args.reps):
        for case in args.cases.split(","):
            with tempfile.TemporaryDirectory() as cache:  # empty Inductor/Triton caches, as a fresh instance has
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor", TRITON_CACHE_DIR=f"{cache}/triton")
                p = subprocess.run([sys.executable, __file__, "--child", case], env=env, capture_output=True, text=True)
            if p.returncode != 0:
                row = {"case": case, "rep": rep, "error": (p.stderr.strip().splitlines() or ["?"])[-1]}
            else:
                row = dict(json.loads(p.stdout.strip().splitlines()[-1]), rep=rep)
            rows.append(row)
            print(json.dumps(row), flush=True)
            (out / "library_starts.json").write_text(json.dumps(rows, indent=1))
    keys = ["torch_at_s", "import_torch_s", "open_parts_s", "first_conv_s", "second_conv_s", "depthwise_conv_s",
            "first_gemm_s", "preload_ended_at_s", "ready_at_s"]
    print(f"{'case':<8} " + " ".join(f"{k.replace('_s', ''):>16}" for k in keys) + "   (medians, s)")
    for case in args.cases.split(","):
        got = [r for r in rows if r["case"] == case and "error" not in r]
        cells = []
        for k in keys:
            vals = [r[k] for r in got if k in r]
            cells.append(f"{statistics.median(vals):16.3f}" if vals else f"{'-':>16}")
        print(f"{case:<8} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
