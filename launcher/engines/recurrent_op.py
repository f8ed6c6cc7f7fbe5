"""``torch.ops.parastream.rnn``: a recurrent layer as torch's own, for the torch converter and for the engines
whose code calls it.  A module of its own (torch only, no onnx), so that a bundle's load can define the op before
an engine's code runs without importing the converter."""

from __future__ import annotations

import threading

_RNN_OP: list = []
_RNN_LOCK = threading.Lock()


def register_rnn_op() -> None:
    """``torch.ops.parastream.rnn``: one recurrent layer (LSTM, GRU or RNN, one or both directions) as torch's own
    (``torch._VF``: cuDNN's kernel on the GPU), for the torch converter's LSTM, GRU and RNN
    (``onnx_torch._recurrent``).  Inductor leaves the op an extern call, as it does ``cudnn_plans``' convolution,
    where a recurrence written out step by step compiles each step's kernels: Sequencer2D-S's ~1400 steps took
    ``torch.compile`` 294 s on a 2-core CPU.  Defined (``base.define_op``) once per process, before any engine's
    code that calls it runs (``torch._load_artifact``)."""
    with _RNN_LOCK:
        if _RNN_OP:
            return
        import warnings

        import torch

        from .base import define_op

        def impl(kind, x, weights, h0, c0, bidirectional):
            vf = torch._VF
            # cuDNN's call warns that the weights "are not part of single contiguous chunk of memory" and advises an
            # nn.Module's flatten_parameters(): this op has no module, and its weights are an engine's inputs in
            # ONNX's layout, reordered at each call, which cuDNN then packs.  Silenced around this call only (it runs
            # at an engine's warm-up and capture, not at a graph's replays), not for the process's own modules
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="RNN module weights are not part of single contiguous")
                if kind == "LSTM":
                    return tuple(vf.lstm(x, (h0, c0), weights, True, 1, 0.0, False, bidirectional, False))
                fn = {"GRU": vf.gru, "RNN_TANH": vf.rnn_tanh, "RNN_RELU": vf.rnn_relu}[kind]
                y, h = fn(x, h0, weights, True, 1, 0.0, False, bidirectional, False)
            return y, h, h.new_empty(0)

        def fake(kind, x, weights, h0, c0, bidirectional):
            dirs, hidden = (2 if bidirectional else 1), weights[1].shape[1]
            h = x.new_empty(dirs, x.shape[1], hidden)
            return (x.new_empty(x.shape[0], x.shape[1], dirs * hidden), h,
                    h.new_empty(h.shape) if kind == "LSTM" else h.new_empty(0))

        _RNN_OP.append(define_op("rnn(str kind, Tensor x, Tensor[] weights, Tensor h0, Tensor? c0, "
                                 "bool bidirectional) -> (Tensor, Tensor, Tensor)", impl, fake))
