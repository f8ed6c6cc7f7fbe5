#!/usr/bin/env python3
"""Triton on the GPU: a torch bundle served by NVIDIA's tritonserver (nvidia-pytriton's), KIND_GPU.

Run on the device machine from the repository root after ``source bench/device_env.sh`` (with .whl/
carrying nvidia-pytriton and the HTTP client's wheels; bench/NOTES.md says which).

For each model (bench/gpu.py's Inception-v3 and BERT-base seq 128; random weights, batch 1, fp16):
  1. ``parastream.pipeline.build`` (torch backend, fp16, verification on; ``--search`` to run the rewrite
     search, off by default: it does not change what is measured here, the server's overhead), then
     ``export_triton`` (graph mode: Python backend, KIND_GPU, ``FORCE_CPU_ONLY_INPUT_TENSORS: "no"``);
  2. tritonserver on that repository (tests/triton_server/tritonserver_process.py); checks: the model is
     ready; the outputs over HTTP, over gRPC, and over gRPC with the inputs in CUDA shared memory (Triton
     then hands model.py GPU tensors, which it reads through DLPack) against onnxruntime fp32 on the
     original model (max|out-ref|/max|ref| <= 0.1, the fp16 criterion of ``parastream verify``) and
     against the in-process launcher on the same input;
  3. timings, wall clock per request (time.perf_counter), after warm-up:
     - in-process GpuLauncher: numpy in and out (host copies included, as a client's tensors travel) and
       torch CUDA tensors in and out (the replay alone);
     - Triton end to end, one client: HTTP, gRPC, gRPC with CUDA-shared-memory inputs; p50 and p99;
     - throughput with 1, 4 and 16 concurrent clients (one process each, so that clients do not share
       a GIL), HTTP and gRPC, for ``--seconds`` each: requests/s, p50 and p99.
Writes triton_gpu_<models>.json and .md to --out ($OUT).

``--starts N`` does only this: N instance starts of each model (a new server each), one request checked against
onnxruntime each, and what model.py's initialize logged (an instance start; target <= 3 s).

``--gpus 0,1`` does only this (a machine with two GPUs): the bundle exported three ways, one instance on GPU 0,
two instances on GPU 0, one instance on each of GPU 0 and GPU 1 (instance_group gpus [0, 1]); each served and
driven by ``--clients`` gRPC client processes for ``--seconds``, every answer checked against onnxruntime once
per client; requests/s, p50/p99 and each GPU's NVML utilisation meanwhile; the ratios to one instance on GPU 0.

Usage: python3 bench/triton_gpu.py [--models inception_v3,bert] [--requests 300] [--seconds 5] [--out DIR]
       python3 bench/triton_gpu.py --models inception_v3,bert --gpus 0,1 --clients 16 --seconds 10
       python3 bench/triton_gpu.py --models inception_v4 --starts 4 [--reuse] [--tag after]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests" / "triton_server"))
from gpu import export, make_model, max_err, ort_reference  # noqa: E402
from triton_clients import client_of, infer, make_inputs  # noqa: E402
from tritonserver_process import TritonServer, python_library, unavailable  # noqa: E402

SCALE_TOL = 0.1  # parastream verify's fp16 criterion (pipeline/verify.py DEFAULT_SCALE_TOLERANCES)
CLIENTS = (1, 4, 16)


def percentiles(ms: list[float]) -> dict:
    a = np.asarray(ms, np.float64)
    return {"n": int(a.size), "p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
            "mean_ms": float(a.mean())}


# -- clients (also run in worker processes) ----------------------------------------------------------
class _Address:
    """What client_of() needs of a server, picklable into worker processes."""

    def __init__(self, http_url: str, grpc_url: str):
        self.http_url, self.grpc_url = http_url, grpc_url


def client_loop(protocol: str, address: _Address, model: str, feeds: dict, outputs: list[str], start_at: float, seconds: float,
                warmup: int = 5, max_requests: int = 100_000) -> list[float]:
    """One client process: warm up, wait for the common start, send requests back to back for ``seconds``."""
    client = client_of(address, protocol)
    try:
        inputs = make_inputs(protocol, feeds)
        for _ in range(warmup):
            infer(client, protocol, model, inputs, outputs)
        while time.time() < start_at:
            time.sleep(0.001)
        began = time.time()
        stop = time.perf_counter() + seconds
        lat = []
        while time.perf_counter() < stop and len(lat) < max_requests:
            t0 = time.perf_counter()
            infer(client, protocol, model, inputs, outputs)
            lat.append((time.perf_counter() - t0) * 1e3)
        return {"lat": lat, "began": began, "ended": time.time()}
    finally:
        client.close()


def sequential(client, protocol: str, model: str, inputs: list, outputs: list[str], n: int, warmup: int = 20) -> dict:
    for _ in range(warmup):
        infer(client, protocol, model, inputs, outputs)
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        infer(client, protocol, model, inputs, outputs)
        lat.append((time.perf_counter() - t0) * 1e3)
    return percentiles(lat)


def throughput(protocol: str, server: TritonServer, model: str, feeds: dict, outputs: list[str], clients: int, seconds: float) -> dict:
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(clients, mp_context=ctx) as pool:
        start_at = time.time() + 5.0 + 0.5 * clients  # after every worker has started and warmed up
        address = _Address(server.http_url, server.grpc_url)
        futures = [pool.submit(client_loop, protocol, address, model, feeds, outputs, start_at, seconds)
                   for _ in range(clients)]
        runs = [f.result(timeout=seconds + 300) for f in futures]
    total = sum(len(r["lat"]) for r in runs)
    window = max(r["ended"] for r in runs) - min(r["began"] for r in runs)  # > seconds when a client started late
    res = percentiles([v for r in runs for v in r["lat"]])
    res.update(clients=clients, requests=total, per_s=total / window, seconds=window,
               began=min(r["began"] for r in runs), ended=max(r["ended"] for r in runs))
    return res


# -- one model ---------------------------------------------------------------------------------------
def in_process(bundle_path: Path, feeds: dict, n: int) -> tuple[dict, dict]:
    """In-process GpuLauncher latencies (numpy and device tensors) and its outputs on ``feeds``."""
    import torch

    from parastream.launcher.gpu import GpuLauncher

    la = GpuLauncher(str(bundle_path))
    try:
        out = la(feeds)
        res = {}
        lat = []
        for i in range(n + 20):
            t0 = time.perf_counter()
            la(feeds)
            if i >= 20:
                lat.append((time.perf_counter() - t0) * 1e3)
        res["numpy"] = percentiles(lat)
        dev = {k: torch.from_numpy(v).cuda() for k, v in feeds.items()}
        torch.cuda.synchronize()
        lat = []
        for i in range(n + 20):
            t0 = time.perf_counter()
            la(dev)  # synchronizes its stream before returning device outputs
            if i >= 20:
                lat.append((time.perf_counter() - t0) * 1e3)
        res["device"] = percentiles(lat)
        return res, out
    finally:
        la.close()


def cuda_shm_request(server: TritonServer, model: str, feeds: dict, outputs: list[str], n: int) -> tuple[dict, dict]:
    """gRPC with every input in a CUDA shared-memory region: outputs of one request and the latencies of ``n``."""
    import tritonclient.utils.cuda_shared_memory as cudashm

    client = client_of(server, "grpc")
    handles, names = [], {}
    try:
        for name, x in feeds.items():
            region = f"in_{name}_{os.getpid()}"
            h = cudashm.create_shared_memory_region(region, x.nbytes, 0)
            handles.append(h)
            cudashm.set_shared_memory_region(h, [np.ascontiguousarray(x)])
            client.register_cuda_shared_memory(region, cudashm.get_raw_handle(h), 0, x.nbytes)
            names[name] = region
        inputs = make_inputs("grpc", feeds, shm=names)
        out = infer(client, "grpc", model, inputs, outputs)
        return out, sequential(client, "grpc", model, inputs, outputs, n)
    finally:
        try:
            client.unregister_cuda_shared_memory()
        except Exception:  # noqa: BLE001
            pass
        for h in handles:
            cudashm.destroy_shared_memory_region(h)
        client.close()


def wait_ready(server, name: str, timeout: float) -> None:
    """Until the model is ready (its model.py initialized); the server's log in the error otherwise."""
    client = client_of(server, "http")
    deadline = time.perf_counter() + timeout
    try:
        while time.perf_counter() < deadline:
            try:
                if client.is_model_ready(name):
                    return
            except Exception:  # noqa: BLE001 - still loading
                pass
            time.sleep(0.5)
    finally:
        client.close()
    raise RuntimeError(f"model {name} not ready after {timeout:.0f} s; server log:\n{server.log_tail(60)}")


