"""Kernel enlargement: zero-pad a smaller Conv kernel to its larger sibling's size, so the two can merge.

For a kernel W of size k, dilation d and pads p, padding W with e zeros on each side (k' = k + 2e) and
the input with p' = p + e·d on each side computes the same output:

    Σ_i W[i]·x[o·s + i·d − p]  =  Σ_i' W'[i']·x[o·s + i'·d − p']     with W'[i'] = W[i' − e] (0 outside)

The reverse (``shrink_kernel``) trims an all-zero border of width e and takes e·d off each pad.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from .base import Namer, Rule, Site, const_value, site_nodes, static_shape
from .merge_parallel_conv import conv_reason, conv_signature


def _enlarged_pads(small: gs.Node, big: gs.Node) -> tuple[list[int], list[int]] | str:
    """(margins e per spatial dim, new pads of ``small``), or the reason it cannot match ``big``."""
    a, b = conv_signature(small), conv_signature(big)
    if a["strides"] != b["strides"]:
        return f"{small.name} and {big.name} differ in strides ({a['strides']} vs {b['strides']})"
    if a["dilations"] != b["dilations"]:
        return f"{small.name} and {big.name} differ in dilations ({a['dilations']} vs {b['dilations']})"
    ka, kb = a["kernel_shape"], b["kernel_shape"]
    if len(ka) != len(kb):
        return f"{small.name} and {big.name} have kernels of different rank"
    margins = []
    for x, y in zip(ka, kb):
        if y < x or (y - x) % 2:
            return f"the kernel {ka} of {small.name} cannot be centred in {kb}"
        margins.append((y - x) // 2)
    if not any(margins):
        return f"{small.name} and {big.name} have the same kernel size"
    rank = len(ka)
    d = a["dilations"]
    pads = [a["pads"][i] + margins[i % rank] * d[i % rank] for i in range(2 * rank)]
    if pads != b["pads"]:
        return f"enlarged, {small.name} would have pads {pads}, not {b['pads']} like {big.name}"
    return margins, pads


class EnlargeKernel(Rule):
    name = "enlarge_kernel"
    enabling = True

    def match(self, graph: gs.Graph) -> list[Site]:
        sites = []
        for t in graph.tensors().values():
            convs = sorted((n for n in t.outputs if n.op == "Conv" and n.inputs and n.inputs[0] is t), key=lambda n: n.name)
            for small in convs:
                ws = static_shape(small.inputs[1])
                if ws is None:
                    continue
                for big in convs:
                    wb = static_shape(big.inputs[1])
                    if big is small or wb is None or len(wb) != len(ws):
                        continue
                    if all(y >= x for x, y in zip(ws[2:], wb[2:])) and wb[2:] != ws[2:]:
                        sites.append(Site(self.name, (small.name, big.name)))
        return sites

    def check(self, graph: gs.Graph, site: Site) -> str | None:
        nodes = site_nodes(graph, site)
        if nodes is None:
            return "the nodes are gone"
        small, big = nodes
        if small.inputs[0] is not big.inputs[0]:
            return f"{small.name} and {big.name} do not read the same tensor"
        for n in (small, big):
            reason = conv_reason(n)
            if reason:
                return reason
        if static_shape(small.inputs[1])[1] != static_shape(big.inputs[1])[1]:
            return f"{small.name} and {big.name} have different input channels"
        got = _enlarged_pads(small, big)
        return got if isinstance(got, str) else None

    def rewrite(self, graph: gs.Graph, site: Site) -> None:
        small, big = site_nodes(graph, site)
        margins, pads = _enlarged_pads(small, big)
        w = const_value(small.inputs[1])
        widths = [(0, 0), (0, 0)] + [(e, e) for e in margins]
        small.inputs[1] = gs.Constant(Namer(graph)(f"{small.name}_W_enlarged"), np.pad(w, widths))
        small.attrs = {**small.attrs, "pads": pads, "kernel_shape": list(conv_signature(big)["kernel_shape"])}
        small.attrs.pop("auto_pad", None)


class ShrinkKernel(Rule):
    """The reverse: trim an all-zero border of a Conv kernel (what enlargement added)."""

    name = "shrink_kernel"

    @staticmethod
    def _margins(node: gs.Node) -> list[int] | None:
        w = const_value(node.inputs[1]) if len(node.inputs) > 1 else None
        if w is None or w.ndim < 3:
            return None
        margins = []
        for axis in range(2, w.ndim):
            e = 0
            k = w.shape[axis]
            while 2 * (e + 1) <= k - 1:
                lo = np.take(w, [e], axis=axis)
                hi = np.take(w, [k - 1 - e], axis=axis)
                if np.any(lo) or np.any(hi):
                    break
                e += 1
            margins.append(e)
        return margins if any(margins) else None

    def match(self, graph: gs.Graph) -> list[Site]:
        return [Site(self.name, (n.name,)) for n in graph.nodes
                if n.op == "Conv" and len(n.inputs) > 1 and isinstance(n.inputs[1], gs.Constant) and self._margins(n)]

    def check(self, graph: gs.Graph, site: Site) -> str | None:
        nodes = site_nodes(graph, site)
        if nodes is None:
            return "the nodes are gone"
        (node,) = nodes
        reason = conv_reason(node)
        if reason:
            return reason
        margins = self._margins(node)
        if not margins:
            return f"the kernel of {node.name} has no zero border"
        sig = conv_signature(node)
        rank = len(margins)
        for i in range(2 * rank):
            if sig["pads"][i] < margins[i % rank] * sig["dilations"][i % rank]:
                return f"{node.name} has pads {sig['pads']}, too small to take the zero border off"
        return None

    def rewrite(self, graph: gs.Graph, site: Site) -> None:
        (node,) = site_nodes(graph, site)
        margins = self._margins(node)
        sig = conv_signature(node)
        rank = len(margins)
        w = const_value(node.inputs[1])
        index = (slice(None), slice(None)) + tuple(slice(e, w.shape[2 + i] - e) for i, e in enumerate(margins))
        trimmed = np.ascontiguousarray(w[index])
        node.inputs[1] = gs.Constant(Namer(graph)(f"{node.name}_W_trimmed"), trimmed)
        pads = [sig["pads"][i] - margins[i % rank] * sig["dilations"][i % rank] for i in range(2 * rank)]
        node.attrs = {**node.attrs, "pads": pads, "kernel_shape": list(trimmed.shape[2:])}
        node.attrs.pop("auto_pad", None)
