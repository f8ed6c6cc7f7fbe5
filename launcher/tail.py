"""A bundle's data-dependent tail run after each replay (the build's pipeline/host_tail.py).

A detection model's post-processing (``NonZero`` over scores above a threshold, ``TopK``, ``NonMaxSuppression``)
gives its outputs shapes that depend on the data, which no static plan can hold.  Such a bundle's plan computes
the model's static part, whose outputs include the tensors the tail reads (its *boundary*); ``tail.onnx``, the
original's own nodes from there on, runs on those tensors where manifest.json's record says (``runs_on``, which
the build decided by timing both, pipeline/host_tail.py ``place``):

- ``host``: in an ONNX Runtime session on the CPU, the boundary copied there;
- ``gpu``: node by node as torch ops on the GPU that replayed the plan, reading the boundary where the plan
  left it (launcher/engines/onnx_eager.py); where the static part runs on the CPU instead, or torch cannot run
  one of its nodes, the host's session.

The runner answers the model's outputs in the model's order, the tail's with the shapes this run gave them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from parastream.core.tensors import TensorSpec, value_info_spec

from .bundle import Bundle, inside
from .errors import ParastreamError

#: manifest.json's record of the tail, and the bundle file that holds it
MANIFEST_KEY = "host_tail"
TAIL_FILE = "tail.onnx"
#: where a tail can run (the record's ``runs_on``; absent: the host)
PLACES = ("host", "gpu")


@dataclass
class ServedPlan:
    """What a caller of a runner with a tail sees of its plan: the model's inputs and outputs (a tail output's
    unknown dimensions are -1), the static part's branches and backend."""

    backend: str
    precision: str
    num_streams: int
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    branches: list


def tail_record(bundle: Bundle) -> dict | None:
    """manifest.json's record of the bundle's tail, checked: the fields the runner reads, of the right types."""
    rec = bundle.manifest.get(MANIFEST_KEY)
    if rec is None:
        return None
    where = f"{bundle.path / 'manifest.json'}: {MANIFEST_KEY}"
    lists = ("boundary", "feeds", "outputs", "order")
    if (not isinstance(rec, dict) or not isinstance(rec.get("file"), str)
            or not all(isinstance(rec.get(k), list) and all(isinstance(x, str) for x in rec[k]) for k in lists)
            or rec.get("runs_on", "host") not in PLACES):
        raise ParastreamError(f"{where} is malformed (file, boundary, feeds, outputs, order, runs_on); rebuild the bundle")
    produced = {t.name for t in bundle.plan.outputs}
    inputs = {t.name for t in bundle.plan.inputs}
    missing = [t for t in rec["boundary"] if t not in produced] + [t for t in rec["feeds"] if t not in inputs]
    if missing:
        raise ParastreamError(f"{where} reads {missing[0]!r}, which the bundle's plan does not give it; rebuild the bundle")
    gone = [t for t in rec["order"] if t not in produced and t not in rec["outputs"]]
    if gone:
        raise ParastreamError(f"{where} lists output {gone[0]!r}, which neither the plan nor the tail computes; "
                              "rebuild the bundle")
    return rec


def served_outputs(bundle: Bundle) -> list[TensorSpec]:
    """The outputs a runner of ``bundle`` answers, in the model's order: its plan's, or with a tail the model's
    (a tail output's dimensions unknown before a run are -1)."""
    rec = tail_record(bundle)
    if rec is None:
        return list(bundle.plan.outputs)
    import onnx

    path = inside(bundle.path, rec["file"], f"manifest.json's {MANIFEST_KEY}")
    try:
        declared = {vi.name: vi for vi in onnx.load(str(path), load_external_data=False).graph.output}
    except Exception as e:  # noqa: BLE001 - onnx raises its own types for a file that is not a model
        raise ParastreamError(f"{path}: the bundle's tail is not an ONNX model ({e}); rebuild the bundle") from None
    missing = [n for n in rec["outputs"] if n not in declared]
    if missing:
        raise ParastreamError(f"{path}: the tail does not compute {missing[0]!r}, which manifest.json says it does; "
                              "rebuild the bundle")
    return _served(rec, bundle.plan.outputs, declared)


