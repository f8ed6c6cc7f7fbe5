"""cuDNN execution plans for 2-d convolutions, built once and shipped with a bundle.

Why: torch sends a channels-last convolution to cuDNN, which builds an execution plan for each distinct shape at
its first call in every process, and keeps it in a cache of the calling thread only.  For a depthwise
convolution cuDNN's plan is a kernel it compiles at run time (NVRTC): 160-820 ms per shape (H100,
bench/depthwise_kernels.py), so that a fresh process's load of NASNet-A Large spent 3.8 of its 5.5 s building the
plans of its 23 depthwise shapes.  cuDNN's frontend serializes a built plan of a runtime-compiled engine, its
kernel included (``pygraph.serialize`` / ``deserialize``), which is what this module keeps: a process-wide cache of
plans by key (``PlanCache``), filled from the serialized plans loaded engines offer (``PlanCache.load``), from the
plans the other processes of a build shared (``shared_dir``), or by building a plan the first time a key is seen;
and ``conv2d``, the op that runs a convolution through it (``torch.ops.parastream.cudnn_conv2d``, which the
converter writes for the depthwise convolutions of a CUDA engine with ``BuildOptions.cudnn_plans``, on by default,
and, with ``BuildOptions.fuse_conv_relu``, for every convolution whose SiLU (conv + bias + SWISH_FWD) or residual
Add (conv + bias + add) it fuses, each one runtime-compiled kernel; Inductor calls it as an extern kernel).  A compile worker's run of the engine it compiled records the plans it used
(``recording``), and the kernels artifact ships them (``inductor_kernels.extract``).

The frontend is NVIDIA's ``nvidia-cudnn-frontend`` package (module ``cudnn``), which loads the libcudnn that torch
ships.  Without it, or on a CPU tensor, the op is torch's own convolution: the same result, its plans built by
torch as before.  A plan is built with cuDNN's heuristics (mode A, then the fallback list) and the first
candidate that builds, as torch builds its own (``torch.backends.cudnn.benchmark`` off).
"""

from __future__ import annotations

import io
import json
import threading
import time
from dataclasses import dataclass, field

#: uids of the plan's tensors in the variant pack
_X, _W, _Y, _B, _Z = 1, 2, 3, 4, 5

_LOCK = threading.RLock()


def frontend():
    """The cuDNN frontend module, or None when it is not installed or cannot load cuDNN."""
    if not _FRONTEND:
        try:
            import torch  # noqa: F401 - torch first: the frontend then finds the libcudnn torch loaded

            import cudnn

            cudnn.backend_version()
            _FRONTEND.append(cudnn)
        except Exception:  # noqa: BLE001 - not installed, or no cuDNN it can load: torch's own convolution
            _FRONTEND.append(None)
    return _FRONTEND[0]


_FRONTEND: list = []


