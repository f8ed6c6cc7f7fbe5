"""Hostile-input campaign: mutated example models through ``parastream build``, each case classified.

    python bench/fuzz.py --cases 5000 --seed 0 --workers 2 --out fuzz.jsonl     # the campaign
    python bench/fuzz.py --cases 300 --seed 1 --check                           # what CI runs (tests/fuzz)
    python bench/fuzz.py --kill-trials 20 --seed 0                              # kill -9 / SIGTERM / SIGHUP / SIGINT

Each case starts from one of examples/models/*.onnx (most often a window of 2..12 consecutive nodes of it,
cut with onnx.utils.Extractor so that successful builds stay quick), applies one seeded mutation class
(``CLASSES``) and runs ``parastream build MODEL -o out --backend onnxruntime`` with a timeout, in a folder of
its own.  Outcomes:

    clean-error   exit 1 or 2, stderr exactly one line "parastream build: error: ..." (or "...: argument ...")
    built-equal   exit 0, and the bundle run by launcher.load agrees with onnxruntime on the mutated model
    built-wrong   exit 0, and it does not (or the bundle does not load)
    noisy-error   exit 1 or 2 with more than one line on stderr (log lines before the error)
    traceback     an exception escaped main() (or "Traceback" on stderr)
    signal        the build died of a signal
    hang          it ran past the timeout (killed)
    leftover      anything beside OUT after the run (``.out.*.partial``), or OUT after a failed build

Speed: the harness is a fork server.  The parent imports parastream, onnx, onnxruntime and polygraphy once
(and never creates an onnxruntime session itself); each case is an ``os.fork()`` that calls the CLI's
``main(argv)`` in its own process group, so a case costs its build, not ~1 s of imports.  Kill trials need
real processes (a signal must land in a running CLI), so they run ``python -m parastream.pipeline.cli``
as subprocesses.
"""

from __future__ import annotations

import argparse
import collections
import json
from glob import escape as glob_escape
import os
import random
import re
import signal
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
MODELS = sorted((ROOT / "examples" / "models").glob("*.onnx"))
FAILURES = ("traceback", "signal", "hang", "leftover", "built-wrong", "noisy-error")
PROGRESS = re.compile(r"^parastream [\w-]+: \[\s*[\d.]+ s\] ")
EXPECTED = {"model.onnx", "stdout", "stderr", "check.json", "out"}


# -- cases ------------------------------------------------------------------------------------------
@dataclass
class Case:
    index: int
    cls: str
    seed_model: str
    model: onnx.ModelProto | None = None
    raw: bytes | None = None  # the model file's bytes, when a mutation works on bytes
    files: dict = field(default_factory=dict)  # extra files beside the model: name -> bytes | "fifo" | "dir" | ("link", target)
    special: str | None = None  # the model path itself: "fifo", "dir", "missing", "link-loop", "empty"
    args: list = field(default_factory=list)
    what: list = field(default_factory=list)  # the mutations applied, for the log


class Seeds:
    """The example models, shape-inferred once, and windows of consecutive nodes cut from them."""

    def __init__(self):
        self.models = {}
        for p in MODELS:
            m = onnx.shape_inference.infer_shapes(onnx.load(str(p)))
            self.models[p.stem] = (m, onnx.utils.Extractor(m))

    def pick(self, rng: random.Random) -> tuple[str, onnx.ModelProto]:
        name = rng.choice(sorted(self.models))
        m, extractor = self.models[name]
        if rng.random() < 0.1:
            out = onnx.ModelProto()
            out.CopyFrom(m)
            return name, out
        nodes = list(m.graph.node)
        inits = {t.name for t in m.graph.initializer}
        for _ in range(10):
            k = rng.randint(2, 12)
            start = rng.randrange(0, max(1, len(nodes) - k))
            window = nodes[start:start + k]
            produced = {o for n in window for o in n.output if o}
            ins = sorted({i for n in window for i in n.input if i and i not in produced and i not in inits})
            consumed_later = {i for n in nodes[start + k:] for i in n.input} | {o.name for o in m.graph.output}
            outs = [o for n in window for o in n.output if o and (o in consumed_later or rng.random() < 0.2)]
            if not outs:
                outs = [window[-1].output[0]]
            try:
                sub = extractor.extract_model(ins, outs)
                return f"{name}[{start}:{start + k}]", sub
            except Exception:  # noqa: BLE001 - a window Extractor cannot cut: try another
                continue
        out = onnx.ModelProto()
        out.CopyFrom(m)
        return name, out