def _served(rec: dict, static: list[TensorSpec], declared: dict) -> list[TensorSpec]:
    """The model's outputs in its order: the plan's specs, and the tail's as its ONNX declares them."""
    plan = {t.name: t for t in static}
    try:
        return [plan[n] if n in plan else value_info_spec(declared[n], unknown=-1) for n in rec["order"]]
    except ValueError as e:  # an output of unknown rank: nothing a client could be told to expect
        raise ParastreamError(f"the bundle's tail output {e}; rebuild the bundle") from None


class TailRunner:
    """``runner(feeds) -> outputs`` of a bundle with a tail: ``inner`` (the static part's runner, GPU or CPU)
    replays, then the tail runs on the boundary tensors it gave: where the record says (``runs_on``), or
    ``on``.  ``on_gpu``: whether it runs on the GPU (else the host); ``why_host``: why not, where it was asked to.

    On the GPU, numpy feeds give numpy outputs and device feeds (torch, DLPack) give device outputs, as the GPU
    launcher's do: the static part's as its views, the tail's as torch tensors.  A call whose GPU tail raises
    (an input no build saw, where an op's torch form and ONNX's part) is answered by the host's session on the
    same boundary tensors, and counted (``fallbacks``)."""

    def __init__(self, inner, bundle: Bundle, rec: dict, *, on: str | None = None):
        import onnx

        self.inner, self.record = inner, rec
        self.tail_s: float | None = None
        self.fallbacks = 0
        self._path = path = inside(bundle.path, rec["file"], f"manifest.json's {MANIFEST_KEY}")
        if rec["file"] not in bundle.manifest.get("files", {}):
            raise ParastreamError(f"{bundle.path}: the tail {rec['file']!r} is not listed in manifest.json; rebuild the bundle")
        self._data = path.read_bytes()
        try:
            model = onnx.load_from_string(self._data)
        except Exception as e:  # noqa: BLE001 - onnx raises its own types
            raise ParastreamError(f"{path}: the bundle's tail is not an ONNX model ({e}); rebuild the bundle") from None
        declared = {vi.name: vi for vi in model.graph.output}
        took = {i.name for i in model.graph.input} - {t.name for t in model.graph.initializer}
        if took - set(rec["boundary"]) - set(rec["feeds"]) or set(rec["outputs"]) - set(declared):
            raise ParastreamError(f"{path}: the tail's inputs and outputs are not the ones manifest.json records; "
                                  "rebuild the bundle")
        self._takes = [n for n in [*rec["boundary"], *rec["feeds"]] if n in took]
        self._sess = self._graph = None
        self.why_host = None
        if (on or rec.get("runs_on", "host")) == "gpu":
            self._graph, self.why_host = _gpu_graph(model, inner)
        if self._graph is None:
            self._session()
        plan = inner.plan
        self.plan = ServedPlan(backend=plan.backend, precision=plan.precision, num_streams=plan.num_streams,
                               inputs=list(plan.inputs), branches=plan.branches,
                               outputs=_served(rec, plan.outputs, declared))

    @property
    def on_gpu(self) -> bool:
        return self._graph is not None

    def _session(self):
        """The host's ONNX Runtime session of the tail (made once, at load where the tail runs on the host)."""
        if self._sess is None:
            import onnxruntime as ort

            from .engines.onnxruntime import session_options

            try:
                # no spinning threads: they went on spinning after each call, taking the cores from the next
                # replay's sessions (FCOS on the 2-core CPU: 158 ms a call against 136 without, plain ORT 133)
                self._sess = ort.InferenceSession(self._data, session_options(0, spin=False),
                                                  providers=["CPUExecutionProvider"])
            except Exception as e:  # noqa: BLE001 - onnxruntime raises its own types
                raise ParastreamError(f"{self._path}: the bundle's tail does not load in ONNX Runtime: {e}") from None
        return self._sess

    def __call__(self, feeds: dict) -> dict:
        if self._graph is not None:
            return self._call_gpu(feeds)
        got = self.inner(feeds)
        t0 = time.perf_counter()
        values = {n: _host(got[n] if n in got else feeds[n]) for n in self._takes}
        tail = dict(zip(self.record["outputs"], self._session().run(self.record["outputs"], values)))
        self.tail_s = time.perf_counter() - t0  # the last call's tail (report.json's ``tail_ms``)
        return {n: tail[n] if n in tail else got[n] for n in self.record["order"]}

    def _call_gpu(self, feeds: dict) -> dict:
        import torch

        dev = torch.device("cuda", self.inner.arena_device)
        specs = {t.name: t for t in self.inner.plan.inputs}
        on_device = any(_on_device(v) for v in feeds.values())
        # numpy feeds go to the GPU here, so that the plan's outputs stay there for the tail to read
        given = {n: v if _on_device(v) or n not in specs else
                 torch.from_numpy(np.ascontiguousarray(np.asarray(v), dtype=np.dtype(specs[n].dtype))).to(dev)
                 for n, v in feeds.items()}
        got = self.inner(given)
        t0 = time.perf_counter()
        boundary = {n: got[n].torch() if n in got else torch.as_tensor(given[n], device=dev) for n in self._takes}
        try:
            with torch.cuda.device(dev):
                outs = self._graph.run(boundary)
        except Exception as e:  # noqa: BLE001 - any op's failure: the host's session answers this call
            self.fallbacks += 1
            if self.fallbacks == 1:
                import warnings

                warnings.warn(f"parastream: the bundle's tail failed on the GPU ({type(e).__name__}: {e}); "
                              "this call and any other that fails there run it on the host", stacklevel=2)
            values = {n: t.cpu().numpy() for n, t in boundary.items()}
            outs = [torch.from_numpy(a).to(dev) for a in self._session().run(self.record["outputs"], values)]
        tail = dict(zip(self.record["outputs"], outs))
        if on_device:
            result = {n: tail[n] if n in tail else got[n] for n in self.record["order"]}
        else:
            result = {n: (tail[n] if n in tail else got[n].torch()).cpu().numpy() for n in self.record["order"]}
        # the tail's last kernels done before the next replay overwrites the boundary it reads
        torch.cuda.current_stream(dev).synchronize()
        self.tail_s = time.perf_counter() - t0
        return result

    def __getattr__(self, name):  # the static part's runner answers the rest (its engines, its load phases)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()