def conv_out_shape(x_shape, w_shape, stride, padding, dilation) -> list[int]:
    n, _, h, w = (int(v) for v in x_shape)
    kh, kw = int(w_shape[2]), int(w_shape[3])
    ho = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    wo = (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    return [n, int(w_shape[0]), ho, wo]


def _channels_last_strides(shape) -> list[int]:
    n, c, h, w = shape
    return [h * w * c, 1, w * c, c]


#: activations a plan may apply in the convolution's kernel besides ReLU (``plan_key``'s ``act``): cuDNN's
#: pointwise SWISH_FWD, x * sigmoid(x), which exporters write as a Sigmoid and a Mul (EfficientNet's and MixNet's
#: SiLU); bench/conv_epilogues.py times it per convolution shape against Inductor's epilogue kernel
ACTIVATIONS = ("swish",)


def _check_activation(act: str | None, relu: bool) -> None:
    if act is not None and (act not in ACTIVATIONS or relu):
        raise ValueError(f"plan activation {act!r}: one of {ACTIVATIONS}, and not beside relu")


def plan_key(dtype: str, x_shape, w_shape, stride, padding, dilation, bias: bool = False, relu: bool = False,
             act: str | None = None, residual: bool = False) -> str:
    """The key of a plan: what its tensors' descriptors and the convolution hold (the tensors channels-last and
    contiguous, as the op makes them), and whether a bias is added, a residual of the output's shape added after it
    (``residual``) and a ReLU (or ``act``, one of ``ACTIVATIONS``) applied in the same kernel.  A key without
    ``act`` or ``residual`` is as it was before there were others (shipped plans keep their keys)."""
    _check_activation(act, relu)
    return json.dumps([dtype, [int(v) for v in x_shape], [int(v) for v in w_shape], [int(v) for v in stride],
                       [int(v) for v in padding], [int(v) for v in dilation], int(bias), int(relu),
                       *([act] if act else []), *(["residual"] if residual else [])], separators=(",", ":"))


def device_tag(device_index: int = 0) -> str:
    """What a serialized plan is valid for: the GPU's name and compute capability, and cuDNN's version (once per
    device and process)."""
    tag = _TAGS.get(device_index)
    if tag is None:
        import torch

        cudnn = frontend()
        p = torch.cuda.get_device_properties(device_index)
        tag = _TAGS[device_index] = f"{p.name}|sm{p.major}{p.minor}|cudnn{cudnn.backend_version() if cudnn else 0}"
    return tag


_TAGS: dict = {}


@dataclass
class _Plan:
    graph: object  # the frontend's pygraph, its plan built
    workspace: int
    built_s: float
    source: str  # "built", "loaded" (offered by an engine) or "shared" (``shared_dir``)
    data: object = None  # the serialized plan it was read from (serialized again as it was)
    #: whether it may be serialized: cuDNN serializes the plans of its runtime-compiled engines only (a plan of
    #: another engine is cheap to build, 1-2 ms, and the bytes serialize gives for one are not to be read back)
    serializable: bool = True

    def serialized(self):
        return self.data if self.data is not None else self.graph.serialize()


@dataclass
class PlanCache:
    """Plans by (device index, key): one per process (``CACHE``); a plan is built for a handle of its device and
    run with it, under the lock (a cuDNN handle is not to be used from two threads at once)."""

    plans: dict = field(default_factory=dict)
    handles: dict = field(default_factory=dict)
    failed: dict = field(default_factory=dict)  # keys cuDNN could not plan: torch's convolution runs them
    #: serialized plans offered by loaded engines (``load``), deserialized at their key's first call
    pending: dict = field(default_factory=dict)
    #: why plans were not used as shipped, by reason: offers refused (``load``: serialized for another GPU or
    #: cuDNN) and offered plans that could not be read back (built instead), for a load's log
    refused: dict = field(default_factory=dict)

    def handle(self, device_index: int):
        h = self.handles.get(device_index)
        if h is None:
            import torch

            with torch.cuda.device(device_index):
                h = self.handles[device_index] = frontend().create_handle()
        return h

    def get(self, device_index: int, key: str) -> _Plan | None:
        """The plan of ``key``: held, deserialized from what a loaded engine offered (~18 ms on the H200), or
        built (160-820 ms for a runtime-compiled depthwise kernel); None where cuDNN cannot plan it."""
        with _LOCK:
            return self._get(device_index, key)

    def _get(self, device_index: int, key: str) -> _Plan | None:
        got = self.plans.get((device_index, key))
        if got is not None or (device_index, key) in self.failed:
            return got
        offered = self.pending.pop((device_index, key), None)
        shared = _shared_path(device_index, key) if offered is None else None
        if offered is None and shared is not None and shared.is_file():
            import numpy as np

            offered = np.frombuffer(shared.read_bytes(), dtype=np.uint8)
        if offered is not None:
            try:
                got = self.plans[(device_index, key)] = _deserialize(self.handle(device_index), offered,
                                                                      "loaded" if shared is None else "shared")
                return got
            except Exception as e:  # noqa: BLE001 - a plan that cannot be read back is built instead
                self.refuse(f"not read back ({type(e).__name__}: {str(e)[:200]})")
        try:
            got = self.plans[(device_index, key)] = _build(self.handle(device_index), key, device_index)
        except Exception as e:  # noqa: BLE001 - torch's convolution runs this key (cuDNN plans it in its own way)
            self.failed[(device_index, key)] = f"{type(e).__name__}: {e}"
            return None
        if shared is not None and got.serializable:
            _share(shared, got)
        return got

    def refuse(self, why: str) -> str:
        """Note a shipped plan (or an engine's file of them) not used as shipped, and why (``plans_refused``)."""
        with _LOCK:
            self.refused[why] = self.refused.get(why, 0) + 1
        return why

    def serializable(self, keys, device_index: int) -> set:
        """Those of ``keys`` whose plans this process holds and may serialize (``_Plan.serializable``)."""
        with _LOCK:
            return {k for k in keys if getattr(self.plans.get((device_index, k)), "serializable", False)}

    def serialize(self, device_index: int, keys=None) -> bytes:
        """The serializable plans of ``keys`` (every one of the device when None) as one file's bytes (``load``)."""
        import numpy as np

        with _LOCK:
            chosen = {k: p for (d, k), p in self.plans.items() if d == device_index and p.serializable
                      and (keys is None or k in keys)}
            arrays = {"__tag__": np.frombuffer(device_tag(device_index).encode(), dtype=np.uint8)}
            for i, (k, p) in enumerate(sorted(chosen.items())):
                arrays[f"key{i}"] = np.frombuffer(k.encode(), dtype=np.uint8)
                arrays[f"plan{i}"] = np.asarray(p.serialized(), dtype=np.uint8)
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        return buf.getvalue()

    def load(self, data: bytes, device_index: int, now: bool = False) -> dict:
        """Offer the plans of ``data`` (``serialize``) for the device, those not held or offered already: each is
        deserialized at its key's first call (``get``), or here with ``now``.  {"plans", "offered", "s"}, or
        {"skipped": why} when they were serialized for another GPU or cuDNN.  Deserialized where they are first
        needed, not here, because a load offers them from the thread that loads engines while another thread
        warms and captures the engines loaded before (the frontend's deserialize loads the plan's kernel and runs
        it once in a capture of its own, which is not to run beside another), and engines often offer the same
        plans."""
        import numpy as np

        t0 = time.perf_counter()
        with np.load(io.BytesIO(data)) as z:
            tag = bytes(z["__tag__"]).decode()
            if tag != device_tag(device_index):
                return {"skipped": self.refuse(f"plans for {tag}, not {device_tag(device_index)}")}
            n = sum(1 for name in z.files if name.startswith("key"))
            offered = []
            with _LOCK:
                for i in range(n):
                    key = (device_index, bytes(z[f"key{i}"]).decode())
                    if key not in self.plans and key not in self.pending:
                        self.pending[key] = z[f"plan{i}"]
                        offered.append(key)
        if now:
            for device, key in offered:
                self.get(device, key)
        return {"plans": n, "offered": len(offered), "s": round(time.perf_counter() - t0, 4)}


CACHE = PlanCache()


def plan_sources() -> dict:
    """Where this process's plans came from, for a load's log (Triton's model.py) and the benchmarks: how many were
    deserialized from what engines shipped (``loaded``), read from a build's shared folder (``shared``) or built
    here (``built``, and the seconds that took), keys cuDNN could not plan (``failed``, torch's convolution runs
    them), plans offered but not yet used (``pending``), and whether the cuDNN frontend loaded at all
    (``frontend``: 1, 0, or absent where nothing asked for it yet; without it every planned convolution is torch's,
    whose cuDNN plans are built at each process's first calls)."""
    with _LOCK:
        plans = list(CACHE.plans.values())
        out = {f"plans_{k}": sum(p.source == k for p in plans) for k in ("loaded", "shared", "built")}
        out["plans_built_s"] = round(sum(p.built_s for p in plans if p.source == "built"), 3)
        # of those built, the runtime-compiled kernels (the costly ones, 160-820 ms each, that a bundle ships)
        out["plans_built_compiled"] = sum(p.source == "built" and p.serializable for p in plans)
        out["plans_failed"], out["plans_pending"] = len(CACHE.failed), len(CACHE.pending)
        if _FRONTEND:
            out["frontend"] = int(_FRONTEND[0] is not None)
        return out


def plans_refused() -> dict:
    """{reason: count} of the shipped plans this process did not use as shipped (``PlanCache.refused``): what a
    load's log says beside ``plan_sources`` when plans were built that engines had shipped."""
    with _LOCK:
        return dict(CACHE.refused)


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _deserialize(handle, data, source: str = "loaded") -> _Plan:
    t = time.perf_counter()
    # the frontend's deserialize runs the plan once in a graph capture of its own (``Graph::warmup``), on the
    # handle's stream, or on a stream it makes for the purpose where the handle has none: never on a stream a
    # launcher set and has since closed (``conv2d`` hands the handle back without one)
    frontend().set_stream(handle, 0)
    g = frontend().pygraph(handle=handle)
    g.deserialize(handle, data.tolist())  # (the binding takes the list of byte values serialize gives)
    return _Plan(g, int(g.get_workspace_size()), time.perf_counter() - t, source, data)


def shared_dir():
    """Where the processes of a build share the plans they build (each compile worker runs the engines it
    compiled, and every worker would build the same depthwise plans again: 150-750 ms each on the H200, inside the
    workers' turn on the GPU that the build's timings wait for): beside Inductor's cache, which those processes
    share, and only in a process that has imported Inductor (a build's, not a bundle's load, whose plans come with
    its engines).  Inductor's own choice of folder, written again rather than imported: its module imports its
    compiler."""
    import sys

    if "torch._inductor" not in sys.modules:
        return None
    import getpass
    import os
    import tempfile
    from pathlib import Path

    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not root:
        try:
            user = getpass.getuser()
        except Exception:  # noqa: BLE001 - no user name (a container's uid): Inductor's own fallback
            user = "unknown"
        root = os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")
    return Path(root) / "parastream-cudnn-plans"


def _shared_path(device_index: int, key: str):
    import hashlib

    folder = shared_dir()
    if folder is None:
        return None
    return folder / (hashlib.sha256(f"{device_tag(device_index)}|{key}".encode()).hexdigest()[:32] + ".plan")


def _share(path, plan: _Plan) -> None:
    """``plan`` written where the build's other processes find it (atomically: a reader sees all of it or none)."""
    from parastream.core.files import write_atomic

    try:
        write_atomic(path, bytes(plan.serialized()))
    except OSError:  # a folder it cannot write: each process builds its own, as before
        pass



def _build(handle, key: str, device_index: int) -> _Plan:
    """cuDNN's plan for ``key`` (``plan_key``), built with its heuristics: the first candidate that builds."""
    import torch

    cudnn = frontend()
    t0 = time.perf_counter()
    g = plan_graph(handle, key, device_index)
    with torch.cuda.device(device_index):
        g.build_plans(cudnn.build_plan_policy.HEURISTICS_CHOICE)
    try:
        runtime_compiled = cudnn.behavior_note.RUNTIME_COMPILATION in g.get_behavior_notes()
    except Exception:  # noqa: BLE001 - notes it cannot tell: not serialized (built again where it is needed)
        runtime_compiled = False
    return _Plan(g, int(g.get_workspace_size()), time.perf_counter() - t0, "built", serializable=runtime_compiled)


def plan_graph(handle, key: str, device_index: int):
    """The frontend's graph of ``key`` (``plan_key``), validated, its execution plans' candidates listed (cuDNN's
    heuristics, mode A, then the fallback list) and their support checked, none built yet: ``_build`` builds the
    heuristics' choice; bench/cudnn_plans.py ``--candidates`` builds and times each."""
    import torch

    cudnn = frontend()
    dtype, x_shape, w_shape, stride, padding, dilation, bias, relu, *extra = json.loads(key)
    io_type = {"float16": cudnn.data_type.HALF, "bfloat16": cudnn.data_type.BFLOAT16,
               "float32": cudnn.data_type.FLOAT}[dtype]
    cudnn.set_stream(handle, 0)  # (as ``_deserialize``: no stream a launcher may have closed)
    with torch.cuda.device(device_index):
        g = cudnn.pygraph(io_data_type=io_type, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)
        x = g.tensor(name="X", dim=x_shape, stride=_channels_last_strides(x_shape), data_type=io_type)
        w = g.tensor(name="W", dim=w_shape, stride=_channels_last_strides(w_shape), data_type=io_type)
        y = g.conv_fprop(image=x, weight=w, padding=padding, stride=stride, dilation=dilation,
                         compute_data_type=cudnn.data_type.FLOAT)
        if bias:  # (what torch.cudnn_convolution_relu runs: one kernel for the convolution and its epilogue)
            b = g.tensor(name="B", dim=[1, w_shape[0], 1, 1], stride=[w_shape[0], 1, w_shape[0], w_shape[0]],
                         data_type=io_type)
            b.set_uid(_B)
            y = g.bias(input=y, bias=b, compute_data_type=cudnn.data_type.FLOAT)
        out = conv_out_shape(x_shape, w_shape, stride, padding, dilation)
        if "residual" in extra:  # conv + bias + z, z of the output's shape (an inverted residual's projection)
            z = g.tensor(name="Z", dim=out, stride=_channels_last_strides(out), data_type=io_type)
            z.set_uid(_Z)
            y = g.add(a=y, b=z, compute_data_type=cudnn.data_type.FLOAT)
        if relu:
            y = g.relu(input=y, compute_data_type=cudnn.data_type.FLOAT)
        if "swish" in extra:
            y = g.swish(input=y, compute_data_type=cudnn.data_type.FLOAT)
        y.set_output(True).set_data_type(io_type).set_dim(out).set_stride(_channels_last_strides(out))
        x.set_uid(_X)
        w.set_uid(_W)
        y.set_uid(_Y)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
    return g


def conv2d(x, w, b, stride, padding, dilation, groups: int, relu: bool = False, act: str | None = None, z=None):
    """relu?(conv(x, w) + b? + z?) (or ``act`` of it, ``ACTIVATIONS``) for a 2-d convolution with symmetric padding
    (``z``: a residual of the output's shape),
    channels-last out: through a plan of ``CACHE`` on a GPU with the frontend (the key noted where ``recording``
    is on), else torch's own ops."""
    import torch

    if x.is_cuda and x.dim() == 4 and frontend() is not None:
        x = x.contiguous(memory_format=torch.channels_last)
        w = w.contiguous(memory_format=torch.channels_last)  # (a depthwise weight is both layouts at once)
        device = x.device.index if x.device.index is not None else torch.cuda.current_device()
        key = plan_key(_dtype_name(x.dtype), x.shape, w.shape, stride, padding, dilation, b is not None, relu, act,
                       z is not None)
        with _LOCK:
            plan = CACHE.get(device, key)
            if plan is not None:
                if _RECORDING:
                    _RECORDING[-1].add((device, key))
                out = conv_out_shape(x.shape, w.shape, stride, padding, dilation)
                y = torch.empty_strided(out, _channels_last_strides(out), dtype=x.dtype, device=x.device)
                ws = torch.empty(max(plan.workspace, 1), dtype=torch.uint8, device=x.device)
                h = CACHE.handle(device)
                frontend().set_stream(h, torch.cuda.current_stream(x.device).cuda_stream)
                pack = {_X: x, _W: w, _Y: y}
                if b is not None:
                    pack[_B] = b.to(x.dtype).contiguous()
                if z is not None:
                    pack[_Z] = z.to(x.dtype).contiguous(memory_format=torch.channels_last)
                try:
                    plan.graph.execute(pack, ws, handle=h)
                finally:  # the stream is the launcher's, which may close it: the handle keeps none
                    frontend().set_stream(h, 0)
                return y
    _check_activation(act, relu)
    y = torch.nn.functional.conv2d(x, w, b, stride, padding, dilation, groups)
    if z is not None:
        y = y + z
    if relu:
        y = torch.relu(y)
    elif act == "swish":
        y = torch.nn.functional.silu(y)
    return y.contiguous(memory_format=torch.channels_last)


_RECORDING: list = []


class recording:
    """``with recording() as keys:`` the (device, key) of every plan ``conv2d`` runs meanwhile, in any thread
    (a compile worker's run of the engine it compiled: the plans its artifact ships)."""

    def __enter__(self) -> set:
        keys: set = set()
        with _LOCK:
            _RECORDING.append(keys)
        return keys

    def __exit__(self, *exc) -> None:
        with _LOCK:
            _RECORDING.pop()


_OP: list = []


def register_op() -> None:
    """``torch.ops.parastream.cudnn_conv2d`` (``conv2d``), with the shape function Inductor's trace needs; once per
    process."""
    with _LOCK:
        if _OP:
            return
        from .base import define_op

        def fake(x, w, b, stride, padding, dilation, groups, relu, act=None, z=None):
            out = conv_out_shape(x.shape, w.shape, stride, padding, dilation)
            return x.new_empty_strided(out, _channels_last_strides(out))

        # (``act`` and ``z`` last, with defaults: code compiled before they existed calls the op as it did)
        _OP.append(define_op("cudnn_conv2d(Tensor x, Tensor w, Tensor? b, int[] stride, int[] padding, "
                             "int[] dilation, int groups, bool relu, str? act=None, Tensor? z=None) -> Tensor",
                             conv2d, fake))
