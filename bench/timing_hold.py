#!/usr/bin/env python3
"""Whether what else a build's process and machine run changes the build's timings, and whether queuing each timed
block whole behind a closed gate (``pipeline.bench.measure(hold=True)``, ``cuda.StreamGate``) takes that away.

A build times its candidates and alternatives while its compile workers fill the machine's cores and other
threads of its process (result handling, loads) take the interpreter lock.  The timing thread queues, per replay,
an input copy, a start event, the graph launch and an end event: a thread kept off the CPU between a start event
and its launch leaves the GPU idle inside the timed interval.  With the gate closed the GPU starts a block only
once all of it is queued.

Per model (bench/gpu.py's exports, fp16, batch 1), one bundle is built without the search (``search=False``, the
engines a default build ships); two launchers of the same engines (A, and B sharing A's engines: their times
should be the same) are timed in alternating blocks (``measure``, 200 replays each), unheld and held, under:

  quiet   nothing else running
  cpu     one busy process per core (a build's compile workers)
  gil     two threads of this process spinning in Python (the interpreter lock taken every switch interval)
  both    cpu and gil

each condition ``--reps`` times, in interleaved order.  Also: the CPU seconds of one ``launch()`` (a graph
launch) measured while the stream is held, so that the GPU's queue does not push back.  Writes
OUT/timing_hold.json: per model, condition and hold, each rep's medians, p10/p90 and A/B, and ``measure``'s
``info`` (blocks held, opened by the gate's timer).

``--states N`` instead times A and B, held, in N alternating blocks of ``--runs`` replays each in a quiet
process, with an idle pause of ``--pause`` seconds before every tenth pair, while a thread reads the GPU's
clocks through NVML every 2 ms (nvidia-ml-py; bench/triton_wheels.sh carries it): per block its median, the SM
and memory clocks, power and clock-event reasons NVML reported while it ran.  This is the question of a
launcher's "second speed" (bench/NOTES.md): the same engines timed at two speeds for whole blocks at a time,
with nothing else on the GPU.  ``--states`` also times A and B interleaved replay by replay (one block, A and B
replays alternating on one stream), where any state of the GPU is shared by both.  With ``--in-build`` the
bundle is a full GPU build of this process (the measured search, the timed rounds, its compile workers), as in
a build's own timings, and the states are timed twice: with the build's compile workers alive, then after they
are shut down.

Run on the device machine from the repository root after ``source bench/device_env.sh``:

    python3 bench/timing_hold.py --models nasnetalarge,bert --out $OUT
    python3 bench/timing_hold.py --models bert --states 40 [--in-build] --out $OUT
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

CONDITIONS = ("quiet", "cpu", "gil", "both")


def _spin(stop) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(10000):
            x += 1


@contextlib.contextmanager
def disturbed(condition: str):
    """The condition's load on the machine while the block runs."""
    procs, threads = [], []
    stop_p = multiprocessing.Event()
    stop_t = threading.Event()
    if condition in ("cpu", "both"):
        procs = [multiprocessing.Process(target=_spin, args=(stop_p,), daemon=True) for _ in range(os.cpu_count() or 2)]
        for p in procs:
            p.start()
    if condition in ("gil", "both"):
        threads = [threading.Thread(target=_spin, args=(stop_t,), daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
    time.sleep(0.3)
    try:
        yield
    finally:
        stop_p.set()
        stop_t.set()
        for p in procs:
            p.join(5)
        for t in threads:
            t.join(5)


def launch_cpu_us(la, n: int = 50) -> dict:
    """Median wall microseconds of one ``la.launch()`` while the stream is held (nothing runs meanwhile)."""
    from parastream.launcher import cuda

    gate = cuda.StreamGate(limit_s=10.0)
    each = []
    try:
        gate.close(la.origin)
        for _ in range(n):
            t0 = time.perf_counter()
            la.launch()
            each.append((time.perf_counter() - t0) * 1e6)
        gate.open()
        la.synchronize()
    finally:
        gate.free()
    return {"median_us": round(float(np.median(each)), 1), "p90_us": round(float(np.percentile(each, 90)), 1)}


class ClockSampler:
    """A thread that reads GPU ``device``'s clocks, power and clock-event reasons through NVML every ``every_s``
    (the physical GPU by its PCI bus id, so that CUDA_VISIBLE_DEVICES does not change which one); ``window(t0,
    t1)`` summarises the samples taken between two ``time.perf_counter()`` readings.  No-op without NVML."""

    def __init__(self, device: int = 0, every_s: float = 0.002):
        self.samples: list = []
        self.error = None
        self.stop = threading.Event()
        try:
            import pynvml

            from parastream.launcher import cuda

            pynvml.nvmlInit()
            self.nv, self.h = pynvml, pynvml.nvmlDeviceGetHandleByPciBusId(cuda.pci_bus_id(device))
        except Exception as e:  # noqa: BLE001 - no NVML here: the timings still run, without clocks
            self.nv, self.error = None, f"{type(e).__name__}: {e}"
            return
        self.thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self.thread.start()

    def _run(self, every_s: float) -> None:
        nv, h = self.nv, self.h
        reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        while not self.stop.is_set():
            try:
                self.samples.append((time.perf_counter(), nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                                     nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM), nv.nvmlDeviceGetPowerUsage(h) / 1e3,
                                     int(reasons(h))))
            except Exception as e:  # noqa: BLE001 - recorded once, sampling stops
                self.error = f"{type(e).__name__}: {e}"
                return
            time.sleep(every_s)

    def window(self, t0: float, t1: float) -> dict:
        got = [s for s in self.samples if t0 <= s[0] <= t1]
        if not got:
            return {"samples": 0}
        sm, mem, watts = (np.array([s[i] for s in got], dtype=float) for i in (1, 2, 3))
        return {"samples": len(got), "sm_mhz": [int(sm.min()), int(np.median(sm)), int(sm.max())],
                "mem_mhz": int(np.median(mem)), "watts": round(float(np.median(watts)), 1),
                "reasons": sorted({hex(s[4]) for s in got})}

    def close(self) -> None:
        self.stop.set()
        if self.nv is not None:
            self.thread.join(1)


def interleaved(a, b, runs: int) -> dict:
    """A's and B's replays one after the other, A, B, A, B, in one held block (each on its own origin stream, the
    two chained by events; both launchers share A's engines but not their memory), each replay between its own
    events: whatever state the GPU is in, both see it."""
    from parastream.launcher import cuda

    starts = {k: [cuda.event_create(timing=True) for _ in range(runs)] for k in "AB"}
    ends = {k: [cuda.event_create(timing=True) for _ in range(runs)] for k in "AB"}
    gate = cuda.StreamGate(limit_s=10.0)
    try:
        for la in (a, b):
            la.launch()
        a.synchronize()
        b.synchronize()
        gate.close(a.origin)
        wait = cuda.event_create()  # (reused: a stream waits on the event as recorded when the wait is queued)
        for i in range(runs):
            for k, la in (("A", a), ("B", b)):
                cuda.event_record(starts[k][i], la.origin)
                la.launch()
                cuda.event_record(ends[k][i], la.origin)
                cuda.event_record(wait, la.origin)
                cuda.stream_wait_event(b.origin if la is a else a.origin, wait)
        gate.open()
        a.synchronize()
        b.synchronize()
        cuda.event_destroy(wait)
        return {k: round(float(np.median([cuda.event_elapsed_ms(s, e) for s, e in zip(starts[k], ends[k])])), 4) for k in "AB"}
    finally:
        gate.free()
        for k in "AB":
            for e in starts[k] + ends[k]:
                cuda.event_destroy(e)


def states(name: str, a, b, args) -> dict:
    """``--states``: A and B timed held in alternating blocks with the GPU's clocks read meanwhile."""
    from parastream.pipeline.bench import measure

    sampler = ClockSampler()
    rows = []
    try:
        for i in range(args.states):
            if i % 10 == 0 and i:
                time.sleep(args.pause)  # idle: does the next block run in another state?
            for k, la in (("A", a), ("B", b)):
                t0 = time.perf_counter()
                t = measure({k: la}, runs=args.runs, warmup=5, hold=True, seed=i)[k]
                row = {"block": i, "launcher": k, "median_ms": round(float(np.median(t)), 4),
                       "p10_p90": [round(float(np.percentile(t, 10)), 4), round(float(np.percentile(t, 90)), 4)],
                       "after_pause": i % 10 == 0 and i > 0, **sampler.window(t0, time.perf_counter())}
                rows.append(row)
                print(json.dumps({"model": name, **row}), flush=True)
        pairs = [interleaved(a, b, args.runs) for _ in range(5)]
        print(json.dumps({"model": name, "interleaved": pairs}), flush=True)
    finally:
        sampler.close()
    meds = np.array([r["median_ms"] for r in rows])
    return {"blocks": rows, "interleaved": pairs, "nvml_error": sampler.error,
            "spread": {"min_ms": float(meds.min()), "median_ms": float(np.median(meds)), "max_ms": float(meds.max())}}


def one_model(name: str, work: Path, args) -> dict:
    from gpu import export_with_reference

    from parastream.launcher.gpu import GpuLauncher
    from parastream.pipeline import build
    from parastream.pipeline.bench import measure

    _, _, onnx_path, _, _, export_s = export_with_reference(name, work, 1)
    t0 = time.perf_counter()
    full = bool(args.states and args.in_build)  # the build's own process, as its measured search times
    bundle = build(onnx_path, work / f"{name}_bundle", backend="torch", precision="fp16", search=full, measure=full,
                   force=True)
    res: dict = {"model": name, "export_s": round(export_s, 1), "build_s": round(time.perf_counter() - t0, 1),
                 "streams": bundle.plan.num_streams, "engines": len(bundle.plan.branches), "runs": []}
    a = GpuLauncher(bundle)
    b = GpuLauncher(bundle, engines=a.engines)
    if args.states:
        try:
            res["states"] = states(name, a, b, args)
            if full:  # the same launchers once the build's compile workers are gone (the process's pool, which
                # nothing outside the engine module shuts down otherwise: a diagnostic reaches into it)
                from parastream.launcher.engines import torch as torch_engines

                for pool in list(torch_engines._POOL.values()):
                    pool.shutdown(wait=True, cancel_futures=True)
                torch_engines._POOL.clear()
                res["states_without_workers"] = states(name, a, b, args)
            return res
        finally:
            b.close()
            a.close()
    try:
        res["launch_cpu"] = launch_cpu_us(a)
        order = [(c, h) for c in CONDITIONS for h in (False, True)]
        for rep in range(args.reps):
            for condition, hold in (order if rep % 2 == 0 else order[::-1]):
                info: dict = {}
                with disturbed(condition):
                    times = measure({"A": a, "B": b}, runs=args.runs, warmup=20, hold=hold, info=info, seed=rep)
                row = {"rep": rep, "condition": condition, "hold": hold, "info": info}
                for k, t in times.items():
                    row[k] = {"median_ms": round(float(np.median(t)), 4),
                              "p10_p90": [round(float(np.percentile(t, 10)), 4), round(float(np.percentile(t, 90)), 4)]}
                row["a_over_b"] = round(row["A"]["median_ms"] / row["B"]["median_ms"], 4)
                res["runs"].append(row)
                print(json.dumps({"model": name, **row}), flush=True)
    finally:
        b.close()
        a.close()
    summary = {}
    for condition in CONDITIONS:
        for hold in (False, True):
            meds = [r["A"]["median_ms"] for r in res["runs"] if r["condition"] == condition and r["hold"] == hold]
            summary[f"{condition}/{'held' if hold else 'queued'}"] = round(float(np.median(meds)), 4)
    res["summary_median_ms_A"] = summary
    print(json.dumps({"model": name, "summary": summary, "launch_cpu": res["launch_cpu"]}), flush=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="nasnetalarge,bert")
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--states", type=int, default=0, help="time A and B held in this many alternating blocks, "
                    "with the GPU's clocks read meanwhile, instead of the conditions")
    ap.add_argument("--pause", type=float, default=3.0, help="--states: idle seconds before every tenth pair")
    ap.add_argument("--in-build", action="store_true", help="--states on the bundle of a full GPU build (measured "
                    "search, timed rounds) in this process, then again once its compile workers are shut down")
    ap.add_argument("--work", default="/tmp/timing_hold")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/timing_hold_out"))
    args = ap.parse_args(argv)
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in [m for m in args.models.split(",") if m]:
        try:
            results.append(one_model(name, work, args))
        except Exception as e:  # noqa: BLE001 - the next model still runs; the file says what failed
            results.append({"model": name, "error": f"{type(e).__name__}: {e}"[:500]})
            print(json.dumps(results[-1]), flush=True)
        (out / "timing_hold.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
