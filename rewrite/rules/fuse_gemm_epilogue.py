"""Fuse a matrix product, its bias and its activation into one node: cuBLASLt's GEMM epilogue.

    Y = act(X·W + B)    X [..., K], W [K, N], B broadcast as a vector [N], act ReLU or GELU

Two rules make the node.  ``fuse_gemm_epilogue`` (:class:`FuseGemmEpilogue`) fuses a product, its bias and its
activation, as below.  ``fuse_gemm_bias`` (:class:`FuseGemmBias`) fuses a ``MatMul`` and the ``Add`` of its bias
where no activation follows (act the identity): the bias then runs in the product's epilogue (``torch.addmm``)
instead of in an add.  It leaves a ``MatMul`` whose X other products with constant weights read too (attention's
Q, K and V) to merge_parallel_matmul, which makes one product of them; it fuses that product's bias.

The chain it replaces, as both exporters write a Linear followed by an activation:

* the product: ``MatMul(X, W)`` with W 2-d (a weight, not a per-batch matrix), or ``Gemm(A, W[, C])`` with
  transA = 0 and alpha = beta = 1 (transB = 1 gets W's transpose: a constant transposed here, else a Transpose
  node);
* the bias: ``Add(product, B)`` in either order, B of static shape [1, ..., 1, N] not enlarging the product
  (a Gemm's C is the bias itself); none (a Linear without bias, or one whose zero bias an exporter folded
  away): a MatMul read by the activation itself, or a Gemm without C, gets a zero bias;
* a Reshape between the biased product and the activation, as GPT-2's Conv1D writes it (the product of the
  rows flattened to 2-d, reshaped back): the activation is elementwise, so act(reshape(y)) = reshape(act(y)),
  and the fused node is followed by the same Reshape;
* the activation of the biased product ``x``: ``Relu(x)``; ONNX's ``Gelu(x)`` (opset 20, either ``approximate``);
  the erf form 0.5·x·(1 + erf(x/√2)) (x/√2 as a Div by √2 or a Mul by 1/√2; the product of x, 0.5 and
  1 + erf in any order of Muls, as the TorchScript exporter, the dynamo exporter at opset 18 and transformers
  write it); the tanh form 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) with x³ as x·(x·x), (x·x)·x or Pow(x, 3).

Every tensor inside the chain is read only by the chain and is no graph output; the types are one float type.
The node: ``parastream::MatMulBiasActivation`` (``core/fused_ops.py``).  Only the torch backend runs it as one
kernel (``torch._addmm_activation``, leading dimensions of X flattened); ONNX Runtime and TensorRT fuse the plain
form themselves, so the rule is for the torch backend alone (``backends``).  Which GELU the kernel computes on
the GPU (its tanh approximation) is the converter's concern: the node keeps the activation the model wrote.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import onnx_graphsurgeon as gs

from parastream.core import fused_ops

from .base import Namer, Rule, Site, anchored_sites, const_value, detach, is_graph_output, site_nodes, static_shape

_FLOAT_TYPES = (np.float16, np.float32, np.float64)
_TOL = 1e-5  # relative tolerance on the GELU forms' constants (exporters write them rounded to float32)


@dataclass
class Epilogue:
    """What one matched chain computes: the fused node's inputs and attributes and the nodes it replaces."""

    x: gs.Tensor
    w: gs.Tensor
    bias: gs.Tensor | None  # None: no bias (a zero bias)
    out: gs.Tensor
    activation: str = "Relu"
    approximate: str = "none"
    transpose_w: bool = False
    reshape: gs.Node | None = None  # a Reshape between the biased product and the activation
    nodes: list[gs.Node] = field(default_factory=list)  # every node replaced, the product first


def _scalar(t: gs.Tensor) -> float | None:
    v = const_value(t)
    return float(v.reshape(-1)[0]) if v is not None and v.size == 1 else None


def _near(value: float | None, want: float) -> bool:
    return value is not None and abs(value - want) <= _TOL * abs(want)


def _producer(t: gs.Tensor) -> gs.Node | None:
    return t.inputs[0] if len(t.inputs) == 1 else None


