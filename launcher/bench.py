"""``parastream bench OUT``: latency of a bundle on the GPU, against the same engines on one stream.

Both variants are one CUDA Graph each, built from the *same* loaded engines: the
bundle's multi-stream plan, and every branch on a single stream in launch order.
Each is timed with CUDA events around every graph replay, after a warm-up, over
``runs`` replays (median), rotating several random input sets (never zeros) that
are copied in outside the timed region.  The two are timed in alternating blocks
so that clock drift hits both alike.

``timeline=FILE.png`` adds a separate instrumented replay (timing events around
every engine) and draws when each branch ran on each stream.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from . import cuda
from .bundle import Bundle
from .errors import ParastreamError

INPUT_SETS = 4
BLOCK = 25


def _time_replays(launcher, input_sets, runs: int, starts, ends, offset: int) -> None:
    """Queue ``runs`` timed replays (inputs copied device-to-device before each, outside the events)."""
    plan = launcher.plan
    for i in range(runs):
        src = input_sets[(offset + i) % len(input_sets)]
        for spec in plan.inputs:
            cuda.memcpy_dtod_async(launcher.addr[spec.name], src[spec.name], cuda.nbytes_of(spec.shape, spec.dtype), launcher.origin)
        cuda.event_record(starts[offset + i], launcher.origin)
        launcher.launch()
        cuda.event_record(ends[offset + i], launcher.origin)


def measure(launchers: dict, *, runs: int = 200, warmup: int = 20, seed: int = 0) -> dict[str, np.ndarray]:
    """Per-replay milliseconds of each launcher (all of one bundle), timed in alternating blocks."""
    from .gpu import random_array

    first = next(iter(launchers.values()))
    plan = first.plan
    rng = np.random.default_rng(seed)
    # device copies of several input sets
    sets, owned = [], []
    for _ in range(INPUT_SETS):
        d = {}
        for spec in plan.inputs:
            arr = np.ascontiguousarray(random_array(spec, rng))
            ptr = cuda.malloc(arr.nbytes)
            owned.append(ptr)
            host = cuda.malloc_host(arr.nbytes)
            cuda.host_array(host, spec.shape, spec.dtype)[...] = arr
            cuda.memcpy_htod_async(ptr, host, arr.nbytes, first.origin)
            cuda.stream_synchronize(first.origin)
            cuda.free_host(host)
            d[spec.name] = ptr
        sets.append(d)
    try:
        times = {}
        events = {}
        for name, la in launchers.items():
            events[name] = ([cuda.event_create(timing=True) for _ in range(runs)], [cuda.event_create(timing=True) for _ in range(runs)])
            for i in range(warmup):
                src = sets[i % len(sets)]
                for spec in plan.inputs:
                    cuda.memcpy_dtod_async(la.addr[spec.name], src[spec.name], cuda.nbytes_of(spec.shape, spec.dtype), la.origin)
                la.launch()
            la.synchronize()
        done = 0
        while done < runs:
            n = min(BLOCK, runs - done)
            for name, la in launchers.items():
                starts, ends = events[name]
                _time_replays(la, sets, n, starts, ends, done)
                la.synchronize()
            done += n
        for name in launchers:
            starts, ends = events[name]
            times[name] = np.array([cuda.event_elapsed_ms(s, e) for s, e in zip(starts, ends)])
            for e in starts + ends:
                cuda.event_destroy(e)
        return times
    finally:
        for ptr in owned:
            cuda.free(ptr)


def bench_bundle(path, *, runs: int = 200, warmup: int = 20, timeline: str | Path | None = None, console=None,
                 launcher=None) -> dict:
    """Median latency (ms) of the bundle's multi-stream graph and of the same engines on one stream, and their ratio."""
    from .gpu import GpuLauncher

    if runs < 1:
        raise ParastreamError(f"--runs {runs}: must be at least 1")
    bundle = path if isinstance(path, Bundle) else Bundle.open(path)
    if not bundle.backend().gpu:
        raise ParastreamError(f"{bundle.path}: built with --backend {bundle.plan.backend}, which has no GPU engines; "
                              "rebuild with --backend torch or tensorrt to benchmark on the GPU")
    if cuda.device_count() < 1:
        raise ParastreamError("parastream bench needs a CUDA GPU, and cuda-python sees none")
    multi = launcher or GpuLauncher(bundle)
    single = GpuLauncher(bundle, single_stream=True, engines=multi.engines)
    try:
        # same engines, same inputs: the two graphs must agree before their times mean anything
        rng = np.random.default_rng(123)
        from .gpu import random_array

        feeds = {s.name: random_array(s, rng) for s in bundle.plan.inputs}
        a, b = multi(feeds), single(feeds)
        mismatch = {k: float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)))) for k in a}
        times = measure({"parastream": multi, "single_stream": single}, runs=runs, warmup=warmup)
        result = {
            "bundle": str(bundle.path),
            "device": cuda.device_name(multi.device),
            "streams": bundle.plan.num_streams,
            "branches": len(bundle.plan.branches),
            "precision": bundle.plan.precision,
            "runs": runs,
            "parastream_ms": float(np.median(times["parastream"])),
            "single_stream_ms": float(np.median(times["single_stream"])),
            "parastream_p10_p90_ms": [float(np.percentile(times["parastream"], 10)), float(np.percentile(times["parastream"], 90))],
            "single_stream_p10_p90_ms": [float(np.percentile(times["single_stream"], 10)), float(np.percentile(times["single_stream"], 90))],
            "max_abs_diff_single_vs_multi": mismatch,
        }
        result["speedup"] = result["single_stream_ms"] / result["parastream_ms"]
        if timeline is not None:
            spans = multi.run_timed()
            result["timeline"] = str(timeline)
            result["timeline_mode"] = spans[0]["mode"] if spans else "none"
            result["busy_fraction"] = draw_timeline(spans, timeline, title=f"{bundle.path.name}: {bundle.plan.num_streams} streams, "
                                                    f"{len(spans)} branches, {result['parastream_ms']:.3f} ms per replay")
        if console is not None:
            print_bench(result, console)
        return result
    finally:
        single.close()
        if launcher is None:
            multi.close()