def start_ready(server: TritonServer, name: str, timeout: float) -> float:
    """Start the server and wait until the model is ready: the seconds it took."""
    t0 = time.perf_counter()
    server.start(timeout=timeout)
    wait_ready(server, name, timeout)
    return time.perf_counter() - t0


def start_checked(server: TritonServer, name: str, protocol: str, feeds: dict, ref: dict, timeout: float):
    """Start the server, wait until the model is ready and check one request against onnxruntime: (the seconds
    to ready, each output's error)."""
    seconds = start_ready(server, name, timeout)
    client = client_of(server, protocol)
    try:
        got = infer(client, protocol, name, make_inputs(protocol, feeds), list(ref))
        return seconds, {o: max_err(got[o], ref[o]) for o in ref}
    finally:
        client.close()


def prepared(name: str, args, work: Path, res: dict):
    """The model exported (or, with ``--reuse``, the ONNX an earlier run left), its onnxruntime outputs and its
    bundle built (``--reuse``: the bundle an earlier run built): (bundle, feeds, reference outputs)."""
    from parastream.launcher.bundle import Bundle
    from parastream.pipeline import build

    model, inputs = make_model(name)
    onnx_path = work / f"{name}.onnx"
    if not (args.reuse and onnx_path.exists()):
        export(model, inputs, onnx_path)
    feeds = {k: v.numpy() for k, v in inputs.items()}
    ref = ort_reference(onnx_path, feeds)
    t0 = time.perf_counter()
    if args.reuse and (work / f"{name}.bundle" / "manifest.json").exists():  # a bundle this script built before
        bundle = Bundle.open(work / f"{name}.bundle")
        res["reused_bundle"] = True
    else:
        bundle = build(onnx_path, work / f"{name}.bundle", backend="torch", precision="fp16", search=args.search, force=True)
        res["build_s"] = time.perf_counter() - t0
    res["plan"] = {"streams": bundle.plan.num_streams, "branches": len(bundle.plan.branches)}
    return bundle, feeds, ref