def _only_reader(graph: gs.Graph, t: gs.Tensor) -> gs.Node | None:
    """The one node that reads ``t`` when nothing else does and ``t`` is no graph output."""
    if is_graph_output(graph, t) or len(t.outputs) != 1:
        return None
    return t.outputs[0]


def _other(node: gs.Node, t: gs.Tensor) -> gs.Tensor | None:
    """The other operand of a two-input node that reads ``t`` once."""
    ins = list(node.inputs)
    if len(ins) != 2 or sum(i is t for i in ins) != 1:
        return None
    return ins[1] if ins[0] is t else ins[0]


def _one_plus(graph: gs.Graph, t: gs.Tensor, nodes: list[gs.Node]) -> gs.Tensor | None:
    """``Add(t, 1)`` (either order), the only reader of ``t``: its output (the node joins ``nodes``)."""
    add = _only_reader(graph, t)
    one = _other(add, t) if add is not None and add.op == "Add" else None
    if one is None or not _near(_scalar(one), 1.0):
        return None
    nodes.append(add)
    return add.outputs[0]


def _times_half_x(graph: gs.Graph, x: gs.Tensor, a: gs.Tensor, nodes: list[gs.Node]) -> gs.Tensor | None:
    """The output of the Muls that make 0.5·x·a from ``a`` (read by them only), in any order: each Mul's other
    operand is x, a constant scalar, or a Mul of x by a constant scalar that only this Mul reads."""
    seen_x, factor, t = False, 1.0, a
    for _ in range(3):
        mul = _only_reader(graph, t)
        if mul is None or mul.op != "Mul":
            return None
        other = _other(mul, t)
        if other is None:
            return None
        c = _scalar(other)
        if other is x and not seen_x:
            seen_x = True
        elif c is not None:
            factor *= c
        else:
            p = _producer(other)
            half = _other(p, x) if p is not None and p.op == "Mul" else None
            if seen_x or half is None or _scalar(half) is None or _only_reader(graph, other) is not mul:
                return None
            seen_x, factor = True, factor * _scalar(half)
            nodes.append(p)
        nodes.append(mul)
        t = mul.outputs[0]
        if seen_x and _near(factor, 0.5):
            return t
    return None


def _gelu_erf(graph: gs.Graph, x: gs.Tensor, scaled: gs.Node) -> tuple[gs.Tensor, list[gs.Node]] | None:
    """0.5·x·(1 + erf(x/√2)) from ``scaled`` (x/√2 or x·(1/√2)), or None."""
    if scaled.op == "Div":
        if scaled.inputs[0] is not x or not _near(_scalar(scaled.inputs[1]), math.sqrt(2.0)):
            return None
    else:
        c = _other(scaled, x)
        if c is None or not _near(_scalar(c), 1 / math.sqrt(2.0)):
            return None
    erf = _only_reader(graph, scaled.outputs[0])
    if erf is None or erf.op != "Erf":
        return None
    nodes = [scaled, erf]
    a = _one_plus(graph, erf.outputs[0], nodes)
    y = _times_half_x(graph, x, a, nodes) if a is not None else None
    return (y, nodes) if y is not None else None


def _cube(graph: gs.Graph, x: gs.Tensor, t: gs.Tensor) -> list[gs.Node] | None:
    """The nodes that make ``t`` = x³ (Pow(x, 3), x·(x·x) or (x·x)·x), each output read by the next only."""
    p = _producer(t)
    if p is None:
        return None
    if p.op == "Pow":
        return [p] if p.inputs[0] is x and _near(_scalar(p.inputs[1]), 3.0) else None
    if p.op != "Mul" or len(p.inputs) != 2:
        return None
    a, b = p.inputs
    for sq, other in ((a, b), (b, a)):
        q = _producer(sq)
        if other is x and q is not None and q.op == "Mul" and all(i is x for i in q.inputs) \
                and _only_reader(graph, sq) is p:
            return [q, p]
    return None


