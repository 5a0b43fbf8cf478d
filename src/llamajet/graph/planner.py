"""Activation memory planning: liveness -> offsets in one arena.

Liveness. Nodes run in list order, one at a time (a barrier after each), so
time is the node index. An activation lives from the node that produces it to
the last node that reads it, both inclusive; a graph output lives to the end
(index len(nodes)), so nothing reuses it before the caller reads it. Two
tensors conflict when these closed intervals intersect. In particular a
tensor whose last reader is node j can be reused from node j+1 on, never by
node j's own outputs: kernels read their inputs while they write their
outputs. Every output of a multi-output node is live at that node, so the
outputs of one node never share memory either.

Placement. Buffers are placed one at a time, each in the smallest free gap
(best fit) between the already-placed buffers whose lifetimes intersect its
own, else just above the highest of them. Two orders are tried and the
smaller arena is kept: largest buffer first ("greedy by size", which packs
the wide FFN tensors of all layers into the same few slots first) and
production order. Both are O(n^2) in the number of activations (~500 for a
30-layer model; milliseconds).

The checker (`MemoryPlan.check`) does not trust the placement: given the
graph it recomputes liveness and sizes, then proves that no two tensors live
at the same node share a byte.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llamajet.graph.ir import Graph

ALIGN = 64  # bytes; cache-line aligned so no two tensors share a line


@dataclass(frozen=True)
class MemoryPlan:
    offsets: dict[str, int]    # activation -> byte offset in the arena
    sizes: dict[str, int]      # activation -> bytes (largest step, rounded up to ALIGN)
    lifetimes: dict[str, tuple[int, int]]  # activation -> (first node, last node), inclusive
    arena_bytes: int
    naive_bytes: int           # sum of all activation sizes (no reuse)
    symbols: dict[str, int] = field(default_factory=dict)  # the shape-symbol values planned for
    strategy: str = ""         # which placement order won

    def live_at(self, j: int) -> list[str]:
        return [t for t, (s, e) in self.lifetimes.items() if s <= j <= e]

    def peak_live_bytes(self) -> int:
        """Lower bound on any valid arena: the most bytes live at one node."""
        if not self.lifetimes:
            return 0
        end = max(e for _, e in self.lifetimes.values())
        peak = 0
        for j in range(end + 1):
            peak = max(peak, sum(self.sizes[t] for t in self.live_at(j)))
        return peak

    def check(self, graph: Graph | None = None) -> None:
        """Proves the plan valid; raises AssertionError otherwise.

        Without `graph`: every tensor lies inside the arena, aligned, and no
        two tensors whose lifetimes intersect overlap in memory. With `graph`: also that the recorded lifetimes
        and sizes cover the graph's real ones, recomputed here from scratch,
        so a liveness bug in the planner cannot hide behind its own records."""
        if graph is not None:
            self._check_covers(graph)
        for t, off in self.offsets.items():
            if off < 0 or off % ALIGN or off + self.sizes[t] > self.arena_bytes:
                raise AssertionError(f"{t}: [{off}, +{self.sizes[t]}) is misaligned or outside the "
                                     f"{self.arena_bytes}-byte arena")
        # Sweep in offset order: once b starts at or past a's end, no later
        # tensor overlaps a (they start at b's offset or above).
        names = sorted(self.offsets, key=lambda t: (self.offsets[t], t))
        for i, a in enumerate(names):
            a1 = self.offsets[a] + self.sizes[a]
            la = self.lifetimes[a]
            for b in names[i + 1:]:
                if self.offsets[b] >= a1:
                    break
                if self.sizes[b] == 0:
                    continue  # an empty tensor overlaps nothing
                lb = self.lifetimes[b]
                if la[0] <= lb[1] and lb[0] <= la[1]:
                    raise AssertionError(f"live tensors {a} {la} and {b} {lb} overlap in the arena")

    def _check_covers(self, graph: Graph) -> None:
        end = len(graph.nodes)
        first: dict[str, int] = {}
        last: dict[str, int] = {}
        for j, n in enumerate(graph.nodes):
            for t in n.writes():
                if graph.tensors[t].kind == "activation":
                    first.setdefault(t, j)
            for t in n.reads():
                if t in first:
                    last[t] = j
        for t in graph.outputs:
            if t in first:
                last[t] = end
        for t, s in first.items():
            e = max(s, last.get(t, s))
            if t not in self.offsets:
                raise AssertionError(f"activation {t} has no offset")
            ps, pe = self.lifetimes[t]
            if ps > s or pe < e:
                raise AssertionError(f"{t}: planned lifetime {(ps, pe)} does not cover its real one {(s, e)}")
            need = graph.tensors[t].nbytes(self.symbols)
            if self.sizes[t] < need:
                raise AssertionError(f"{t}: {self.sizes[t]} bytes planned, {need} needed")


def _round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def liveness(graph: Graph) -> dict[str, tuple[int, int]]:
    """activation -> (producing node, last reading node); graph outputs: len(nodes).

    A kv_write followed by an attention: the executor may run the two as
    one region (chunk u of both on one thread, no wait between them:
    runtime/executor.cpp, Slot::pairs_next), so kv_write's inputs live
    through the attention node too (attention's output must not reuse their
    memory while another chunk's kv_write still reads them)."""
    start: dict[str, int] = {}
    last: dict[str, int] = {}
    nodes = graph.nodes
    for idx, node in enumerate(nodes):
        for t in node.writes():
            if graph.tensors[t].kind == "activation":
                start[t] = idx
                last[t] = idx
        paired = node.op == "kv_write" and idx + 1 < len(nodes) and nodes[idx + 1].op == "attention"
        for t in node.reads():
            if t in start:
                last[t] = idx + 1 if paired else idx
    for t in graph.outputs:
        if t in start:
            last[t] = len(graph.nodes)
    return {t: (start[t], last[t]) for t in start}


def _place(order: list[int], life: list[tuple[int, int]], size: list[int]) -> tuple[list[int], int]:
    """Best-fit placement of buffers in `order`; returns (offsets, arena bytes)."""
    offsets = [-1] * len(size)
    placed: list[int] = []
    top = 0
    for b in order:
        s, e = life[b]
        spans = sorted((offsets[u], offsets[u] + size[u]) for u in placed
                       if life[u][0] <= e and s <= life[u][1])
        best, best_gap, cursor = None, None, 0
        for lo, hi in spans:
            gap = lo - cursor
            if gap >= size[b] and (best_gap is None or gap < best_gap):
                best, best_gap = cursor, gap
            cursor = max(cursor, hi)
        offsets[b] = best if best is not None else cursor
        top = max(top, offsets[b] + size[b])
        placed.append(b)
    return offsets, top


def plan_memory(graph: Graph, sizes: dict[str, int]) -> MemoryPlan:
    """Plans every activation of `graph` for the largest step described by
    `sizes` (values of the shape symbols, e.g. {"T": 256, "O": 64})."""
    life = liveness(graph)
    nbytes = {t: _round_up(graph.tensors[t].nbytes(sizes)) for t in life}
    names = sorted(life, key=lambda n: (life[n][0], n))  # production order
    b_life = [life[t] for t in names]
    b_size = [nbytes[t] for t in names]
    by_time = list(range(len(names)))
    by_size = sorted(by_time, key=lambda i: (-b_size[i], b_life[i][0]))
    best = None
    for name, order in (("greedy-by-size", by_size), ("production-order", by_time)):
        offs, top = _place(order, b_life, b_size)
        if best is None or top < best[2]:
            best = (name, offs, top)
    strategy, offs, top = best
    offsets = {t: offs[i] for i, t in enumerate(names)}
    plan = MemoryPlan(offsets, nbytes, life, top, sum(nbytes.values()), dict(sizes), strategy)
    plan.check(graph)
    return plan
