"""Graph IR: named nodes over typed, shaped tensors.

A Graph is the model as data: ``model/llama.py`` builds it, passes rewrite
it, the planner lays its activations out in one arena and ``graph/lower.py``
turns it into the executor's Program. Node names follow GGUF
(``blk.3.attn_norm``) so passes and debug dumps can address them.

Shapes may use two symbols resolved per step: ``T`` (tokens in the step) and
``O`` (rows whose logits are wanted). Tensor kinds:
- ``input``: the step's token ids (supplied per run, not in the arena);
- ``weight``: a loaded weight (or table) kept where the loader put it;
- ``activation``: planned into the arena;
- ``state``: a zero-size token that orders side effects (KV-cache writes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SYMBOLS = ("T", "O")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple  # ints, or "T"/"O" for the step's token / output-row count
    dtype: str = "f32"
    kind: str = "activation"  # input | weight | activation | state

    def nbytes(self, sizes: dict[str, int]) -> int:
        """Bytes for the largest step, with symbols resolved by `sizes`."""
        if self.kind == "state":
            return 0
        n = 1
        for d in self.shape:
            n *= sizes[d] if isinstance(d, str) else d
        return n * {"f32": 4, "i32": 4, "i8": 1}.get(self.dtype, 4)


@dataclass
class Node:
    name: str
    op: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)


class GraphError(ValueError):
    """The graph violates an invariant the verifier checks."""


class Graph:
    """Tensors and nodes in execution order; nodes refer to tensors by name."""

    def __init__(self) -> None:
        self.tensors: dict[str, TensorSpec] = {}
        self.nodes: list[Node] = []
        self.outputs: list[str] = []  # tensors read after the step (logits)
        self.weights: dict[str, Any] = {}  # weight tensor name -> loader's WeightTensor

    # -- building

    def tensor(self, name: str, shape: tuple, dtype: str = "f32", kind: str = "activation") -> str:
        if name in self.tensors:
            raise GraphError(f"tensor {name!r} defined twice")
        self.tensors[name] = TensorSpec(name, tuple(shape), dtype, kind)
        return name

    def weight(self, name: str, w) -> str:
        """Registers loader weight `w` (a WeightTensor) under its canonical name."""
        if name not in self.tensors:
            self.tensors[name] = TensorSpec(name, tuple(w.shape), w.dtype, "weight")
            self.weights[name] = w
        return name

    def add(self, name: str, op: str, inputs: list[str], outputs: list[str], **attrs) -> Node:
        node = Node(name, op, list(inputs), list(outputs), attrs)
        self.nodes.append(node)
        return node

    # -- queries

    def producers(self) -> dict[str, Node]:
        return {t: n for n in self.nodes for t in n.outputs}

    def consumers(self, tensor: str) -> list[Node]:
        return [n for n in self.nodes if tensor in n.inputs]

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

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
            for t in n.inputs:
                spec = self.tensors.get(t)
                if spec is None:
                    raise GraphError(f"{n.name}: input {t!r} is not declared")
                if spec.kind in ("activation", "state") and t not in produced:
                    raise GraphError(f"{n.name}: input {t!r} is used before it is produced")
            for t in n.outputs:
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
            ins = ", ".join(n.inputs)
            outs = ", ".join(f"{t}{list(self.tensors[t].shape)}" for t in n.outputs)
            lines.append(f"{n.name:28s} {n.op:10s} {outs} <- {ins}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Constant:
    """A tensor the graph builder computes itself (e.g. RoPE cos/sin tables);
    registered in ``Graph.weights`` beside the loader's weights."""

    name: str
    data: Any  # np.ndarray, C-contiguous
    dtype: str = "f32"

    @property
    def shape(self) -> tuple:
        return tuple(self.data.shape)