def _gelu_tanh(graph: gs.Graph, x: gs.Tensor, tanh: gs.Node) -> tuple[gs.Tensor, list[gs.Node]] | None:
    """0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) around ``tanh``, or None."""
    arg = _producer(tanh.inputs[0])
    if arg is None or arg.op != "Mul" or _only_reader(graph, arg.outputs[0]) is not tanh:
        return None
    consts = [i for i in arg.inputs if _scalar(i) is not None]
    if len(consts) != 1 or not _near(_scalar(consts[0]), math.sqrt(2 / math.pi)):
        return None
    inner = _other(arg, consts[0])
    add = _producer(inner) if inner is not None else None
    if add is None or add.op != "Add" or _only_reader(graph, inner) is not arg:
        return None
    cubic = _other(add, x)
    mul = _producer(cubic) if cubic is not None else None
    if mul is None or mul.op != "Mul" or _only_reader(graph, cubic) is not add:
        return None
    coeffs = [i for i in mul.inputs if _scalar(i) is not None]
    if len(coeffs) != 1 or not _near(_scalar(coeffs[0]), 0.044715):
        return None
    cube = _other(mul, coeffs[0])
    cube_nodes = _cube(graph, x, cube) if cube is not None else None
    if cube_nodes is None or _only_reader(graph, cube) is not mul:
        return None
    nodes = [*cube_nodes, mul, add, arg, tanh]
    a = _one_plus(graph, tanh.outputs[0], nodes)
    y = _times_half_x(graph, x, a, nodes) if a is not None else None
    return (y, nodes) if y is not None else None


def find_activation(graph: gs.Graph, x: gs.Tensor) -> tuple[str, str, gs.Tensor, list[gs.Node]] | str:
    """(activation, approximate, output, nodes) of the activation that reads ``x``, every reader of ``x`` part
    of it; else the reason."""
    if is_graph_output(graph, x):
        return f"{x.name} is a graph output"
    readers = list(x.outputs)
    if len(readers) == 1 and readers[0].op == "Relu":
        return "Relu", "none", readers[0].outputs[0], readers
    if len(readers) == 1 and readers[0].op == "Gelu":
        approximate = readers[0].attrs.get("approximate", "none")
        approximate = approximate.decode() if isinstance(approximate, bytes) else str(approximate)
        if approximate not in ("none", "tanh"):
            return f"{readers[0].name} has approximate={approximate!r}"
        return "Gelu", approximate, readers[0].outputs[0], readers
    for r in readers:  # where a GELU's decomposition starts reading x
        got = None
        if r.op in ("Div", "Mul"):
            got, form = _gelu_erf(graph, x, r), "none"
        elif r.op == "Add":  # x + 0.044715·x³, scaled by √(2/π), then the Tanh
            scale = _only_reader(graph, r.outputs[0])
            tanh = _only_reader(graph, scale.outputs[0]) if scale is not None and scale.op == "Mul" else None
            if tanh is not None and tanh.op == "Tanh":
                got, form = _gelu_tanh(graph, x, tanh), "tanh"
        if got is not None and {id(n) for n in readers} <= {id(n) for n in got[1]}:
            return "Gelu", form, got[0], got[1]
    return f"{x.name} is read by {', '.join(sorted(r.name for r in readers))}, not a ReLU or a GELU alone"


def _vector_bias(bias: gs.Tensor, n: int, product: gs.Tensor, biased: gs.Tensor) -> bool:
    """Whether ``bias`` is [1, ..., 1, n] (or [n]) and adding it keeps the product's shape."""
    bs, ps, ys = static_shape(bias), static_shape(product), static_shape(biased)
    if bs is None or ps is None or ys is None or ps != ys or not bs or len(bs) > len(ps):
        return False
    return bs[-1] == n and all(d == 1 for d in bs[:-1])


def _float_type(*tensors: gs.Tensor) -> bool:
    types = set()
    for t in tensors:
        try:
            types.add(np.dtype(t.values.dtype if isinstance(t, gs.Constant) else t.dtype))
        except TypeError:
            return False
    return len(types) == 1 and next(iter(types)).type in _FLOAT_TYPES