def _tensor_names(m: onnx.ModelProto) -> list[str]:
    names = [i.name for i in m.graph.input] + [t.name for t in m.graph.initializer]
    names += [o for n in m.graph.node for o in n.output]
    return [n for n in names if n] or ["x"]


def _value_infos(m):
    return list(m.graph.input) + list(m.graph.output) + list(m.graph.value_info)


HOSTILE_NAMES = ["", "../../etc/passwd", "/abs/name", "a\nb", "x" * 5000, "out", "input", "\u202etxt.exe", "a b/c",
                 "con", ".", "..", "\x00", "名前", "out/a", "out_a", "branch_000"]
INT_VALUES = [0, -1, 1, 2, 3, -7, 2**31, 2**62, -2**63, 7, 1000]
OPS = ["Relu", "Conv", "Add", "Concat", "MatMul", "Reshape", "Transpose", "Softmax", "LayerNormalization", "Gemm",
       "BatchNormalization", "Identity", "Loop", "If", "Split", "Resize", "NonZero", "Unknown", "Where", "Gather"]


def m_bytes(rng, case):
    data = bytearray(case.model.SerializeToString())
    for _ in range(rng.randint(1, 20)):
        if data:
            data[rng.randrange(len(data))] = rng.randrange(256)
    case.raw, case.model = bytes(data), None
    case.what.append("flip bytes")


def m_truncate(rng, case):
    data = case.model.SerializeToString()
    cut = rng.randrange(0, len(data)) if rng.random() < 0.8 else len(data) - rng.randint(1, 16)
    case.raw, case.model = data[:max(cut, 0)], None
    case.what.append(f"truncate at {cut}/{len(data)}")


def m_node(rng, case):
    g = case.model.graph
    if not g.node:
        return
    i = rng.randrange(len(g.node))
    op = rng.choice(["delete", "duplicate", "swap", "op_type", "dup_name", "empty_name", "no_outputs", "extra_output",
                     "self_loop"])
    n = g.node[i]
    if op == "delete":
        del g.node[i]
    elif op == "duplicate":
        g.node.append(onnx.NodeProto())
        g.node[-1].CopyFrom(n)
    elif op == "swap" and len(g.node) > 1:
        j = rng.randrange(len(g.node))
        a, b = onnx.NodeProto(), onnx.NodeProto()
        a.CopyFrom(g.node[i])
        b.CopyFrom(g.node[j])
        g.node[i].CopyFrom(b)
        g.node[j].CopyFrom(a)
    elif op == "op_type":
        n.op_type = rng.choice(OPS)
    elif op == "dup_name":
        for other in g.node:
            other.name = n.name or "same"
    elif op == "empty_name":
        n.name = ""
    elif op == "no_outputs":
        del n.output[:]
    elif op == "extra_output":
        n.output.append(rng.choice(_tensor_names(case.model)))
    elif op == "self_loop" and n.output:
        n.input.append(n.output[0])
    case.what.append(f"node {op} #{i}")


def m_edge(rng, case):
    g = case.model.graph
    names = _tensor_names(case.model)
    for _ in range(rng.randint(1, 3)):
        if not g.node:
            return
        n = rng.choice(list(g.node))
        if not n.input:
            continue
        k = rng.randrange(len(n.input))
        choice = rng.choice(["other", "missing", "empty", "output"])
        new = {"other": rng.choice(names), "missing": "ghost", "empty": "",
               "output": g.output[0].name if g.output else "ghost"}[choice]
        n.input[k] = new
        case.what.append(f"edge {n.name}.input[{k}] -> {choice}")
    if rng.random() < 0.3 and g.output:
        # a graph output that is an input, an initializer or missing
        g.output[0].name = rng.choice([g.input[0].name if g.input else "x",
                                       g.initializer[0].name if g.initializer else "w", "nowhere"])
        case.what.append("graph output renamed")