def run_model(name: str, args, work: Path, res: dict) -> dict:
    """Fill ``res`` (the caller keeps what was filled when this raises: the server's log above all)."""
    from parastream.pipeline.triton import export_triton

    bundle, feeds, ref = prepared(name, args, work, res)
    outputs = list(ref)

    res["in_process"], la_out = in_process(bundle.path, feeds, args.requests)
    res["launcher_vs_ort"] = {o: max_err(la_out[o], ref[o]) for o in outputs}

    repo = work / f"{name}.repo.{os.getpid()}"  # Triton's stub leaves __pycache__ in a repository it served
    export_triton(bundle, repo, name=name, instances=args.instances, force=True)
    res["config"] = (repo / name / "config.pbtxt").read_text()
    checks, timing = {}, {}
    server = TritonServer(repo, work / f"{name}.server")
    try:
        res["server_start_s"] = start_ready(server, name, args.start_timeout)
        # each instance's model.py initialize, as it logs it (the stub's start and imports before it are not in it)
        res["initialize_s"] = [float(x) for x in re.findall(rf"parastream: {re.escape(name)}\S* ready in ([\d.]+) s",
                                                             server.log())]
        res["stub_libpython"] = sorted({p for pid in server.stub_pids() for p in server.libpythons(pid)})
        protocols = args.protocols.split(",")
        for protocol in protocols:
            client = client_of(server, protocol)
            try:
                checks[f"{protocol}_ready"] = bool(client.is_model_ready(name))
                ins = make_inputs(protocol, feeds)
                got = infer(client, protocol, name, ins, outputs)
                checks[f"{protocol}_vs_ort"] = {o: max_err(got[o], ref[o]) for o in outputs}
                checks[f"{protocol}_vs_launcher"] = {o: max_err(got[o], la_out[o]) for o in outputs}
                timing[f"{protocol}_1_client"] = sequential(client, protocol, name, ins, outputs, args.requests)
            finally:
                client.close()
        try:
            if "grpc" not in protocols:
                raise RuntimeError("gRPC not asked for (--protocols)")
            got, lat = cuda_shm_request(server, name, feeds, outputs, args.requests)
            checks["grpc_cuda_shm_vs_ort"] = {o: max_err(got[o], ref[o]) for o in outputs}
            checks["grpc_cuda_shm_vs_launcher"] = {o: max_err(got[o], la_out[o]) for o in outputs}
            timing["grpc_cuda_shm_1_client"] = lat
        except Exception as e:  # noqa: BLE001 - reported, the rest still runs
            checks["grpc_cuda_shm_error"] = f"{type(e).__name__}: {e}"[:500]
        for protocol in protocols:
            for c in CLIENTS:
                timing[f"{protocol}_{c}_clients"] = throughput(protocol, server, name, feeds, outputs, c, args.seconds)
    finally:
        res["server_log_tail"] = server.log_tail(40)
        log = server.log()
        res["initialize_lines"] = re.findall(r"parastream: \S+ ready in [^)]*\)", log)
        res["server_log_errors"] = {"tracebacks": log.count("Traceback (most recent call last)"),
                                    "pycapsule": log.count("PyCapsule_GetPointer called with incorrect name")}
        server.stop()
    res["checks"] = checks
    res["timing"] = timing
    errs = [v for k, d in checks.items() if k.endswith("_vs_ort") for v in d.values()]
    res["ok"] = all(checks.get(f"{p}_ready") for p in protocols) and bool(errs) and max(errs) <= SCALE_TOL
    return res


