"""parastream on Triton's Python backend: serves the parastream bundle that lies beside this file.

``parastream export-triton`` (mode graph) copies this file to REPO/NAME/1/model.py and the bundle to
REPO/NAME/1/bundle/.  The server's Python environment needs parastream with the extra of the bundle's
engine backend, installed from a wheel built in the parastream repository (``python3 -m build --wheel``;
parastream is not on a package index): ``pip install "parastream-0.1.0-py3-none-any.whl[trt]"`` for TensorRT
bundles, ``[torch]`` for torch bundles;
onnxruntime bundles need nothing more.  Reading inputs that arrive in GPU memory takes torch.

initialize  loads the bundle once per model instance.  A GPU instance (KIND_GPU) gets parastream's GPU
            launcher on the instance's device: every branch on its own CUDA stream, the whole plan
            captured once as one CUDA Graph and replayed for each batch.  A CPU instance runs the same
            plan on a thread pool, one worker per stream.
execute     reads the inputs of every request -- host tensors as numpy views (``as_numpy``), GPU tensors
            as torch views through DLPack, without a host copy -- and, when the model batches
            (max_batch_size > 0), concatenates the requests Triton's dynamic batcher handed over and pads
            them to the batch the bundle was built for -- or, for a dynamic-batch bundle (buckets), hands
            the launcher those rows as they are: it runs the smallest bucket that holds them.  One launcher run per batch; each request gets
            its slice of the outputs: device outputs leave through DLPack after one device-to-device copy
            (the next replay overwrites the launcher's buffers), host outputs as numpy.  A request that
            fails gets an error response; the others still get their outputs.
finalize    releases the launcher (graph, streams, device memory).
"""

import json
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


# numpy 2 in the server's environment (see _host_tensor); with numpy 1 the backend's own conversions are right,
# and its DLPack import of a numpy 1 array crashes the stub (its capsule deleter), so they stay in use
_NUMPY2 = int(np.__version__.split(".")[0]) >= 2


def _host_array(tensor):
    """A host input as numpy, through DLPack under numpy 2 (see ``_host_tensor``)."""
    if _NUMPY2 and hasattr(tensor, "__dlpack__"):
        try:
            return np.from_dlpack(tensor)
        except (TypeError, BufferError, RuntimeError):  # a dtype DLPack cannot carry (TYPE_BYTES)
            pass
    return tensor.as_numpy()


def _host_tensor(name, arr):
    """A host output through DLPack rather than ``pb_utils.Tensor(name, arr)``: the Python backend of Triton
    2.51 and older was built with pybind11 2.10, which reads numpy 2 arrays as empty (the client gets "cannot
    reshape array of size 0"; triton-inference-server/python_backend#384), and numpy 2 is what a torch
    environment has.  DLPack does not go through pybind11's numpy support; numpy 1.22+ arrays speak it.

    Handed over as a torch view of the array where torch is installed: with numpy's own capsule the server log
    printed "ValueError: PyCapsule_GetPointer called with incorrect name" at every response (H100, Triton
    2.51's backend: numpy's capsule destructor, most likely, finding the capsule renamed by the backend in a
    way it does not expect), with torch's none (docs/triton.md); the responses were right either way."""
    if _NUMPY2 and arr.size and arr.dtype != object:
        torch = _torch()
        if torch is not None:
            try:
                return pb_utils.Tensor.from_dlpack(name, torch.from_numpy(arr))
            except TypeError:  # a dtype torch cannot view
                pass
        return pb_utils.Tensor.from_dlpack(name, arr)
    return pb_utils.Tensor(name, arr)


def _import_torch_in_background():
    """A GPU instance needs torch (the launcher's engines; DLPack for tensors in GPU memory), and its import is the
    longest part of the instance's start (1.6-2 s on an H100 host): it starts first, in a thread, and runs while
    parastream is imported and the bundle checked; the ``import torch`` after waits for it rather than starting
    again (Python's per-module import lock).  A failure is left to that import to report."""
    import sys
    import threading

    def run():
        try:
            _torch()
        except Exception:  # noqa: BLE001
            pass

    if "torch" not in sys.modules:
        threading.Thread(target=run, name="parastream-model-import-torch", daemon=True).start()


def _gpu_bundle_beside() -> bool:
    """Whether the bundle in this version folder (export-triton's folder name) was built for the GPU."""
    try:
        manifest = json.loads((Path(__file__).resolve().parent / "bundle" / "manifest.json").read_text())
        return str(manifest.get("device", "")).startswith("cuda")
    except (OSError, ValueError, AttributeError):  # another folder (initialize reads the config), or none
        return False


