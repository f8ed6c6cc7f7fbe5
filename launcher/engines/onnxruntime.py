"""ONNX Runtime engines: the CPU path and the numerical reference.

An engine is the branch's ONNX model itself (serialised ModelProto); loading it
creates one InferenceSession.  Sessions release the GIL while they run, so the
CPU launcher's one-thread-per-stream schedule really runs branches side by side.
A written bundle's engine leaves the weights its model.onnx holds to it (``slim_engine``).
"""

from __future__ import annotations

import json
import math
from typing import Callable

import numpy as np
import onnx

from ..plan import TensorSpec
from .base import (BuilderBase, BuildOptions, background_summary, cancel_precompile, compiling, drop, hasten,  # noqa: F401
                   host_cpu, memory_scope, own_workspaces, precompile, prepare_load, refill_initializers,
                   same_kind, slim_initializers, start_workers, stop_workers)

name = "onnxruntime"
suffix = ".onnx"
gpu = False
# capabilities (base.Backend): CPU sessions of the branch's ONNX, built one at a time, nothing compiled ahead
compiles_for_layout = False
builds_side_by_side = False
background_compiles = False
fuses_conv_relu = False
lowers_convolutions = False
supports_internal_nhwc = False
supports_channel_views = False
warms_after_load = False
compiles_repeats_once = False
tunes_kernels_from = None


def describe_device() -> str:
    """The host's CPU and onnxruntime's version: what a CPU build's timings hold for."""
    import onnxruntime

    return f"{host_cpu()}, onnxruntime {onnxruntime.__version__}"


def available() -> str | None:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return "onnxruntime is not installed: pip install onnxruntime"
    return None


#: ONNX Runtime's log level for our sessions (3: errors); quiet_logs() raises it to 4 (fatal only)
LOG_SEVERITY = 3


def quiet_logs() -> None:
    """No ONNX Runtime log lines: errors reach the user as exceptions (the CLI does this unless --debug)."""
    global LOG_SEVERITY
    import onnxruntime as ort

    LOG_SEVERITY = 4
    ort.set_default_logger_severity(4)  # sessions others create (polygraphy's reference) log through the default


def session_options(threads: int = 0, spin: bool = True):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
    if not spin:
        # dozens of sessions each with spinning pool threads starve one another on a few cores
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = LOG_SEVERITY
    return so


class Builder(BuilderBase):
    """Checks that ONNX Runtime can run the branch, then keeps its ONNX as the engine."""

    def __init__(self, options: BuildOptions):
        if options.precision not in ("fp32", "tf32"):
            # ORT's CPU provider runs fp32 kernels; an fp16 model would need converting first.
            from ..errors import ParastreamError

            raise ParastreamError(f"--precision {options.precision}: the onnxruntime backend builds fp32 engines only")
        self.options = options
        self._report: dict[str, dict] = {}

    def build(self, branch: onnx.ModelProto, name: str, layout: dict | None = None) -> bytes:
        import onnxruntime as ort

        data = branch.SerializeToString()
        providers = ["CPUExecutionProvider"]
        if self.options.check:
            # Creating the session is the build: it fails here, naming the node, for ops ORT lacks.
            providers = ort.InferenceSession(data, session_options(1), providers=providers).get_providers()
        self._report[name] = {"providers": providers, "nodes": len(branch.graph.node)}
        return data

    def report(self) -> dict:
        return self._report

    def close(self) -> None:
        pass


#: the engine ONNX's metadata key that names, as a JSON list, the initializers whose data its bundle's model.onnx
#: holds (``slim_engine``)
WEIGHTS_IN_MODEL = "parastream.weights_in_model"


def slim_engine(data: bytes, held: Callable[[str], "onnx.TensorProto | None"]) -> bytes:
    """The engine as a written bundle ships it beside its model.onnx: its ONNX without the data of the
    initializers that model.onnx holds with the same values (``slim_initializers``), named in its metadata
    (``WEIGHTS_IN_MODEL``); ``load`` puts them back from the bundle's hash-checked model.onnx.  Whole, a
    one-session engine of the loaded model was a second copy of model.onnx (ViT-B/16: 340 MB written twice, and
    hashed twice at every open), and a plan's sessions together another."""
    model = onnx.load_from_string(data)
    if any(p.key == WEIGHTS_IN_MODEL for p in model.metadata_props):
        return data
    named = slim_initializers(model, held)
    if not named:
        return data
    model.metadata_props.add(key=WEIGHTS_IN_MODEL, value=json.dumps(named))
    return model.SerializeToString()


def branch_model(data: bytes, model_weights: Callable[[str], "onnx.TensorProto | None"] | None = None) -> onnx.ModelProto:
    """The engine's ONNX whole: the initializers a written bundle left to its model.onnx (``slim_engine``) filled in
    from ``model_weights`` (name -> the bundle's model.onnx initializer, ``Bundle.initializer``)."""
    model = onnx.load_from_string(data)
    named = _take_named(model)
    if named:
        refill_initializers(model, named, model_weights)
    return model


def _take_named(model: onnx.ModelProto) -> list[str]:
    """The weights a slim engine leaves to model.onnx (its ``WEIGHTS_IN_MODEL`` metadata, removed from ``model``)."""
    for i, p in enumerate(model.metadata_props):
        if p.key == WEIGHTS_IN_MODEL:
            try:
                named = json.loads(p.value)
            except ValueError:
                named = None
            if not (isinstance(named, list) and all(isinstance(n, str) for n in named)):
                from ..errors import ParastreamError

                raise ParastreamError(f"the engine's {WEIGHTS_IN_MODEL} is not a list of weight names; rebuild the bundle")
            del model.metadata_props[i]
            return named
    return []