INIT_RE = (r"parastream: {name}\S* ready in ([\d.]+) s \(imports and bundle opened ([\d.]+) s, (?:torch imported at "
           r"([\d.]+) s, )?\d+ branches loaded and captured ([\d.]+) s(?:, the process's CPU ([\d.]+) s)?"
           r"(?:; ([\d.]+) s since the stub process started)?\)")


def logged_load_phases(log: str) -> list[dict]:
    """model.py's load-phase lines in a server's ``log`` (its second line after ``ready in``: the launcher's engine
    loads by phase, ``launcher.gpu.load_phases``), one {phase: seconds} per instance start logged."""
    return [{k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+)", m)}
            for m in re.findall(r"parastream: \S+ load phases \(s, summed over engines\): ([^\n]*)", log)]


def logged_plans_refused(log: str) -> list[str]:
    """model.py's line, per instance start that logged one, naming the shipped cuDNN plans its load built again
    and why (``cudnn_plans.plans_refused``)."""
    return re.findall(r"parastream: \S+ cuDNN plans not used as shipped: ([^\n]*)", log)


def instance_starts(name: str, args, work: Path, res: dict) -> dict:
    """``--starts N``: the model's bundle served N times, each by a new server (a new stub process: a Triton
    instance start as a deployment sees it), one HTTP request checked against onnxruntime each time; what each
    start's model.py logged (initialize, when torch was ready, the load and capture, the stub process's age)."""
    from parastream.pipeline.triton import export_triton

    bundle, feeds, ref = prepared(name, args, work, res)
    outputs = list(ref)
    repo = work / f"{name}.repo.{os.getpid()}"
    export_triton(bundle, repo, name=name, instances=args.instances, force=True)
    res["starts"] = []
    for i in range(args.starts):
        start: dict = {}
        server = TritonServer(repo, work / f"{name}.server{i}")
        try:
            start["server_start_to_ready_s"], start["http_vs_ort"] = start_checked(server, name, "http", feeds, ref,
                                                                                  args.start_timeout)
        finally:
            log = server.log()
            start["initialize_lines"] = re.findall(r"parastream: \S+ ready in [^)]*\)", log)
            start["initialize"] = [{"initialize_s": float(a), "open_s": float(b), "torch_at_s": float(c) if c else None,
                                    "load_capture_s": float(d), "cpu_s": float(u) if u else None,
                                    "stub_age_s": float(e) if e else None}
                                   for a, b, c, d, u, e in re.findall(INIT_RE.format(name=re.escape(name)), log)]
            start["load_phases"] = logged_load_phases(log)
            start["plans_refused"] = logged_plans_refused(log)
            start["tracebacks"] = log.count("Traceback (most recent call last)")
            server.stop()
        print(json.dumps(start), flush=True)
        res["starts"].append(start)
    inits = [x["initialize_s"] for st in res["starts"] for x in st["initialize"]]
    ages = [x["stub_age_s"] for st in res["starts"] for x in st["initialize"] if x["stub_age_s"] is not None]
    res["initialize_s"] = inits
    res["summary"] = {"initialize_median_s": float(np.median(inits)) if inits else None, "initialize_max_s": max(inits, default=None),
                      "stub_age_median_s": float(np.median(ages)) if ages else None,
                      "errors_max": max((v for st in res["starts"] for v in st.get("http_vs_ort", {}).values()), default=None)}
    errs = [v for st in res["starts"] for v in st.get("http_vs_ort", {}).values()]
    res["ok"] = len(errs) == args.starts * len(outputs) and max(errs) <= SCALE_TOL
    return res


