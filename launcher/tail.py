"""A bundle's data-dependent tail run on the host after each replay (the build's pipeline/host_tail.py).

A detection model's post-processing (``NonZero`` over scores above a threshold, ``TopK``, ``NonMaxSuppression``)
gives its outputs shapes that depend on the data, which no static plan can hold.  Such a bundle's plan computes
the model's static part, whose outputs include the tensors the tail reads (its *boundary*); ``tail.onnx``, the
original's own nodes from there on, runs in an ONNX Runtime session on the CPU on those tensors.  The runner
answers the model's outputs in the model's order, the tail's with the shapes this run gave them.
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
            or not all(isinstance(rec.get(k), list) and all(isinstance(x, str) for x in rec[k]) for k in lists)):
        raise ParastreamError(f"{where} is malformed (file, boundary, feeds, outputs, order); rebuild the bundle")
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
    replays, then the tail's session runs on the boundary tensors it gave."""

    def __init__(self, inner, bundle: Bundle, rec: dict):
        import onnx
        import onnxruntime as ort

        from .engines.onnxruntime import session_options

        self.inner, self.record = inner, rec
        self.tail_s: float | None = None
        path = inside(bundle.path, rec["file"], f"manifest.json's {MANIFEST_KEY}")
        if rec["file"] not in bundle.manifest.get("files", {}):
            raise ParastreamError(f"{bundle.path}: the tail {rec['file']!r} is not listed in manifest.json; rebuild the bundle")
        data = path.read_bytes()
        try:
            model = onnx.load_from_string(data)
            # no spinning threads: they went on spinning after each call, taking the cores from the next replay's
            # sessions (FCOS on the 2-core CPU: 158 ms a call against 136 without, plain onnxruntime 133)
            self._sess = ort.InferenceSession(data, session_options(0, spin=False), providers=["CPUExecutionProvider"])
        except Exception as e:  # noqa: BLE001 - onnx and onnxruntime raise their own types
            raise ParastreamError(f"{path}: the bundle's tail does not load in ONNX Runtime: {e}") from None
        declared = {vi.name: vi for vi in model.graph.output}
        took = {i.name for i in self._sess.get_inputs()}
        if took - set(rec["boundary"]) - set(rec["feeds"]) or set(rec["outputs"]) - set(declared):
            raise ParastreamError(f"{path}: the tail's inputs and outputs are not the ones manifest.json records; "
                                  "rebuild the bundle")
        self._takes = [n for n in [*rec["boundary"], *rec["feeds"]] if n in took]
        plan = inner.plan
        self.plan = ServedPlan(backend=plan.backend, precision=plan.precision, num_streams=plan.num_streams,
                               inputs=list(plan.inputs), branches=plan.branches,
                               outputs=_served(rec, plan.outputs, declared))

    def __call__(self, feeds: dict) -> dict[str, np.ndarray]:
        got = self.inner(feeds)
        t0 = time.perf_counter()
        values = {n: _host(got[n] if n in got else feeds[n]) for n in self._takes}
        tail = dict(zip(self.record["outputs"], self._sess.run(self.record["outputs"], values)))
        self.tail_s = time.perf_counter() - t0  # the last call's tail, on the host (report.json's ``tail_ms``)
        return {n: tail[n] if n in tail else got[n] for n in self.record["order"]}

    def __getattr__(self, name):  # the static part's runner answers the rest (its engines, its load phases)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()


def _host(x) -> np.ndarray:
    """A value on the host, as ONNX Runtime's CPU session takes it (a torch tensor, on any device, copied)."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "detach"):  # a torch tensor (a caller's feed, kept on its device)
        return x.detach().cpu().numpy()
    return np.asarray(x)
