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

import threading
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


# The change log of node operands. Passes write a node's operands in place (``mm.inputs["residual"]
# = x``), and a node may sit in two node lists at once (engine/outliers.py's probe is a copy of the
# graph with a shorter list), so a write cannot update "its" index directly: it is logged here, and
# each _NodeList reads the log from where it last stopped before answering a query. _LOG_BASE is the
# sequence number of _LOG[0]; the log is cut when it grows long, and a list that had not read the
# cut entries rebuilds its index from the nodes.
_LOG: list[Node] = []
_LOG_BASE = 0
_LOG_MAX = 4096
_LOG_LOCK = threading.Lock()  # two threads may each load a model (each its own graph)


def _log(node: Node | None) -> None:
    global _LOG_BASE
    if node is None:
        return
    with _LOG_LOCK:
        if len(_LOG) >= _LOG_MAX:
            _LOG_BASE += len(_LOG)
            _LOG.clear()
        _LOG.append(node)


class _Operands(dict):
    """A node's ``inputs`` or ``outputs``: a dict whose writes are logged (see _LOG), so the
    readers / producer indexes of every node list holding the node stay exact."""

    __slots__ = ("node",)

    def __init__(self, node: Node | None, items=()) -> None:
        dict.__init__(self, items)
        self.node = node

    def __setitem__(self, k, v):
        dict.__setitem__(self, k, v)
        _log(self.node)

    def __delitem__(self, k):
        dict.__delitem__(self, k)
        _log(self.node)

    def __ior__(self, other):
        dict.update(self, other)
        _log(self.node)
        return self

    def update(self, *a, **kw):
        dict.update(self, *a, **kw)
        _log(self.node)

    def setdefault(self, k, default=None):
        v = dict.setdefault(self, k, default)
        _log(self.node)
        return v

    def pop(self, *a):
        v = dict.pop(self, *a)
        _log(self.node)
        return v

    def popitem(self):
        v = dict.popitem(self)
        _log(self.node)
        return v

    def clear(self):
        dict.clear(self)
        _log(self.node)

    def __reduce__(self):  # copied or pickled as a plain dict (a Node re-wraps it)
        return dict, (dict(self),)


# eq=False: a node is itself (identity equality and hash), so list.remove and the indexes find it
# without comparing operand dicts field by field (which a remove did for every node before it)
@dataclass(eq=False)
class Node:
    name: str
    op: str
    inputs: dict[str, str]    # params field -> tensor read
    outputs: dict[str, str]   # params field -> tensor written
    attrs: dict[str, Any] = field(default_factory=dict)  # params value fields (eps, epilogue, ...)

    def __setattr__(self, name: str, value) -> None:
        # the operand dicts are always this node's own _Operands (a copy of what is assigned), so
        # that a write to them is logged for this node
        if name in ("inputs", "outputs"):
            if name in self.__dict__:  # a new operand dict for a node already built
                _log(self)
            value = _Operands(self, value)
        object.__setattr__(self, name, value)

    def __reduce__(self):  # copy / deepcopy / pickle build a new Node, with its own operand dicts
        return Node, (self.name, self.op, dict(self.inputs), dict(self.outputs), self.attrs)

    def reads(self) -> list[str]:
        return list(self.inputs.values())

    def writes(self) -> list[str]:
        return list(self.outputs.values())

    def field_of(self, tensor: str) -> str:
        """The input field that reads `tensor`."""
        return next(f for f, t in self.inputs.items() if t == tensor)