def m_attribute(rng, case):
    g = case.model.graph
    nodes = [n for n in g.node if n.attribute] or list(g.node)
    if not nodes:
        return
    for _ in range(rng.randint(1, 3)):
        n = rng.choice(nodes)
        choice = rng.choice(["int", "ints", "drop", "add", "retype", "perm", "group", "axis", "pads"])
        if choice in ("group", "axis", "pads", "perm"):
            name = {"group": "group", "axis": "axis", "pads": "pads", "perm": "perm"}[choice]
            for a in list(n.attribute):
                if a.name == name:
                    n.attribute.remove(a)
            if choice == "pads":
                n.attribute.append(helper.make_attribute("pads", [rng.choice(INT_VALUES) for _ in range(4)]))
            elif choice == "perm":
                n.attribute.append(helper.make_attribute("perm", rng.sample(range(4), rng.randint(1, 4))))
            else:
                n.attribute.append(helper.make_attribute(name, rng.choice(INT_VALUES)))
        elif n.attribute:
            a = rng.choice(list(n.attribute))
            if choice == "int" and a.type == onnx.AttributeProto.INT:
                a.i = rng.choice(INT_VALUES)
            elif choice == "ints" and a.type == onnx.AttributeProto.INTS:
                vals = [rng.choice(INT_VALUES) for _ in range(rng.randint(0, 5))]
                del a.ints[:]
                a.ints.extend(vals)
            elif choice == "drop":
                n.attribute.remove(a)
            elif choice == "retype":
                a.type = rng.choice([onnx.AttributeProto.FLOAT, onnx.AttributeProto.STRING, onnx.AttributeProto.INTS, onnx.AttributeProto.UNDEFINED])
            else:
                n.attribute.append(helper.make_attribute(rng.choice(["bogus", a.name]), rng.choice([1, 2.5, "s", [1, 2]])))
        case.what.append(f"attribute {choice} on {n.op_type}")


def m_initializer(rng, case):
    g = case.model.graph
    choice = rng.choice(["dims", "data", "dtype", "nan", "shadow_input", "output_init", "remove", "huge_dims"])
    if not g.initializer and choice not in ("shadow_input",):
        choice = "shadow_input"
    if choice == "shadow_input" and g.input:
        v = g.input[0]
        shape = [d.dim_value or 1 for d in v.type.tensor_type.shape.dim]
        if int(np.prod(shape)) < 1e7:
            g.initializer.append(numpy_helper.from_array(np.ones(shape, np.float32), v.name))
    elif choice == "output_init" and g.output:
        g.output[0].name = g.initializer[0].name
    else:
        t = rng.choice(list(g.initializer)) if g.initializer else None
        if t is None:
            return
        if choice == "dims":
            if t.dims:
                t.dims[rng.randrange(len(t.dims))] = rng.choice([0, 1, 3, 64, -1])
            else:
                t.dims.append(2)
        elif choice == "data":
            if t.raw_data:
                t.raw_data = t.raw_data[: rng.randrange(len(t.raw_data))]
            else:
                t.raw_data = b"\x01\x02\x03"
        elif choice == "dtype":
            t.data_type = rng.choice([0, 2, 7, 8, 10, 16, 999])
        elif choice == "nan" and t.data_type == TensorProto.FLOAT:
            a = numpy_helper.to_array(t).copy()
            if a.size:
                a.flat[rng.randrange(a.size)] = rng.choice([np.nan, np.inf, -np.inf, 3e38])
            t.CopyFrom(numpy_helper.from_array(a, t.name))
        elif choice == "remove":
            g.initializer.remove(t)
        elif choice == "huge_dims":
            del t.dims[:]
            t.dims.extend([2**31, 2**31])
    case.what.append(f"initializer {choice}")


def m_dtype(rng, case):
    vis = _value_infos(case.model)
    if not vis:
        return
    v = rng.choice(vis)
    v.type.tensor_type.elem_type = rng.choice([0, 2, 6, 7, 8, 9, 10, 11, 16, 17, 999])
    case.what.append(f"elem_type of {v.name!r} = {v.type.tensor_type.elem_type}")


def m_dim(rng, case):
    g = case.model.graph
    v = rng.choice(list(g.input) + list(g.output)) if (g.input or g.output) else None
    if v is None:
        return
    dims = v.type.tensor_type.shape.dim
    choice = rng.choice(["value", "param", "noshape", "rank", "shapes_arg"])
    if choice == "value" and dims:
        dims[rng.randrange(len(dims))].dim_value = rng.choice([0, 2, 2**31, 2**62, 5, 1000])
    elif choice == "param" and dims:
        dims[rng.randrange(len(dims))].dim_param = rng.choice(["N", "batch", ""])
        if rng.random() < 0.5:
            case.args += ["--shapes", f"{v.name}:{'x'.join(str(rng.choice([1, 2, 3, 0, 64])) for _ in dims)}"]
    elif choice == "noshape":
        v.type.tensor_type.ClearField("shape")
    elif choice == "rank":
        if dims and rng.random() < 0.5:
            del dims[-1]
        else:
            dims.add().dim_value = 1
    elif choice == "shapes_arg":
        case.args += ["--shapes", rng.choice([f"{v.name}:1x2", "nope:1x3", f"{v.name}:", f"{v.name}:1x-3", f"{v.name}:ax1",
                                              f"{v.name}:1x1,{v.name}:1x1", f"{v.name}:１", f"{v.name}:{'x'.join(['99999'] * 4)}"])]
    case.what.append(f"dim {choice} on {v.name!r}")