# a GPU bundle needs torch in any instance: its import starts as the stub imports this file, before initialize
if _gpu_bundle_beside():
    _import_torch_in_background()


def _process_age():
    """Seconds since this process (the backend's stub) started, from /proc (None elsewhere): the stub's own start
    and its import of this file come before initialize, and the log line says how long the whole took."""
    try:
        import os

        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # starttime, field 22
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _process_cpu():
    """CPU seconds this process has used so far, all its threads (user and system), or None: beside the start's wall
    time, whether a slow start ran more code or waited (for the CPU, the interpreter lock, the GPU)."""
    try:
        import os

        t = os.times()
        return t.user + t.system
    except (OSError, AttributeError):
        return None


def _fits(shape, wire) -> bool:
    """A request's dims against the config's: equal, -1 taking any size (a grid bundle's dynamic axes)."""
    return len(shape) == len(wire) and all(w == -1 or s == w for s, w in zip(shape, wire))


def _shapes(feeds) -> tuple:
    """The shapes of a request's inputs past the batch dimension (requests stack only when these agree)."""
    return tuple((k, tuple(int(d) for d in v.shape[1:])) for k, v in sorted(feeds.items()))


def _load_phases(runner) -> dict:
    """A GPU launcher's engine loads by phase (``parastream.launcher.gpu.load_phases``: unpack, weights, artifact,
    prepare, warm, summed over the engines that record them, and the launcher's totals), or {} where its engines
    record none, with where the engines' cuDNN plans came from (``cudnn_plans.plan_sources``): what an instance's
    start spent where, beside the same bundle's load in a plain process (bench/load_breakdown.py).  It showed
    NASNet-A Large's starts building the 23 plans their engines shipped (4-6 s of an 8-10 s initialize, H200),
    which a plain process loaded: the stub ran another cuDNN (``_refused_line`` says so; docs/triton.md)."""
    try:
        from parastream.launcher.gpu import load_phases

        got = load_phases(runner)
        if not set(got) - {"engines", "warm_wall", "ready"}:
            return {}
        plans = _cudnn_plans()
        if plans is not None:  # where the engines' cuDNN plans came from: shipped, or built at this start
            got.update(plans.plan_sources())
        return got
    except Exception:  # noqa: BLE001 - a figure for the log only: never the instance's failure
        return {}


def _cudnn_plans():
    """``parastream.launcher.engines.cudnn_plans`` where a torch engine's load imported it, else None (nothing
    planned: not imported here for a figure)."""
    import sys

    return sys.modules.get("parastream.launcher.engines.cudnn_plans")


def _plans_refused() -> dict:
    """{reason: count} of the cuDNN plans the engines shipped that this process did not use as shipped
    (``cudnn_plans.plans_refused``), or {}."""
    try:
        plans = _cudnn_plans()
        return plans.plans_refused() if plans is not None else {}
    except Exception:  # noqa: BLE001 - a figure for the log only: never the instance's failure
        return {}


def _cudnn_mismatch() -> str | None:
    """torch's own complaint, in one line, where the cuDNN this process loaded is not the one torch was built
    against (a library path that put the system's cuDNN first), or None."""
    try:
        import torch

        torch.backends.cudnn.version()  # (raises RuntimeError naming both versions when they do not fit)
        return None
    except RuntimeError as e:
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    except Exception:  # noqa: BLE001 - a figure for the log only: never the instance's failure
        return None


def _refused_line(instance: str, refused: dict) -> str | None:
    """The log line naming the shipped cuDNN plans this start built again and why, or None where there were none."""
    if not refused:
        return None
    return f"parastream: {instance} cuDNN plans not used as shipped: " + "; ".join(f"{n}x {why}" for why, n in refused.items())


