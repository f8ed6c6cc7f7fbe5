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

PLAN_VERSION = 1


@dataclass
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name: "float32", "float16", "int64", ...
    shape: list[int]

    @classmethod
    def from_dict(cls, d: dict) -> "TensorSpec":
        return cls(name=d["name"], dtype=d["dtype"], shape=[int(s) for s in d["shape"]])


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
        producer: dict[str, int] = {}
        for b in self.branches:
            if not 0 <= b.stream < self.num_streams:
                raise ValueError(f"plan: {b.name} is on stream {b.stream}, outside 0..{self.num_streams - 1}")
            for t in b.outputs:
                producer[t] = b.id
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
        )

    def save(self, path: Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: Path) -> "Plan":
        return cls.from_json(Path(path).read_text())