def m_opset(rng, case):
    m = case.model
    choice = rng.choice(["version", "drop", "duplicate", "ir"])
    if choice == "version" and m.opset_import:
        m.opset_import[0].version = rng.choice([0, 1, 6, 9, 11, 13, 19, 21, 23, 99, -1])
    elif choice == "drop":
        del m.opset_import[:]
    elif choice == "duplicate":
        m.opset_import.append(helper.make_opsetid("", rng.choice([11, 17, 18])))
    else:
        m.ir_version = rng.choice([0, 1, 3, 7, 10, 11, 99])
    case.what.append(f"opset {choice}")


def m_domain(rng, case):
    g = case.model.graph
    if not g.node:
        return
    n = rng.choice(list(g.node))
    n.domain = rng.choice(["com.microsoft", "ai.onnx.ml", "foo.bar", "ai.onnx", "ai.onnx.preview.training"])
    if rng.random() < 0.5:
        case.model.opset_import.append(helper.make_opsetid(n.domain, rng.choice([1, 2, 99])))
    case.what.append(f"domain {n.domain!r} on {n.op_type}")


def m_external(rng, case):
    """Weights in an external-data file, then that file or its reference made hostile."""
    m = case.model
    if not m.graph.initializer:
        return m_initializer(rng, case)
    with tempfile.TemporaryDirectory() as tmp:
        onnx.save(m, f"{tmp}/model.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
                  location="weights.data", size_threshold=0)
        m2 = onnx.load(f"{tmp}/model.onnx", load_external_data=False)
        data = Path(tmp, "weights.data").read_bytes()
    choice = rng.choice(["ok", "missing", "absolute", "parent", "symlink_out", "fifo", "dir", "short", "offset",
                         "devzero", "link_loop"])
    files = {"weights.data": data}
    if choice == "missing":
        files = {}
    elif choice in ("absolute", "parent", "devzero"):
        loc = {"absolute": "/etc/hostname", "parent": "../weights.data", "devzero": "/dev/zero"}[choice]
        for t in m2.graph.initializer:
            for e in t.external_data:
                if e.key == "location":
                    e.value = loc
    elif choice == "symlink_out":
        files = {"weights.data": ("link", "/etc/hostname")}
    elif choice == "fifo":
        files = {"weights.data": "fifo"}
    elif choice == "dir":
        files = {"weights.data": "dir"}
    elif choice == "short":
        files = {"weights.data": data[: len(data) // 2]}
    elif choice == "offset":
        t = rng.choice(list(m2.graph.initializer))
        for e in t.external_data:
            if e.key == "offset":
                e.value = str(rng.choice([len(data) * 2, -5, 2**62]))
    elif choice == "link_loop":
        files = {"weights.data": ("link", "weights.data")}
    case.model, case.files = m2, files
    case.what.append(f"external data {choice}")


def m_special(rng, case):
    case.special = rng.choice(["fifo", "dir", "missing", "link-loop", "empty", "devnull", "unreadable"])
    case.what.append(f"model path is {case.special}")


def m_names(rng, case):
    g = case.model.graph
    choice = rng.choice(["node", "tensor", "graph", "non_utf8", "out_path", "input_output_same"])
    if choice == "node" and g.node:
        rng.choice(list(g.node)).name = rng.choice(HOSTILE_NAMES)
    elif choice == "tensor" and g.node and g.node[0].output:
        old, new = g.node[0].output[0], rng.choice(HOSTILE_NAMES)
        for n in g.node:
            n.input[:] = [new if i == old else i for i in n.input]
            n.output[:] = [new if o == old else o for o in n.output]
        for v in _value_infos(case.model):
            if v.name == old:
                v.name = new
    elif choice == "graph":
        g.name = rng.choice(HOSTILE_NAMES)
    elif choice == "non_utf8" and g.node:
        g.node[0].name = "NONUTF8"
        case.raw, case.model = case.model.SerializeToString().replace(b"NONUTF8", b"NO\xff\xfe\xc3T8"), None
    elif choice == "out_path":
        case.args += ["-o", rng.choice(["out/../x", "x" * 300, "/proc/x", "model.onnx", ".", "out\nb", "model.onnx/out"])]
    elif choice == "input_output_same" and g.input and g.output:
        g.output[0].name = g.input[0].name
    case.what.append(f"names {choice}")


CLASSES = {"bytes": m_bytes, "truncate": m_truncate, "node": m_node, "edge": m_edge, "attribute": m_attribute,
           "initializer": m_initializer, "dtype": m_dtype, "dim": m_dim, "opset": m_opset, "domain": m_domain,
           "external": m_external, "special": m_special, "names": m_names}


def make_case(seeds: Seeds, seed: int, index: int, cls: str | None = None) -> Case:
    rng = random.Random(seed * 1_000_003 + index)
    cls = cls or rng.choice(sorted(CLASSES))
    name, model = seeds.pick(rng)
    case = Case(index=index, cls=cls, seed_model=name, model=model)
    CLASSES[cls](rng, case)
    if rng.random() < 0.7:
        case.args.append("--no-search")
    if rng.random() < 0.3:
        case.args += ["--streams", str(rng.choice([1, 2, 3, 4, 8]))]
    if rng.random() < 0.5:
        case.args.append("--quiet")
    return case


def write_case(case: Case, folder: Path) -> Path:
    """The case's files in ``folder``; the model path."""
    folder.mkdir(parents=True)
    path = folder / "model.onnx"
    special = case.special
    if special == "fifo":
        os.mkfifo(path)
    elif special == "dir":
        path.mkdir()
    elif special == "link-loop":
        path.symlink_to(path)
    elif special == "empty":
        path.write_bytes(b"")
    elif special == "devnull":
        path.symlink_to("/dev/null")
    elif special == "missing":
        pass
    else:
        path.write_bytes(case.raw if case.raw is not None else case.model.SerializeToString())
        if special == "unreadable":
            path.chmod(0)
    for name, content in case.files.items():
        p = folder / name
        if content == "fifo":
            os.mkfifo(p)
        elif content == "dir":
            p.mkdir()
        elif isinstance(content, tuple):
            p.symlink_to(content[1])
        else:
            p.write_bytes(content)
    return path


# -- running one case in a fork -----------------------------------------------------------------------
def _check_bundle(folder: Path, model_path: Path, out_name: str) -> dict:
    """A built bundle against onnxruntime on the mutated model, on fresh seeded inputs (scaled error <= 1e-4)."""
    import onnxruntime as ort

    from parastream.launcher import load
    from parastream.pipeline.model_io import random_feeds

    runner = load(folder / out_name, device="cpu")
    specs = runner.plan.inputs
    feeds = random_feeds(specs, seed=12345)
    so = ort.SessionOptions()
    so.log_severity_level = 4
    model = onnx.load(str(model_path))
    for i, n in enumerate(model.graph.node):  # onnxruntime refuses duplicate node names; names change no number
        n.name = f"n{i}"
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    ref = dict(zip(names, sess.run(None, feeds)))
    got = runner(feeds)
    worst = 0.0
    for k, r in ref.items():
        g = np.asarray(got[k])
        r = np.asarray(r)
        if g.shape != r.shape or g.dtype != r.dtype:
            return {"equal": False, "why": f"{k}: {g.shape}/{g.dtype} vs {r.shape}/{r.dtype}"}
        if r.dtype.kind == "f":
            if not np.array_equal(np.isnan(g), np.isnan(r)):
                return {"equal": False, "why": f"{k}: NaN positions differ"}
            fin = np.isfinite(r)
            if not np.array_equal(g[~fin & ~np.isnan(r)], r[~fin & ~np.isnan(r)]):
                return {"equal": False, "why": f"{k}: infinities differ"}
            # scaled error: max|out-ref| / max|ref|.  Elementwise relative error misjudges fp32 cancellation
            # (mutated weights give outputs of 1e35 whose near-zero elements differ by 1e28 between two
            # correct evaluation orders)
            d = np.abs(g[fin].astype(np.float64) - r[fin])
            scale = float(np.abs(r[fin]).max()) if d.size else 0.0
            worst = max(worst, float(d.max()) / max(scale, 1e-6) if d.size else 0.0)
        elif not np.array_equal(g, r):
            return {"equal": False, "why": f"{k}: values differ"}
    return {"equal": worst <= 1e-4, "max_scaled": worst}


def _child(case_dir: Path, argv: list[str]) -> None:
    """In the forked child: run main(argv) with stdout/stderr into files, then check what it built."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.chdir(case_dir)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        f = os.open(case_dir / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    code = 0
    try:
        from parastream.pipeline.cli import main

        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 2
        if code == 0 and "-o" in argv:
            try:
                res = _check_bundle(case_dir, case_dir / "model.onnx", argv[argv.index("-o") + 1])
            except Exception as e:  # noqa: BLE001
                res = {"equal": False, "why": f"check failed: {type(e).__name__}: {e}"[:500]}
            (case_dir / "check.json").write_text(json.dumps(res))
    except BaseException:  # noqa: BLE001 - the outcome "traceback"
        traceback.print_exc()
        code = 99
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) and 0 <= code < 256 else 99)


def classify(case: Case, case_dir: Path, out_name: str, rc: int | None, sig: int | None, hung: bool) -> tuple[str, str]:
    err = (case_dir / "stderr").read_text(errors="replace") if (case_dir / "stderr").exists() else ""
    # the build's own stage lines ("parastream build: [   0.1 s] rewrite search", printed without --quiet when
    # stderr is no terminal) are its log, not noise; anything else before the error line is
    lines = [ln for ln in err.splitlines() if ln.strip() and not PROGRESS.match(ln)]
    first = lines[-1][:300] if lines else ""
    out = case_dir / out_name
    expected = EXPECTED | set(case.files) | {os.path.normpath(out_name).split("/")[0]}
    extra = sorted(set(os.listdir(case_dir)) - expected)
    if hung:
        return "hang", first
    if sig is not None:
        return "signal", f"signal {sig}"
    if rc == 99 or "Traceback (most recent call last)" in err:
        return "traceback", first
    try:
        partial = [p.name for p in out.parent.glob(f".{glob_escape(out.name)}*")] if out.parent.is_dir() else []
        out_exists = os.path.lexists(out)
    except OSError:  # a name too long for the file system: nothing of that name can exist
        partial, out_exists = [], False
    if extra or partial or (rc != 0 and out_exists and out_name not in ("model.onnx", ".")):
        return "leftover", f"{extra or partial or [out_name]}"
    if rc == 0:
        check = json.loads((case_dir / "check.json").read_text()) if (case_dir / "check.json").exists() else {}
        return ("built-equal" if check.get("equal") else "built-wrong"), json.dumps(check)[:300]
    if rc in (1, 2):
        ok = len(lines) == 1 and lines[0].startswith("parastream") and ": error: " in lines[0]
        return ("clean-error" if ok else "noisy-error"), first
    return "other", f"exit {rc}: {first}"


def run_cases(cases_iter, work: Path, workers: int, timeout: float, out_file=None, progress=True) -> list[dict]:
    """Fork one child per case, ``workers`` at a time; classify each; return the records."""
    running: dict[int, tuple] = {}
    records = []
    cases_iter = iter(cases_iter)
    exhausted = False
    t_start = time.time()
    while running or not exhausted:
        while not exhausted and len(running) < workers:
            try:
                case = next(cases_iter)
            except StopIteration:
                exhausted = True
                break
            case_dir = work / f"case_{case.index:05d}"
            model_path = write_case(case, case_dir)
            argv = ["build", str(model_path.name), "-o", "out", "--backend", "onnxruntime", *case.args]
            if "-o" in case.args:  # the case names its own OUT
                argv = ["build", str(model_path.name), "--backend", "onnxruntime", *case.args]
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(case_dir, argv)
            running[pid] = (case, case_dir, time.time(), argv)
        time.sleep(0.01)
        for pid, (case, case_dir, t0, argv) in list(running.items()):
            hung = False
            done, status = os.waitpid(pid, os.WNOHANG)
            if done == 0:
                if time.time() - t0 < timeout:
                    continue
                hung = True
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
                _, status = os.waitpid(pid, 0)
            try:
                os.killpg(pid, signal.SIGKILL)  # grandchildren a case left (in_child forks)
            except OSError:
                pass
            del running[pid]
            rc = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
            sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) and not hung else None
            outcome, detail = classify(case, case_dir, argv[argv.index("-o") + 1], rc, sig, hung)
            rec = {"case": case.index, "class": case.cls, "seed_model": case.seed_model, "mutation": "; ".join(case.what),
                   "args": argv[2:], "outcome": outcome, "rc": rc, "signal": sig, "seconds": round(time.time() - t0, 2),
                   "detail": detail}
            records.append(rec)
            if out_file is not None:
                out_file.write(json.dumps(rec) + "\n")
                out_file.flush()
            if outcome not in FAILURES:
                _rmtree(case_dir)
            if progress and len(records) % 50 == 0:
                print(f"{len(records)} cases, {time.time() - t_start:.0f} s: "
                      f"{dict(collections.Counter(r['outcome'] for r in records))}", file=sys.stderr, flush=True)
    return records


def _rmtree(p: Path) -> None:
    for root, dirs, files in os.walk(p):
        for d in dirs:
            try:
                os.chmod(os.path.join(root, d), 0o755)
            except OSError:
                pass
    shutil.rmtree(p, ignore_errors=True)


# -- kill trials: real processes, a signal at a random moment ---------------------------------------
def _wait_for_handlers(p: subprocess.Popen, timeout: float = 60.0) -> float:
    """Seconds until process ``p`` catches SIGTERM and SIGHUP (the CLI's ``interrupts.signals_raise``), read from
    the caught-signal mask in /proc/PID/status; it returns early if ``p`` ends.  Without /proc: a fixed second."""
    t0 = time.monotonic()
    want = (1 << (signal.SIGTERM - 1)) | (1 << (signal.SIGHUP - 1))
    status = Path(f"/proc/{p.pid}/status")
    while time.monotonic() - t0 < timeout and p.poll() is None:
        try:
            caught = next(int(line.split()[1], 16) for line in status.read_text().splitlines() if line.startswith("SigCgt:"))
        except (OSError, StopIteration):
            time.sleep(1.0)
            break
        if caught & want == want:
            break
        time.sleep(0.01)
    return time.monotonic() - t0


def kill_trials(n: int, seed: int, work: Path, timeout: float = 120.0) -> list[dict]:
    """Build an example model, send SIGKILL/SIGTERM/SIGHUP/SIGINT at a random moment, then check: OUT is absent
    or a complete bundle; nothing but OUT beside it (a SIGKILL's folder may stay until the next build, which
    must remove it and succeed)."""
    from parastream.launcher.bundle import Bundle
    from parastream.launcher.errors import ParastreamError

    rng = random.Random(seed)
    sigs = [signal.SIGKILL, signal.SIGTERM, signal.SIGHUP, signal.SIGINT]
    records = []
    for i in range(n):
        folder = work / f"kill_{i:03d}"
        folder.mkdir(parents=True)
        model = rng.choice(MODELS)
        sig = sigs[i % len(sigs)]
        existing = rng.random() < 0.3  # a previous bundle that --force replaces
        cmd = [sys.executable, "-m", "parastream.pipeline.cli", "build", str(model), "-o", "out", "--backend", "onnxruntime",
               "--quiet", "--no-search"]
        if existing:
            subprocess.run(cmd, cwd=folder, capture_output=True, timeout=timeout)
            cmd.append("--force")
        delay = rng.uniform(0.0, 5.0)
        p = subprocess.Popen(cmd, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        # counted from the moment the command catches the signals, not from its start: a Ctrl-C during Python's
        # start-up and the imports is Python's own traceback, and those take from 0.3 s to over a second
        started = _wait_for_handlers(p)
        time.sleep(delay)
        p.send_signal(sig)
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            records.append({"trial": i, "signal": sig.name, "outcome": "hang"})
            continue
        err = err.decode(errors="replace")
        problems = []
        if "Traceback" in err:
            problems.append("traceback")
        out = folder / "out"
        if out.exists():
            try:
                Bundle.open(out)
            except ParastreamError as e:
                problems.append(f"OUT incomplete: {e}")
        beside = sorted(x for x in os.listdir(folder) if x != "out")
        if beside and sig != signal.SIGKILL:
            problems.append(f"left {beside}")
        cleaned = None
        if beside and sig == signal.SIGKILL:
            # the next build to the same OUT removes what the killed one left, and succeeds
            base = cmd[:-1] if existing else cmd
            r = subprocess.run(base + (["--force"] if out.exists() else []), cwd=folder, capture_output=True, timeout=timeout)
            after = sorted(x for x in os.listdir(folder) if x != "out")
            cleaned = not after and r.returncode == 0
            if not cleaned:
                problems.append(f"next build left {after} (exit {r.returncode})")
        rec = {"trial": i, "model": model.stem, "signal": sig.name, "start_s": round(started, 2),
               "delay_s": round(delay, 2), "replacing": existing,
               "rc": p.returncode, "out_complete": out.exists(), "left_by_kill": beside, "cleaned_by_next_build": cleaned,
               "stderr": err.strip().splitlines()[-1][:200] if err.strip() else "",
               "outcome": "ok" if not problems else "; ".join(problems)}
        records.append(rec)
        print(json.dumps(rec), file=sys.stderr, flush=True)
        if not problems:
            shutil.rmtree(folder, ignore_errors=True)
    return records


def warm_up() -> None:
    """One build in this process before forking, so that each case does not pay the first build's lazy imports
    and one-time initialisation (~3 s); its onnxruntime sessions are freed (and their thread pools joined)
    before any fork."""
    import gc

    from parastream.pipeline.cli import main as cli_main

    with tempfile.TemporaryDirectory(prefix="parastream-fuzz-warm-") as tmp:
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
        m = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["r"], name="a"),
                                                 helper.make_node("Neg", ["r"], ["y"], name="b")], "warm", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
        onnx.save(m, f"{tmp}/m.onnx")
        cli_main(["build", f"{tmp}/m.onnx", "-o", f"{tmp}/out", "--backend", "onnxruntime", "--quiet"])
    gc.collect()


def summarize(records: list[dict]) -> dict:
    by_class = collections.defaultdict(collections.Counter)
    for r in records:
        by_class[r["class"]][r["outcome"]] += 1
    total = collections.Counter(r["outcome"] for r in records)
    return {"cases": len(records), "outcomes": dict(total), "by_class": {k: dict(v) for k, v in sorted(by_class.items())}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--start", type=int, default=0, help="first case index (to run a campaign in chunks)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds before a case counts as a hang")
    ap.add_argument("--classes", default=None, help="comma-separated mutation classes (default: all)")
    ap.add_argument("--kill-trials", type=int, default=0)
    ap.add_argument("--work", default=None, help="folder for the cases (default: a temporary folder)")
    ap.add_argument("--out", default=None, help="append one JSON line per case here")
    ap.add_argument("--check", action="store_true", help="exit 1 on any traceback, signal, hang, leftover, wrong build or noisy error")
    args = ap.parse_args(argv)

    work = Path(args.work or tempfile.mkdtemp(prefix="parastream-fuzz-"))
    work.mkdir(parents=True, exist_ok=True)
    classes = args.classes.split(",") if args.classes else None
    records = []
    if args.cases:
        seeds = Seeds()
        rng = random.Random(args.seed)
        cases = (make_case(seeds, args.seed, i, rng.choice(classes) if classes else None)
                 for i in range(args.start, args.start + args.cases))
        out_file = open(args.out, "a") if args.out else None
        try:
            records = run_cases(cases, work, args.workers, args.timeout, out_file)
        finally:
            if out_file:
                out_file.close()
    kills = kill_trials(args.kill_trials, args.seed, work) if args.kill_trials else []
    summary = summarize(records) if records else {}
    if kills:
        summary["kill_trials"] = dict(collections.Counter(("ok" if k["outcome"] == "ok" else "FAILED") + " " + k["signal"]
                                                          for k in kills))
    print(json.dumps(summary, indent=1))
    bad = [r for r in records if r["outcome"] in FAILURES or r["outcome"] == "other"]
    bad_kills = [k for k in kills if k["outcome"] != "ok"]
    for r in bad[:20]:
        print(json.dumps(r), file=sys.stderr)
    for k in bad_kills:
        print(json.dumps(k), file=sys.stderr)
    if not bad and not bad_kills and not args.work:
        _rmtree(work)
    else:
        print(f"cases kept in {work}", file=sys.stderr)
    return 1 if args.check and (bad or bad_kills) else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    # the libraries the cases use, imported once before forking (never an onnxruntime session here)
    import onnxruntime  # noqa: F401
    import onnx_graphsurgeon  # noqa: F401
    import polygraphy.backend.onnxrt  # noqa: F401

    import parastream.pipeline.build  # noqa: F401
    import parastream.pipeline.cli  # noqa: F401
    import parastream.rewrite  # noqa: F401

    warm_up()
    sys.exit(main())