def _product_and_bias(graph: gs.Graph, product: gs.Node) -> Epilogue | str:
    """The product that starts at ``product`` (a MatMul or a Gemm) and its bias, if any (``out`` the biased
    product), or the reason it is not one the fused node computes."""
    y = product.outputs[0]
    nodes, biased, bias = [product], y, None
    if product.op == "Gemm":
        if int(product.attrs.get("transA", 0)) != 0 or float(product.attrs.get("alpha", 1.0)) != 1.0 \
                or float(product.attrs.get("beta", 1.0)) != 1.0:
            return f"{product.name} has transA, alpha or beta"
        x, w = product.inputs[:2]
        bias = product.inputs[2] if len(product.inputs) > 2 else None
        transpose_w = bool(int(product.attrs.get("transB", 0)))
    else:
        x, w = product.inputs
        transpose_w = False
        add = _only_reader(graph, y)  # else no bias: the activation reads the product itself
        if add is not None and add.op == "Add":
            bias = _other(add, y)
            if bias is None:
                return f"{add.name} does not add a bias to {y.name}"
            nodes.append(add)
            biased = add.outputs[0]
    xs, ws = static_shape(x), static_shape(w)
    if xs is None or ws is None or len(ws) != 2 or len(xs) < 2 or (product.op == "Gemm" and len(xs) != 2):
        return f"{product.name} is not [..., K] x [K, N] with a 2-d weight"
    k, n = (ws[1], ws[0]) if transpose_w else (ws[0], ws[1])
    if xs[-1] != k:
        return f"{product.name} is not [..., K] x [K, N]"
    if bias is not None and not _vector_bias(bias, n, y, biased):
        return f"the bias {bias.name} is not a vector of the {n} columns of {product.name}"
    if not _float_type(x, w, *([bias] if bias is not None else [])):
        return f"the inputs of {product.name} are not floating point of one type"
    return Epilogue(x=x, w=w, bias=bias, out=biased, activation="Identity", transpose_w=transpose_w, nodes=nodes)


def _with_activation(graph: gs.Graph, ep: Epilogue) -> Epilogue | str:
    """``ep`` (a product and its bias) with the activation that follows it (through a Reshape, if one is
    between), as a new Epilogue, or the reason there is none."""
    biased, reshape = ep.out, _only_reader(graph, ep.out)
    if reshape is not None and reshape.op == "Reshape" and static_shape(biased) is not None \
            and static_shape(reshape.outputs[0]) is not None:
        biased = reshape.outputs[0]
    else:
        reshape = None
    got = find_activation(graph, biased)
    if isinstance(got, str):
        return got
    activation, approximate, out, act_nodes = got
    return replace(ep, activation=activation, approximate=approximate, out=out, reshape=reshape,
                   nodes=ep.nodes + ([reshape] if reshape is not None else []) + act_nodes)


def find_epilogue(graph: gs.Graph, product: gs.Node) -> Epilogue | str:
    """The product-bias-activation chain that starts at ``product`` (a MatMul or a Gemm), or the reason it is
    not one this rule fuses."""
    ep = _product_and_bias(graph, product)
    return ep if isinstance(ep, str) else _with_activation(graph, ep)


def _weight_matrix(node: gs.Node) -> bool:
    return len(node.inputs) >= 2 and const_value(node.inputs[1]) is not None and const_value(node.inputs[1]).ndim == 2


def find_bias_epilogue(graph: gs.Graph, product: gs.Node) -> Epilogue | str:
    """The product and bias without activation that start at ``product`` (``MatMul(X, W)`` and the ``Add`` of
    its bias, read by anything but an activation), or the reason they are not ones this rule fuses."""
    if product.op != "MatMul":
        return f"{product.name} is a {product.op}: the converter runs a Gemm's bias in the product's epilogue"
    ep = _product_and_bias(graph, product)
    if isinstance(ep, str):
        return ep
    if not isinstance(_with_activation(graph, ep), str):
        return f"an activation follows {product.name}: fuse_gemm_epilogue fuses it with the activation"
    if ep.bias is None:
        return f"{product.name}'s product is not read by the Add of a bias alone"
    # Products of the same X with constant weights (attention's Q, K and V) are merge_parallel_matmul's: fused
    # one by one first, they could no longer be merged into one product (whose bias this rule then fuses).
    siblings = sorted(r.name for r in ep.x.outputs if r is not product and r.op in ("MatMul", "Gemm")
                      and _weight_matrix(r))
    if siblings and _weight_matrix(product):
        return f"{ep.x.name} is also multiplied by {', '.join(siblings)}: left for merge_parallel_matmul to merge first"
    return ep


