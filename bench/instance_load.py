#!/usr/bin/env python3
"""Where a GPU instance's start goes (a Triton model.py initialize; target <= 3 s): fresh processes that do what
Triton's model.py initialize does -- open the bundle for loading on device 0 (torch's import and the CUDA context in threads beside
the hashes), wait for torch, set the device, load the GPU launcher (engines, warm-up, capture) -- each with empty
Inductor and Triton caches, timed from the process's start.

Variants, each a few times, interleaved (so that a machine's drift falls on all of them):
  now        the code as it is;
  nocontext  no CUDA context made beside the hashes (torch makes it at its first call);
  switch     the interpreter's switch interval at 0.5 ms (5 ms by default) while the launcher loads: the thread
             that loads engines and the one that warms them take turns on the interpreter lock sooner;
  torchfirst torch imported first, alone, and then the same (what a plain process's ``import torch; load(...)``
             does): whether the threads beside torch's import gain or lose;
  torchinit  torch's import started in a thread of its own before the open, and torch's CUDA start
             (``torch.cuda.init``: the context, torch.sparse's Triton kernels registered) run there after it, rather
             than at the load's first CUDA call in the loading thread;
  serial     each torch engine warmed as it loads, in the loading thread (``warms_after_load`` off), and the
             launcher's warm-up and capture there too: no warm-up thread beside the loads;
  before     PARASTREAM_BEFORE (a folder holding an earlier checkout's parastream package, e.g. /tmp/ns_before) on
             sys.path first: that code's load, done the way its model.py did it.

Run on the device after ``source bench/device_env.sh``:
    python3 bench/instance_load.py BUNDLE [--reps 4] [--variants now,nocontext,before] [--out $OUT]
Prints one JSON line per child and a summary (medians per variant); writes instance_load.json to --out.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402


def child(bundle_path: str, variant: str) -> dict:
    """One instance start, as model.py does it; seconds from this process's start."""
    if variant == "before":
        sys.path.insert(0, os.environ["PARASTREAM_BEFORE"])
    t0 = time.perf_counter()
    if variant == "torchfirst":
        import torch  # noqa: F401
    if variant == "torchinit":
        import threading

        def init():
            import torch

            torch.cuda.init()

        threading.Thread(target=init, name="torch-cuda-init", daemon=True).start()
    from parastream.launcher.bundle import Bundle

    if variant == "nocontext":
        from parastream.launcher import cuda

        cuda.initialize_in_background = lambda device: None
    try:
        bundle = Bundle.open(bundle_path, loading=True, device=0)
    except TypeError:  # an earlier checkout: no device argument
        bundle = Bundle.open(bundle_path, loading=True)
    t_open = time.perf_counter()
    import torch

    t_torch = time.perf_counter()
    torch.cuda.set_device(0)
    t_dev = time.perf_counter()
    from parastream.launcher.gpu import GpuLauncher, load_phases

    if variant == "switch":
        sys.setswitchinterval(5e-4)
    if variant == "serial":
        from parastream.launcher.engines import torch as torch_engines

        torch_engines.warms_after_load = False
    la = GpuLauncher(bundle, device=0)
    t_ready = time.perf_counter()
    cpu = os.times()
    res = {"cpu_s": cpu.user + cpu.system, "variant": variant, "python_to_t0_s": t0 - T_START, "open_s": t_open - t0, "torch_ready_s": t_torch - t0,
           "set_device_s": t_dev - t_torch, "launcher_s": t_ready - t_dev, "initialize_s": t_ready - t0,
           "process_to_ready_s": t_ready - T_START + _age_at_start(), "phases": load_phases(la)}
    from parastream.launcher.engines import torch as tb

    res["threads_s"] = {k: [round(a - t0, 3), round(b - t0, 3)] for k, (a, b) in getattr(tb, "RUNTIME_IMPORT_TIMES", {}).items()}
    try:
        from parastream.launcher import cuda

        res["threads_s"].update({f"context{d}": [round(a - t0, 3), round(b - t0, 3)]
                                 for d, (a, b) in getattr(cuda, "CONTEXT_TIMES", {}).items()})
    except ImportError:
        pass
    import numpy as np

    x = {s.name: np.random.default_rng(0).standard_normal(s.shape).astype(s.dtype) for s in la.plan.inputs}
    out = la(x)
    res["finite"] = all(bool(np.isfinite(np.asarray(v, dtype=np.float64)).all()) for v in out.values())
    la.close()
    return res


def _age_at_start() -> float:
    """Seconds from this process's start (/proc) to T_START: the interpreter's own start."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK") - (time.perf_counter() - T_START))
    except (OSError, ValueError, IndexError):
        return 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--variants", default="now,nocontext,before")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_out"))
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args.bundle, args.child)), flush=True)
        return 0
    variants = args.variants.split(",")
    rows = []
    for rep in range(args.reps):
        for v in variants:
            d = tempfile.mkdtemp(prefix="inductor-empty-")
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"{d}/inductor", TRITON_CACHE_DIR=f"{d}/triton")
            p = subprocess.run([sys.executable, __file__, args.bundle, "--child", v], capture_output=True, text=True,
                               env=env, timeout=300)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
            row = json.loads(line[7:]) if line else {"variant": v, "error": p.stderr[-1500:]}
            row["rep"] = rep
            print(json.dumps(row), flush=True)
            rows.append(row)
    import numpy as np

    summary = {}
    for v in variants:
        ok = [r for r in rows if r["variant"] == v and "error" not in r]
        summary[v] = {k: round(float(np.median([r[k] for r in ok])), 3) for k in
                      ("initialize_s", "process_to_ready_s", "cpu_s", "open_s", "torch_ready_s", "set_device_s", "launcher_s")} if ok else None
        if ok:
            summary[v]["warm_wall_s"] = round(float(np.median([r["phases"].get("warm_wall", 0.0) for r in ok])), 3)
            summary[v]["initialize_all_s"] = [round(r["initialize_s"], 2) for r in ok]
    print("SUMMARY " + json.dumps(summary), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "instance_load.json").write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