class TritonPythonModel:
    def initialize(self, args):
        t0 = time.perf_counter()
        kind_gpu = args.get("model_instance_kind", "CPU") == "GPU"
        if kind_gpu:
            _import_torch_in_background()
        from parastream.launcher import load
        from parastream.launcher.bundle import Bundle, inside

        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        # Triton places each KIND_GPU instance on one GPU (instance_group gpus, else every GPU) and names it here;
        # the instance's launcher makes its memory, streams, engines and graph there
        device = self.device = int(args.get("model_instance_device_id", 0) or 0)
        # the bundle lies inside the version folder, and each of its files inside it (hashes checked); a GPU
        # instance's open also starts torch's import and the device's CUDA context, in threads, beside the hashes
        bundle = Bundle.open(inside(Path(__file__).resolve().parent, params.get("parastream_bundle", "bundle"),
                                    "config.pbtxt's parastream_bundle"), loading=True, device=device if kind_gpu else None)
        t_open = time.perf_counter()
        from parastream.launcher.engines import get_backend

        plan = bundle.plan
        self.max_batch = int(config.get("max_batch_size", 0))
        # dims as Triton declares them (no batch dim when batching; [1] for a 0-d tensor)
        self.wire = {io["name"]: [int(d) for d in io["dims"]] for io in config.get("input", []) + config.get("output", [])}
        self.on_gpu = kind_gpu and bool(get_backend(plan.backend).gpu)
        t_torch = None
        if self.on_gpu:
            torch = _torch()  # (imported since the open began, beside the hashes: Bundle.open(loading=True))
            t_torch = time.perf_counter()
            if torch is not None:
                torch.cuda.set_device(device)  # torch's own work in execute (stacking, output copies) there too
            self.runner = load(bundle, device=f"cuda:{device}")
        else:
            self.runner = load(bundle, device="cpu")
        self.plan = self.runner.plan
        self.batch = self.plan.inputs[0].shape[0] if self.max_batch > 0 else 0
        self.bucketed = bool(bundle.manifest.get("buckets"))  # then a group is run with its own rows, unpadded
        # a grid over named axes (dims -1 in the config): requests of any shape in range, the launcher picks the
        # bucket; requests are grouped only with requests of the same shape (their rows stack)
        self.grid = "axes" in (bundle.manifest.get("buckets") or {})
        # how long this instance took to be ready, in the server's log: initialize (the stub's own start and its
        # import of this file come before, and for a GPU bundle torch's import begins there), and the stub's age
        self.initialize_s = time.perf_counter() - t0
        started = _process_age()
        cpu = _process_cpu()
        logger = getattr(pb_utils, "Logger", None)
        if logger is not None:
            instance = args.get("model_instance_name") or args.get("model_name", "")
            logger.log_info(f"parastream: {instance} ready in "
                            f"{self.initialize_s:.2f} s (imports and bundle opened {t_open - t0:.2f} s, "
                            + (f"torch imported at {t_torch - t0:.2f} s, " if t_torch is not None else "")
                            + f"{len(self.plan.branches)} branches loaded and captured {time.perf_counter() - t_open:.2f} s"
                            + (f", the process's CPU {cpu:.2f} s" if cpu is not None else "")
                            + (f"; {started:.2f} s since the stub process started" if started is not None else "") + ")")
            phases = _load_phases(self.runner) if self.on_gpu else {}
            if phases:
                logger.log_info(f"parastream: {instance} load phases (s, summed over engines): "
                                + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
            mismatch = _cudnn_mismatch() if self.on_gpu else None
            if mismatch:  # a library path that put another cuDNN before torch's own (docs/triton.md)
                getattr(logger, "log_warn", logger.log_info)(f"parastream: {instance}: {mismatch}")
            refused = _refused_line(instance, _plans_refused() if self.on_gpu else {})
            if refused:  # shipped cuDNN plans this start built again, and why: a start slower than the bundle's own
                logger.log_info(refused)

    # -- requests ---------------------------------------------------------------------------------
    def _read_input(self, tensor):
        if tensor.is_cpu():
            return _host_array(tensor)
        torch = _torch()
        if torch is None:
            raise RuntimeError(f"input {tensor.name()!r} arrived in GPU memory; reading it without a host copy "
                               "needs torch in the server's Python environment (pip install torch)")
        with torch.cuda.device(int(tensor.__dlpack_device__()[1])):  # read on the GPU that holds it (the DLPack
            x = torch.from_dlpack(tensor)                             # stream handshake is on that GPU's stream)
        if not self.on_gpu:
            return x.cpu().numpy()
        # an input in another GPU's memory (an upstream model's output there) is copied here once, before the
        # replay: the launcher takes device inputs on its own GPU only
        return x if x.device.index == self.device else x.to(f"cuda:{self.device}")

    def _read(self, request):
        """The request's inputs in the bundle's shapes, and its batch size (0 when not batching)."""
        feeds, n = {}, None
        for spec in self.plan.inputs:
            tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
            if tensor is None:
                raise ValueError(f"missing input {spec.name!r}; the model takes {[t.name for t in self.plan.inputs]}")
            x = self._read_input(tensor)
            shape = [int(d) for d in x.shape]
            wire = self.wire[spec.name]
            if self.max_batch:
                if (len(shape) != len(wire) + 1 or not _fits(shape[1:], wire)
                        or not 1 <= shape[0] <= self.batch):
                    raise ValueError(f"input {spec.name!r} has shape {shape}; the model takes [1..{self.max_batch}] + {wire}")
                if n is not None and shape[0] != n:
                    raise ValueError(f"input {spec.name!r} has batch {shape[0]} but another input has batch {n}")
                n = shape[0]
                if not self.grid:
                    x = x.reshape([n] + list(spec.shape[1:]))
            else:
                if not _fits(shape, wire):
                    raise ValueError(f"input {spec.name!r} has shape {shape}; the model takes {wire}")
                if not self.grid:
                    x = x.reshape(list(spec.shape))
            feeds[spec.name] = x
        return feeds, n or 0

    def _groups(self, ready):
        """Requests run together: one at a time without batching, else as many as fit the bundle's batch."""
        if not self.max_batch:
            return [[r] for r in ready]
        groups, current, total = [], [], 0
        for r in ready:
            if current and (total + r[2] > self.batch or (self.grid and _shapes(r[1]) != _shapes(current[0][1]))):
                groups.append(current)
                current, total = [], 0
            current.append(r)
            total += r[2]
        if current:
            groups.append(current)
        return groups

    def _stack(self, parts, spec):
        """The group's inputs as one batch of the bundle's size, the rows past the requests zero (a bucketed
        bundle: of the requests' rows only)."""
        rows = sum(int(p.shape[0]) for p in parts) if self.bucketed else self.batch
        if len(parts) == 1 and parts[0].shape[0] == rows:
            return parts[0]
        shape = [rows] + list(parts[0].shape[1:] if self.grid else spec.shape[1:])
        device = next((p.device for p in parts if not isinstance(p, np.ndarray)), None)
        if device is None:
            out = np.zeros(shape, dtype=parts[0].dtype)
        else:
            torch = _torch()
            parts = [torch.from_numpy(p).to(device) if isinstance(p, np.ndarray) else p for p in parts]
            out = torch.zeros(shape, dtype=parts[0].dtype, device=device)
        lo = 0
        for p in parts:
            out[lo:lo + p.shape[0]] = p
            lo += p.shape[0]
        return out

    def _output(self, spec, value, lo, hi):
        wire = ([hi - lo] if self.max_batch else []) + self.wire[spec.name]
        if self.grid:  # dims -1 in the config: the launcher's outputs are already cut to the requests' shapes
            wire = ([hi - lo] if self.max_batch else []) + list(value.shape[1 if self.max_batch else 0:]) if value.shape else wire
        elif not self.max_batch and any(d < 0 for d in wire):  # a data-dependent tail's output (dims -1 in the
            wire = list(value.shape) or [1]                      # config): the shape this run gave it
        if hasattr(value, "__cuda_array_interface__"):
            torch = _torch()
            t = value.torch() if hasattr(value, "torch") else torch.as_tensor(value, device=f"cuda:{self.device}")
            if self.max_batch:
                t = t[lo:hi]
            return pb_utils.Tensor.from_dlpack(spec.name, t.reshape(wire).clone()), True
        arr = np.asarray(value)
        if self.max_batch:
            arr = arr[lo:hi]
        return _host_tensor(spec.name, np.ascontiguousarray(arr.reshape(wire))), False

    def _run(self, group):
        """Run one group of requests; the output tensors of each request, in the group's order."""
        if self.max_batch:
            feeds = {spec.name: self._stack([f[spec.name] for _, f, _ in group], spec) for spec in self.plan.inputs}
        else:
            feeds = group[0][1]
        outs = self.runner(feeds)
        results, lo, on_device = [], 0, False
        for _, _, n in group:
            tensors = []
            for spec in self.plan.outputs:
                tensor, device = self._output(spec, outs[spec.name], lo, lo + n)
                tensors.append(tensor)
                on_device = on_device or device
            results.append(tensors)
            lo += n
        if on_device:
            # the copies above are queued on torch's stream; Triton reads the outputs once execute returns
            _torch().cuda.current_stream(self.device).synchronize()
        return results

    @staticmethod
    def _error(e):
        return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(f"parastream: {e}"))

    def execute(self, requests):
        responses = [None] * len(requests)
        ready = []
        for i, request in enumerate(requests):
            try:
                feeds, n = self._read(request)
            except Exception as e:  # noqa: BLE001 - the client gets the reason
                responses[i] = self._error(e)
            else:
                ready.append((i, feeds, n))
        for group in self._groups(ready):
            try:
                results = self._run(group)
            except Exception as e:  # noqa: BLE001
                for i, _, _ in group:
                    responses[i] = self._error(e)
                continue
            for (i, _, _), tensors in zip(group, results):
                responses[i] = pb_utils.InferenceResponse(output_tensors=tensors)
        return responses

    def finalize(self):
        close = getattr(getattr(self, "runner", None), "close", None)
        if close is not None:
            close()
        self.runner = None