def _gpu_graph(model, inner):
    """(the tail as torch ops on ``inner``'s GPU, None) or (None, why it stays on the host)."""
    if getattr(inner, "arena_device", None) is None:  # (the GPU launcher's: the GPU its buffers are on)
        return None, "the static part runs on the CPU"
    from .engines import onnx_eager

    try:
        return onnx_eager.load(model, device=f"cuda:{inner.arena_device}"), None
    except onnx_eager.UnsupportedOp as e:
        return None, str(e)
    except ImportError as e:  # a GPU launcher without torch (TensorRT's engines need none)
        return None, f"torch is not importable ({e})"


def _on_device(x) -> bool:
    """Whether ``x`` is a device array (torch on a GPU, a DeviceArray, anything with the CUDA interface)."""
    if isinstance(x, np.ndarray):
        return False
    device = getattr(x, "device", None)
    if getattr(device, "type", None) == "cpu":  # a torch tensor on the host
        return False
    return hasattr(x, "__cuda_array_interface__") or hasattr(x, "__dlpack__")


def _host(x) -> np.ndarray:
    """A value on the host, as ONNX Runtime's CPU session takes it (a torch tensor, on any device, copied)."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "detach"):  # a torch tensor (a caller's feed, kept on its device)
        return x.detach().cpu().numpy()
    return np.asarray(x)