def print_bench(result: dict, console) -> None:
    from rich.table import Table

    t = Table(title=f"parastream bench — {result['bundle']} on {result['device']}")
    t.add_column("variant")
    t.add_column("median ms", justify="right")
    t.add_column("p10–p90 ms", justify="right")
    t.add_row(f"parastream ({result['streams']} streams, {result['branches']} engines, one CUDA Graph)",
              f"{result['parastream_ms']:.3f}", "–".join(f"{x:.3f}" for x in result["parastream_p10_p90_ms"]))
    t.add_row("same engines, one stream, one CUDA Graph", f"{result['single_stream_ms']:.3f}",
              "–".join(f"{x:.3f}" for x in result["single_stream_p10_p90_ms"]))
    console.print(t)
    console.print(f"speedup from streams: {result['speedup']:.2f}x over {result['runs']} replays each")
    if "timeline" in result:
        console.print(f"timeline: {result['timeline']} (GPU busy on some stream {100 * result['busy_fraction']:.0f}% of the replay)")


def draw_timeline(spans: list[dict], path, *, title: str = "") -> float:
    """Draw branch spans per stream into ``path`` (PNG); return the fraction of the replay with some stream busy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    streams = sorted({s["stream"] for s in spans})
    end = max((s["end_ms"] for s in spans), default=1.0)
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.6 * len(streams)))
    colors = plt.get_cmap("tab20")
    for s in spans:
        y = streams.index(s["stream"])
        width = max(s["end_ms"] - s["start_ms"], end * 1e-4)
        ax.broken_barh([(s["start_ms"], width)], (y - 0.4, 0.8), facecolors=colors(s["branch"] % 20), edgecolor="black", linewidth=0.3)
        if width > end * 0.04:
            ax.text(s["start_ms"] + width / 2, y, s["name"].replace("branch_", "b"), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(streams)))
    ax.set_yticklabels([f"stream {s}" for s in streams])
    ax.set_xlabel("ms since the replay started")
    ax.set_xlim(0, end * 1.01)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    # union of busy intervals
    iv = sorted((s["start_ms"], s["end_ms"]) for s in spans)
    busy, cur_s, cur_e = 0.0, None, None
    for a, b in iv:
        if cur_e is None or a > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = a, b
        else:
            cur_e = max(cur_e, b)
    if cur_e is not None:
        busy += cur_e - cur_s
    return busy / end if end > 0 else 0.0