#: weights of at least this many elements are handed to a session beside its ONNX (``_weights_beside``)
BESIDE_ELEMENTS = 4096
_FLOATING = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE)


def _weights_beside(data: bytes, model_weights: Callable[[str], "onnx.TensorProto | None"] | None) -> tuple[bytes, dict]:
    """A slim engine (``slim_engine``) as its session takes it: its ONNX, small, with each weight it leaves to
    model.onnx marked as external data, and those weights as arrays (name -> array) that the session is handed
    beside it (``SessionOptions.add_external_initializers``), never written into a copy of the ONNX: filled into
    the proto (``branch_model``) and serialised again, a 340 MB engine (ViT-B/16) took a fresh load from 2.8 to
    5.2 s.  The external location is never read: every tensor so marked is handed to the session.  Weights
    smaller than ``BESIDE_ELEMENTS``, or not floating-point, are filled into the ONNX instead: onnxruntime's shape
    inference reads the values of small constants (a Reshape's shape, a Resize's scales) while it loads the
    graph, and cannot read external ones."""
    from onnx import numpy_helper

    model = onnx.load_from_string(data)
    named = _take_named(model)
    if not named:
        return data, {}
    if model_weights is None:
        refill_initializers(model, named, None)  # raises: the engine's weights are in its bundle
    held = {t.name: t for t in model.graph.initializer}
    beside: dict[str, np.ndarray] = {}
    for name in named:
        t, src = held.get(name), model_weights(name)
        if t is None or not same_kind(src, t) or t.data_type not in _FLOATING or math.prod(t.dims) < BESIDE_ELEMENTS:
            refill_initializers(model, [name], model_weights)  # (raises, naming the weight, where it is not there)
            continue
        beside[name] = np.ascontiguousarray(numpy_helper.to_array(src))
        t.data_location = onnx.TensorProto.EXTERNAL
        del t.external_data[:]
        t.external_data.add(key="location", value="model.onnx")
    return model.SerializeToString(), beside


class OrtEngine:
    def __init__(self, data: bytes, inputs: list[TensorSpec], outputs: list[TensorSpec], threads: int = 0, spin: bool = True,
                 beside: dict[str, np.ndarray] | None = None):
        """``beside``: weights handed to the session beside its ONNX, which marks them external (``_weights_beside``).
        onnxruntime copies them into its graph before it optimizes it, and lets go of them once the session is made
        (``AddExternalInitializers``): they are not kept."""
        import onnxruntime as ort

        self.inputs = inputs
        self.outputs = outputs
        so = session_options(threads, spin)
        self.beside = list(beside or ())  # their names (what was handed beside, for a reader of the engine)
        if beside:
            so.add_external_initializers(list(beside), [ort.OrtValue.ortvalue_from_numpy(a) for a in beside.values()])
        self._sess = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
        del so, beside
        self._out_names = [t.name for t in outputs]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        vals = self._sess.run(self._out_names, {t.name: feeds[t.name] for t in self.inputs})
        return dict(zip(self._out_names, vals))


def load(data: bytes, inputs: list[TensorSpec], outputs: list[TensorSpec], device: str = "cpu",
         options: BuildOptions | None = None, internal_nhwc: set[str] | None = None,
         channel_views: dict[str, tuple[int, int]] | None = None, warm: bool = True,
         model_weights=None) -> OrtEngine:
    """A session of the branch (``device`` and the launcher's layout do not apply: a CPU engine in NCHW), its
    weights from ``model_weights`` where the engine leaves them to its bundle's model.onnx (``slim_engine``)."""
    beside = None
    if WEIGHTS_IN_MODEL.encode() in data:  # a slim engine (a whole one is not parsed here: ORT reads it as it is)
        data, beside = _weights_beside(data, model_weights)
    return OrtEngine(data, inputs, outputs, options.threads if options else 0, options.spin if options else True,
                     beside=beside)


def describe_error(e: BaseException, model: onnx.ModelProto) -> str:
    """ONNX Runtime's error in one line, prefixed by the node it concerns (found in the message, or by its op)."""
    import re

    msg = str(e)
    node = re.search(r"node with name '([^']*)'", msg) or re.search(r"Node \(([^)]*)\)", msg) \
        or re.search(r"node name: ([^\s,]+)", msg, re.IGNORECASE)
    where = f"node {node.group(1)!r}: " if node else ""
    if not node:
        # ORT names only the op ("com.example:FancyOp(-1) is not a registered function/op"): find the node
        for n in model.graph.node:
            op = f"{n.domain}:{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type
            if re.search(rf"(^|[\s:']){re.escape(op)}\(", msg) or f"{op} " in msg:
                where = f"node {n.name!r} ({op}): "
                break
    first = msg.strip().splitlines()[0] if msg.strip() else type(e).__name__
    return f"{where}{first}"


def check_model(model: onnx.ModelProto, serialized: bytes | None = None) -> None:
    """Fail early, naming the node, when ONNX Runtime cannot run an op or opset of the model (``serialized``: its
    bytes, when the caller has them)."""
    import onnxruntime as ort

    from ..errors import ParastreamError

    try:
        ort.InferenceSession(serialized if serialized is not None else model.SerializeToString(), session_options(1),
                             providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - ORT raises its own exception types
        d = describe_error(e, model)
        where, sep, first = d.partition(": ") if d.startswith("node ") else ("", "", d)
        raise ParastreamError(f"{where}{sep}onnxruntime cannot run this model: {first}") from None