class _NodeList(list):
    """Graph.nodes: the nodes in execution order, with an index of which nodes read and write each
    tensor, so the passes' queries (consumers, producer, index) cost a few dict lookups instead of
    a scan of every node (a SmolLM2-135M load's fusion ran 543 consumer scans and 181 producer
    maps, ~0.2 s; tests/test_fusion.py counts the rebuilds).

    The index follows append / insert / remove / pop incrementally, and operand writes through the
    log (_LOG); any other list mutation (slices, sort, extend, ...) marks it stale and the next query
    rebuilds it. NOTE: a node that appears twice in one list (not a valid graph: verify() refuses
    duplicate names) turns the index off; queries then scan, as they always did."""

    rebuilds = 0  # full rebuilds, every list (a count the tests read)

    def __init__(self, nodes=()) -> None:
        super().__init__(nodes)
        self._stale = True
        self._seen = 0  # log entries read: _LOG_BASE + index into _LOG
        self._pos: dict[Node, int] | None = None

    def __reduce__(self):
        return _NodeList, (list(self),)

    # -- the index

    def _sync(self) -> bool:
        """Brings the index up to date; False when it is off (a node appears twice)."""
        with _LOG_LOCK:
            if self._seen < _LOG_BASE:
                self._stale = True  # entries this list had not read were cut
                changed = ()
            else:
                changed = _LOG[self._seen - _LOG_BASE:]
            self._seen = _LOG_BASE + len(_LOG)
        if self._stale:
            _NodeList.rebuilds += 1
            self._readers: dict[str, dict[Node, None]] = {}
            self._writers: dict[str, dict[Node, None]] = {}
            self._entries: dict[Node, tuple[tuple[str, ...], tuple[str, ...]]] = {}
            self._pos, self._dups, self._stale = None, False, False
            for n in self:
                if n in self._entries:
                    self._dups = True
                    break
                self._add(n)
        elif not self._dups:
            for n in changed:
                if n in self._entries:
                    self._drop(n)
                    self._add(n)
        return not self._dups

    def _add(self, n: Node) -> None:
        reads, writes = tuple(dict.fromkeys(n.inputs.values())), tuple(dict.fromkeys(n.outputs.values()))
        self._entries[n] = (reads, writes)
        for t in reads:
            self._readers.setdefault(t, {})[n] = None
        for t in writes:
            self._writers.setdefault(t, {})[n] = None

    def _drop(self, n: Node) -> None:
        reads, writes = self._entries.pop(n)
        for t in reads:
            del self._readers[t][n]
        for t in writes:
            del self._writers[t][n]

    def _entered(self, n: Node) -> None:
        self._pos = None
        if self._stale:
            return
        if self._dups or n in self._entries:
            self._stale = True  # the rebuild decides whether the index is on
        else:
            self._add(n)

    def _left(self, n: Node) -> None:
        self._pos = None
        if self._stale:
            return
        if self._dups:
            self._stale = True
        else:
            self._drop(n)  # it was in the list once, and is no more

    def positions(self) -> dict[Node, int]:
        if self._pos is None:
            self._pos = {n: i for i, n in enumerate(self)}
        return self._pos

    def readers(self, tensor: str) -> list[Node] | None:
        """The nodes reading `tensor` in list order, or None when the index is off."""
        return self._ordered("_readers", tensor)

    def writers(self, tensor: str) -> list[Node] | None:
        """The nodes writing `tensor` in list order, or None when the index is off."""
        return self._ordered("_writers", tensor)

    def _ordered(self, index: str, tensor: str) -> list[Node] | None:
        if not self._sync():  # (builds the index dicts on first use)
            return None
        ns = getattr(self, index).get(tensor)
        if not ns:
            return []
        return list(ns) if len(ns) == 1 else sorted(ns, key=self.positions().__getitem__)

    # -- mutations the index follows

    def append(self, n: Node) -> None:
        super().append(n)
        self._entered(n)

    def insert(self, i: int, n: Node) -> None:
        super().insert(i, n)
        self._entered(n)

    def remove(self, n: Node) -> None:
        super().remove(n)
        self._left(n)

    def pop(self, i: int = -1) -> Node:
        n = super().pop(i)
        self._left(n)
        return n


def _marks_stale(name: str):
    """list.<name>, then the index is rebuilt on the next query (mutations too rare to follow)."""
    def method(self, *a, **kw):
        r = getattr(list, name)(self, *a, **kw)
        self._stale, self._pos = True, None
        return r

    method.__name__ = name
    return method


for _name in ("__setitem__", "__delitem__", "__iadd__", "__imul__", "extend", "clear", "sort", "reverse"):
    setattr(_NodeList, _name, _marks_stale(_name))
del _name


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
        self.nodes: list[Node] = []  # a _NodeList (the property below wraps what is assigned)
        self.outputs: list[str] = []  # tensors read after the step (logits)
        self.weights: dict[str, Any] = {}  # weight tensor name -> its Weight (formats)

    @property
    def nodes(self) -> list[Node]:
        return self._nodes

    @nodes.setter
    def nodes(self, nodes) -> None:
        # a copy.copy of a graph shares the list (and its index) until it is given a list of its own
        self._nodes = nodes if isinstance(nodes, _NodeList) else _NodeList(nodes)

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

    def producer(self, tensor: str) -> Node | None:
        """The node writing `tensor` (the last one if several: as producers() says), or None."""
        ws = self.nodes.writers(tensor)
        if ws is None:
            return self.producers().get(tensor)
        return ws[-1] if ws else None

    def consumers(self, tensor: str) -> list[Node]:
        """The nodes reading `tensor`, in execution order."""
        rs = self.nodes.readers(tensor)
        if rs is None:
            return [n for n in self.nodes if tensor in n.inputs.values()]
        return rs

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def index(self, node: Node) -> int:
        pos = self.nodes.positions()
        if len(pos) == len(self.nodes) and node in pos:
            return pos[node]
        return next(i for i, n in enumerate(self.nodes) if n is node)  # twice in the list, or absent

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