def _utilisation(gpus: list[int], stop, samples: dict) -> None:
    """Sample each GPU's NVML utilisation every 50 ms until ``stop`` is set (a thread of the benchmark)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        handles = {g: pynvml.nvmlDeviceGetHandleByIndex(g) for g in gpus}
        while not stop.is_set():
            for g, h in handles.items():
                samples[g].append((time.time(), pynvml.nvmlDeviceGetUtilizationRates(h).gpu))
            time.sleep(0.05)
    finally:
        pynvml.nvmlShutdown()


def several_gpus(name: str, args, work: Path, res: dict) -> dict:
    """``--gpus``: one instance on the first GPU, two on it, one on each GPU listed; throughput of each at
    ``--clients`` gRPC clients (one process each), answers checked, per-GPU utilisation meanwhile."""
    import threading

    from parastream.pipeline.triton import export_triton

    gpus = [int(g) for g in args.gpus.split(",")]
    bundle, feeds, ref = prepared(name, args, work, res)
    outputs = list(ref)
    layouts = {"1_instance_gpu_0": ([gpus[0]], 1), f"{len(gpus)}_instances_gpu_{gpus[0]}": ([gpus[0]], len(gpus)),
               f"1_instance_each_gpu_{'_'.join(map(str, gpus))}": (gpus, 1)}
    res["layouts"] = {}
    for label, (on, count) in layouts.items():
        repo = work / f"{name}.repo.{label}.{os.getpid()}"
        export_triton(bundle, repo, name=name, instances=count, gpus=on, force=True)
        server = TritonServer(repo, work / f"{name}.server.{label}")
        row: dict = {"gpus": on, "instances_per_gpu": count}
        try:
            row["server_start_s"], row["vs_ort"] = start_checked(server, name, "grpc", feeds, ref, args.start_timeout)
            samples: dict = {g: [] for g in gpus}
            stop = threading.Event()
            sampler = threading.Thread(target=_utilisation, args=(gpus, stop, samples), daemon=True)
            sampler.start()
            try:
                row["throughput"] = throughput("grpc", server, name, feeds, outputs, args.clients, args.seconds)
            finally:
                stop.set()
                sampler.join()
            t = row["throughput"]  # the samples while every client was sending (not while they started)
            inside = {g: [u for at, u in v if t["began"] <= at <= t["ended"]] for g, v in samples.items()}
            row["utilisation_pct"] = {g: {"median": float(np.median(v)) if v else None, "max": max(v) if v else None}
                                      for g, v in inside.items()}
        finally:
            row["server_log_errors"] = server.log().count("Traceback (most recent call last)")
            server.stop()
        res["layouts"][label] = row
        print(f"{name} {label}: {row['throughput']['per_s']:.0f} req/s at {args.clients} clients, "
              f"utilisation {row['utilisation_pct']}", flush=True)
    base = res["layouts"]["1_instance_gpu_0"]["throughput"]["per_s"]
    res["ratio_to_one_instance"] = {k: r["throughput"]["per_s"] / base for k, r in res["layouts"].items()}
    errs = [v for r in res["layouts"].values() for v in r["vs_ort"].values()]
    res["ok"] = max(errs) <= SCALE_TOL
    return res


def gpus_table(results: list[dict]) -> str:
    lines = ["| model | instances | clients | req/s | p50 ms | p99 ms | GPU utilisation % (median) | ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['model']} | error: {r['error'][:200]} | | | | | | |")
            continue
        for label, row in r["layouts"].items():
            t = row["throughput"]
            util = ", ".join(f"GPU {g}: {u['median']:.0f}" for g, u in row["utilisation_pct"].items() if u["median"] is not None)
            lines.append(f"| {r['model']} | {label.replace('_', ' ')} | {t['clients']} | {t['per_s']:.0f} | {t['p50_ms']:.3f} | "
                         f"{t['p99_ms']:.3f} | {util} | {r['ratio_to_one_instance'][label]:.2f} |")
    return "\n".join(lines)


def table(results: list[dict]) -> str:
    lines = ["| model | path | clients | p50 ms | p99 ms | req/s |", "|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['model']} | error: {r['error']} | | | | |")
            continue
        ip = r["in_process"]
        lines.append(f"| {r['model']} | in-process launcher, numpy in/out | 1 | {ip['numpy']['p50_ms']:.3f} | "
                     f"{ip['numpy']['p99_ms']:.3f} | {1e3 / ip['numpy']['mean_ms']:.0f} |")
        lines.append(f"| {r['model']} | in-process launcher, CUDA tensors | 1 | {ip['device']['p50_ms']:.3f} | "
                     f"{ip['device']['p99_ms']:.3f} | {1e3 / ip['device']['mean_ms']:.0f} |")
        t = r["timing"]
        for key, label in (("http_1_client", "Triton HTTP, sequential"), ("grpc_1_client", "Triton gRPC, sequential"),
                           ("grpc_cuda_shm_1_client", "Triton gRPC, inputs in CUDA shm")):
            if key in t:
                lines.append(f"| {r['model']} | {label} | 1 | {t[key]['p50_ms']:.3f} | {t[key]['p99_ms']:.3f} | "
                             f"{1e3 / t[key]['mean_ms']:.0f} |")
        for protocol in ("http", "grpc"):
            for c in CLIENTS:
                if f"{protocol}_{c}_clients" not in t:
                    continue
                x = t[f"{protocol}_{c}_clients"]
                lines.append(f"| {r['model']} | Triton {'HTTP' if protocol == 'http' else 'gRPC'}, concurrent clients | "
                             f"{c} | {x['p50_ms']:.3f} | {x['p99_ms']:.3f} | {x['per_s']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="inception_v3,bert")
    ap.add_argument("--requests", type=int, default=300, help="sequential requests per latency figure")
    ap.add_argument("--seconds", type=float, default=5.0, help="duration of each throughput run")
    ap.add_argument("--instances", type=int, default=1, help="Triton model instances (KIND_GPU count)")
    ap.add_argument("--search", action="store_true", help="run the rewrite search in the build")
    ap.add_argument("--reuse", action="store_true", help="serve the bundle an earlier run left in the work folder")
    ap.add_argument("--protocols", default="http,grpc",
                    help="the client protocols to check and time (http alone needs no grpcio wheel on the device)")
    ap.add_argument("--start-timeout", type=float, default=420.0, help="seconds for the server to load the model")
    ap.add_argument("--starts", type=int, default=0,
                    help="only start a server this many times (one instance start each, one request checked) and "
                         "report what model.py's initialize logged")
    ap.add_argument("--gpus", default=None,
                    help="only compare one instance on the first GPU listed with one on each (e.g. 0,1)")
    ap.add_argument("--clients", type=int, default=16, help="concurrent gRPC clients of --gpus's throughput")
    ap.add_argument("--tag", default="", help="a suffix for the output files")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_out"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = ("triton_gpu_" + args.models.replace(",", "_") + ("_gpus_" + args.gpus.replace(",", "_") if args.gpus else "")
            + (f"_{args.tag}" if args.tag else ""))  # one call per model keeps each call short
    reason = unavailable()
    print(f"python {sys.version.split()[0]} at {sys.executable}; libpython for the stub: {python_library()}", flush=True)
    if reason:
        print(f"tritonserver cannot start here: {reason}", flush=True)
        (out / f"{stem}.json").write_text(json.dumps({"error": reason}))
        return 2
    import torch

    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    work = Path("/tmp/triton_gpu_work")
    work.mkdir(exist_ok=True)
    results = []
    for name in args.models.split(","):
        t0 = time.perf_counter()
        r: dict = {"model": name}
        try:
            (instance_starts if args.starts else several_gpus if args.gpus else run_model)(name, args, work, r)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            r["error"] = f"{type(e).__name__}: {e}"[:6000]
            print(r.get("server_log_tail", ""), flush=True)
        r["total_s"] = time.perf_counter() - t0
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k not in ("config", "server_log_tail")}, default=str), flush=True)
        (out / f"{stem}.json").write_text(json.dumps(results, indent=1, default=str))
    if args.starts:
        print(json.dumps([{"model": r["model"], **r.get("summary", {}), "initialize_s": r.get("initialize_s")} for r in results]))
        return 0 if all(r.get("ok") for r in results) else 1
    md = gpus_table(results) if args.gpus else table(results)
    (out / f"{stem}.md").write_text(md + "\n")
    print(md)
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
