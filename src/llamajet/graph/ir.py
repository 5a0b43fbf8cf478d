"""Graph IR: named nodes over typed, shaped tensors.

A Graph is the model as data: ``model/<architecture>.py`` builds it, passes
rewrite it, the planner lays its activations out in one arena and
``graph/lower.py`` turns it into the executor's Program. Node names follow
GGUF (``blk.3.attn_norm``) so passes and debug dumps can address them.

A node's operands are named: ``inputs`` and ``outputs`` map the fields of its
op's params struct (csrc/kernels/*.inc, e.g. matmul's ``x``, ``w``, ``out``)
to tensor names, and ``attrs`` holds the op's value fields (``eps``,
``epilogue``, ...), so lowering is one generic rule (graph/lower.py) and a
pass says ``mm.inputs["residual"] = x``, never "operand 3".

Shapes may use two symbols resolved per step: ``T`` (tokens in the step) and
``O`` (rows whose logits are wanted). Tensor kinds:
- ``input``: the step's token ids (supplied per run, not an operand);
- ``weight``: a loaded weight (or table) kept where the loader put it;
- ``activation``: planned into the arena;
- ``state``: a zero-size token that orders side effects (KV-cache writes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from llamajet import ops

SYMBOLS = ("T", "O")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple  # ints, or "T"/"O" for the step's token / output-row count
    dtype: str = "f32"  # a storage type name (ops.dtype): f32, i32, q8_act / q8_actk (int8 rows in groups)
    kind: str = "activation"  # input | weight | activation | state
    group: int = 0  # q8_act(k): elements per group (q8_act: per scale; q8_actk: a scale per 256)

    def nbytes(self, sizes: dict[str, int]) -> int:
        """Bytes for the largest step, with symbols resolved by `sizes`."""
        if self.kind == "state":
            return 0
        dims = [sizes[d] if isinstance(d, str) else d for d in self.shape]
        rows, cols = (dims[0], dims[-1]) if len(dims) > 1 else (dims[0] if dims else 1, 1)
        for d in dims[1:-1]:
            rows *= d
        return ops.tensor_bytes(self.dtype, rows, cols, self.group)


@dataclass
class Node:
    name: str
    op: str
    inputs: dict[str, str]    # params field -> tensor read
    outputs: dict[str, str]   # params field -> tensor written
    attrs: dict[str, Any] = field(default_factory=dict)  # params value fields (eps, epilogue, ...)

    def reads(self) -> list[str]:
        return list(self.inputs.values())

    def writes(self) -> list[str]:
        return list(self.outputs.values())

    def field_of(self, tensor: str) -> str:
        """The input field that reads `tensor`."""
        return next(f for f, t in self.inputs.items() if t == tensor)


class GraphError(ValueError):
    """The graph violates an invariant the verifier checks."""


def _named(operands: Mapping[str, str] | Sequence[str], prefix: str) -> dict[str, str]:
    # a plain list (synthetic ops in tests of the planner) is named by position
    if isinstance(operands, Mapping):
        return dict(operands)
    return {f"{prefix}{i}": t for i, t in enumerate(operands)}


class Graph:
    """Tensors and nodes in execution order; nodes refer to tensors by name."""

    def __init__(self) -> None:
        self.tensors: dict[str, TensorSpec] = {}
        self.nodes: list[Node] = []
        self.outputs: list[str] = []  # tensors read after the step (logits)
        self.weights: dict[str, Any] = {}  # weight tensor name -> its Weight (formats)

    # -- building

    def tensor(self, name: str, shape: tuple, dtype: str = "f32", kind: str = "activation", group: int = 0) -> str:
        if name in self.tensors:
            raise GraphError(f"tensor {name!r} defined twice")
        self.tensors[name] = TensorSpec(name, tuple(shape), dtype, kind, group)
        return name

    def weight(self, name: str, w) -> str:
        """Registers weight `w` under its canonical name."""
        if name not in self.tensors:
            self.tensors[name] = TensorSpec(name, tuple(w.shape), w.dtype, "weight")
            self.weights[name] = w
        return name

    def add(self, name: str, op: str, inputs: Mapping[str, str] | Sequence[str],
            outputs: Mapping[str, str] | Sequence[str], **attrs) -> Node:
        node = Node(name, op, _named(inputs, "in"), _named(outputs, "out"), attrs)
        self.nodes.append(node)
        return node

    def insert(self, pos: int, node: Node) -> Node:
        """Moves `node` (already in the graph, e.g. just added) to index `pos`."""
        self.nodes.remove(node)
        self.nodes.insert(pos, node)
        return node

    # -- queries

    def producers(self) -> dict[str, Node]:
        return {t: n for n in self.nodes for t in n.writes()}

    def consumers(self, tensor: str) -> list[Node]:
        return [n for n in self.nodes if tensor in n.inputs.values()]

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def index(self, node: Node) -> int:
        return next(i for i, n in enumerate(self.nodes) if n is node)

    def verify(self) -> None:
        """Checks: unique node names; every tensor declared; each activation has
        exactly one producer, placed before all its consumers (so the node list
        is a topological order and the graph is acyclic); outputs produced."""
        seen_names: set[str] = set()
        produced: set[str] = set()
        for n in self.nodes:
            if n.name in seen_names:
                raise GraphError(f"duplicate node name {n.name!r}")
            seen_names.add(n.name)
            for t in n.reads():
                spec = self.tensors.get(t)
                if spec is None:
                    raise GraphError(f"{n.name}: input {t!r} is not declared")
                if spec.kind in ("activation", "state") and t not in produced:
                    raise GraphError(f"{n.name}: input {t!r} is used before it is produced")
            for t in n.writes():
                spec = self.tensors.get(t)
                if spec is None:
                    raise GraphError(f"{n.name}: output {t!r} is not declared")
                if spec.kind not in ("activation", "state"):
                    raise GraphError(f"{n.name}: writes {spec.kind} tensor {t!r}")
                if t in produced:
                    raise GraphError(f"{n.name}: {t!r} has a second producer")
                produced.add(t)
        for t in self.outputs:
            if t not in produced:
                raise GraphError(f"graph output {t!r} is never produced")

    def __str__(self) -> str:
        lines = []
        for n in self.nodes:
            ins = ", ".join(f"{f}={t}" for f, t in n.inputs.items())
            outs = ", ".join(f"{f}={t}{list(self.tensors[t].shape)}" for f, t in n.outputs.items())
            lines.append(f"{n.name:28s} {n.op:10s} {outs} <- {ins}")
        return "\n".join(lines)