class FuseGemmEpilogue(Rule):
    name = "fuse_gemm_epilogue"
    simplifying = True  # it only removes work: the biased product is never written (the GPU build times it per engine)
    backends = frozenset({"torch"})
    find = staticmethod(find_epilogue)  # the chain it fuses
    anchors = ("MatMul", "Gemm")  # the ops a chain starts at

    def match(self, graph: gs.Graph) -> list[Site]:
        return anchored_sites(self.name, graph, self.anchors, self.find)

    def _find(self, graph: gs.Graph, site: Site) -> Epilogue | str:
        nodes = site_nodes(graph, site)
        if nodes is None:
            return "the nodes are gone"
        got = self.find(graph, nodes[0])
        if isinstance(got, Epilogue) and tuple(n.name for n in got.nodes) != site.nodes:
            return "the chain changed"
        return got

    def check(self, graph: gs.Graph, site: Site) -> str | None:
        got = self._find(graph, site)
        return got if isinstance(got, str) else None

    def rewrite(self, graph: gs.Graph, site: Site) -> None:
        ep = self._find(graph, site)
        namer = Namer(graph)
        base = f"{ep.nodes[0].name}_epilogue"
        w = ep.w
        if ep.transpose_w:
            value = const_value(w)
            ws = static_shape(w)
            if value is not None:
                w = gs.Constant(namer(f"{base}_W"), np.ascontiguousarray(value.T))
            else:
                w = gs.Variable(namer(f"{base}_W"), dtype=ep.w.dtype, shape=[ws[1], ws[0]])
                graph.nodes.append(gs.Node("Transpose", name=namer(f"{base}_W_transpose"), attrs={"perm": [1, 0]},
                                           inputs=[ep.w], outputs=[w]))
        bias = ep.bias
        if bias is None:
            dtype = np.dtype(ep.x.dtype)
            bias = gs.Constant(namer(f"{base}_zero_bias"), np.zeros(static_shape(w)[1], dtype=dtype))
        out = ep.out
        if ep.reshape is not None:  # act(reshape(y)) = reshape(act(y)): the same Reshape after the fused node
            before = ep.reshape.inputs[0]
            out = gs.Variable(namer(f"{base}_out"), dtype=before.dtype, shape=before.shape)
            graph.nodes.append(gs.Node("Reshape", name=namer(ep.reshape.name), attrs=dict(ep.reshape.attrs),
                                       inputs=[out, ep.reshape.inputs[1]], outputs=[ep.out]))
        detach(*ep.nodes)
        attrs = {"activation": ep.activation}
        if ep.activation == "Gelu":
            attrs["approximate"] = ep.approximate
        graph.nodes.append(gs.Node(fused_ops.GEMM_ACTIVATION, name=namer(base), attrs=attrs,
                                   inputs=[ep.x, w, bias], outputs=[out], domain=fused_ops.DOMAIN))
        domains = list(graph.import_domains or [])
        if not any(d.domain == fused_ops.DOMAIN for d in domains):  # a new list: copies share the old one
            graph.import_domains = domains + [fused_ops.opset_id()]


class FuseGemmBias(FuseGemmEpilogue):
    """A product and its bias without activation as the same node (activation ``Identity``): the bias in
    cuBLASLt's epilogue (``torch.addmm``, as torch.compile runs a Linear) instead of the product and an add that
    Inductor fuses into what follows.  bench/gemm_bias.py measured it faster on the transformer layers'
    products (H200, fp16, batch 1 to 32: 1.15-1.34x on the attention and MLP outputs, 0.98-1.05x on QKV); a GPU
    build still times it per bundle, with the other GEMM epilogues (``fuse_gemm_epilogue``)."""

    name = "fuse_gemm_bias"
    find = staticmethod(find_bias_epilogue)
    anchors = ("MatMul",)
