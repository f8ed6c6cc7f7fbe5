"""The Plan: branches, their streams, the events between them and the launch order.

A Plan is everything the launcher needs besides the engines.  It is written to
``plan.json`` inside a bundle and round-trips through JSON.

Semantics
---------
* Branches on the same stream run in ``launch_order``; a same-stream dependency is
  therefore satisfied by stream order and needs no event.
* ``Branch.waits`` lists the branches on *other* streams whose outputs the branch
  consumes: each of those records one event after it runs, and the branch waits on
  those events before it starts (fork/join).
* ``launch_order`` is a topological order of the branches: every producer comes
  before its consumers.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from parastream.core.dataflow import producers
from parastream.core.tensors import TensorSpec

PLAN_VERSION = 1


@dataclass
class Branch:
    id: int
    name: str  # "branch_000"; also the engine's file stem
    stream: int
    nodes: list[str]  # ONNX node names, in topological order
    inputs: list[str]  # tensors read from outside the branch (model inputs or other branches)
    outputs: list[str]  # tensors consumed outside the branch or that are model outputs
    waits: list[int] = field(default_factory=list)  # other-stream producers (events to wait on)
    engine: str = ""  # path of the engine file, relative to the bundle
    bound: str = "compute"  # "compute" | "memory": what limits it, from the cost model
    est_time: float = 0.0  # seconds, cost model estimate
    flops: float = 0.0
    bytes: float = 0.0
    #: the branch is one Concat node joining 4-d tensors along this (non-negative) axis; None otherwise.
    #: The GPU launcher may then elide it: producers write straight into slices of its output.
    concat_axis: int | None = None

    @classmethod
    def from_dict(cls, d: dict) -> "Branch":
        return cls(**d)


@dataclass
class Plan:
    backend: str
    precision: str
    num_streams: int
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    tensors: dict[str, TensorSpec]  # every tensor a branch reads or writes across its boundary
    branches: list[Branch]
    launch_order: list[int]
    version: int = PLAN_VERSION
    #: CPU launcher: onnxruntime intra-op threads per engine, as the build measured best (0: onnxruntime's
    #: default, every core); None (bundles built before it was measured): cores / streams
    cpu_threads: int | None = None

    # -- derived views -------------------------------------------------------
    def branch(self, branch_id: int) -> Branch:
        return self.branches[branch_id]

    def stream_sequences(self) -> list[list[int]]:
        """Branch ids of each stream, in launch order."""
        seqs: list[list[int]] = [[] for _ in range(self.num_streams)]
        for b in self.launch_order:
            seqs[self.branches[b].stream].append(b)
        return seqs

    def recorders(self) -> set[int]:
        """Branches that must record an event because another stream waits on them."""
        return {w for b in self.branches for w in b.waits}

    def validate(self) -> None:
        """Check the invariants the launchers rely on; raise ValueError naming the branch."""
        ids = [b.id for b in self.branches]
        if ids != list(range(len(ids))):
            raise ValueError("plan: branch ids must be 0..n-1 in order")
        if sorted(self.launch_order) != ids:
            raise ValueError("plan: launch_order must name every branch exactly once")
        pos = {b: i for i, b in enumerate(self.launch_order)}
        for b in self.branches:
            if not 0 <= b.stream < self.num_streams:
                raise ValueError(f"plan: {b.name} is on stream {b.stream}, outside 0..{self.num_streams - 1}")
        producer = producers(b.outputs for b in self.branches)  # tensor -> branch id (ids are the indices)
        model_inputs = {t.name for t in self.inputs}
        for b in self.branches:
            for t in b.inputs:
                if t in model_inputs:
                    continue
                if t not in producer:
                    raise ValueError(f"plan: {b.name} reads {t!r}, which no branch produces")
                p = self.branches[producer[t]]
                if pos[p.id] >= pos[b.id]:
                    raise ValueError(f"plan: {b.name} is launched before {p.name}, which produces {t!r}")
                if p.stream != b.stream and p.id not in b.waits:
                    raise ValueError(f"plan: {b.name} reads {t!r} from stream {p.stream} without waiting on {p.name}")
        for t in self.outputs:
            if t.name not in producer and t.name not in model_inputs:
                raise ValueError(f"plan: model output {t.name!r} is produced by no branch")

    def in_place_concats(self, layout: dict[str, "TensorSpec"], channels_last: set[str]) -> tuple[dict[str, tuple[str, int]], set[int]]:
        """Concat branches a launcher can do in place, and where each of their inputs then lives.

        A branch qualifies when it is one Concat along channels (axis 1) of distinct tensors
        that are all stored channels-last (``channels_last``; a channel slice of such a buffer
        is a strided view an engine can write), whose channels add up to the output's, and
        that nothing else reads and that are no model input or output.  Its producers then
        write straight into their slice of the Concat's output and the branch runs no kernel;
        nested Concats resolve to the outermost buffer.

        Returns ``{input tensor: (buffer tensor, first channel)}`` and the ids of the elided branches.
        """
        readers: dict[str, list[int]] = {}
        for b in self.branches:
            for t in b.inputs:
                readers.setdefault(t, []).append(b.id)
        produced = {t for b in self.branches for t in b.outputs}
        model_io = {t.name for t in self.inputs} | {t.name for t in self.outputs}
        alias: dict[str, tuple[str, int]] = {}
        elided: set[int] = set()
        for b in self.branches:
            if b.concat_axis != 1 or len(b.outputs) != 1 or len(b.inputs) < 2 or len(set(b.inputs)) != len(b.inputs):
                continue
            out = b.outputs[0]
            if out in model_io or out not in channels_last:
                continue
            shapes = [layout[t].shape for t in b.inputs]
            oshape = layout[out].shape
            if not all(t in channels_last and t in produced and t not in model_io and readers.get(t) == [b.id]
                       and layout[t].dtype == layout[out].dtype for t in b.inputs):
                continue
            if any(s[0] != oshape[0] or s[2:] != oshape[2:] for s in shapes) or sum(s[1] for s in shapes) != oshape[1]:
                continue
            c0 = 0
            for t, s in zip(b.inputs, shapes):
                alias[t] = (out, c0)
                c0 += s[1]
            elided.add(b.id)
        for t in list(alias):  # a Concat's output that is itself an elided Concat's input: follow to the outermost
            root, off = alias[t]
            while root in alias:
                root, extra = alias[root]
                off += extra
            alias[t] = (root, off)
        return alias, elided

    # -- JSON ----------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        d = json.loads(text)
        if d.get("version") != PLAN_VERSION:
            raise ValueError(f"plan.json has version {d.get('version')!r}; this parastream reads version {PLAN_VERSION}")
        return cls(
            backend=d["backend"],
            precision=d["precision"],
            num_streams=int(d["num_streams"]),
            inputs=[TensorSpec.from_dict(t) for t in d["inputs"]],
            outputs=[TensorSpec.from_dict(t) for t in d["outputs"]],
            tensors={k: TensorSpec.from_dict(v) for k, v in d["tensors"].items()},
            branches=[Branch.from_dict(b) for b in d["branches"]],
            launch_order=[int(i) for i in d["launch_order"]],
            version=d["version"],
            cpu_threads=None if d.get("cpu_threads") is None else int(d["cpu_threads"]),
        )

    def save(self, path: Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: Path) -> "Plan":
        return cls.from_json(Path(path).read_text())
