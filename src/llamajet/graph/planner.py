"""Activation memory planning: liveness -> offsets in one arena.

Every activation lives from the node that produces it to the last node that
reads it (graph outputs live to the end). Tensors are placed in production
order, each in the smallest free gap among the tensors still live (best fit),
else on top. A tensor whose last reader is node j can be reused from node
j+1 on, never by node j's own outputs: kernels read their inputs while they
write their outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

from llamajet.graph.ir import Graph

ALIGN = 64  # bytes; cache-line aligned so no two tensors share a line


@dataclass(frozen=True)
class MemoryPlan:
    offsets: dict[str, int]    # activation -> byte offset in the arena
    sizes: dict[str, int]      # activation -> bytes (largest step)
    lifetimes: dict[str, tuple[int, int]]  # activation -> (first node, last node)
    arena_bytes: int
    naive_bytes: int           # sum of all activation sizes (no reuse)

    def check(self) -> None:
        """Proves no two tensors that are live at the same node overlap."""
        names = sorted(self.offsets, key=lambda t: self.offsets[t])
        for i, a in enumerate(names):
            a0, a1 = self.offsets[a], self.offsets[a] + self.sizes[a]
            for b in names[i + 1 :]:
                b0 = self.offsets[b]
                if b0 >= a1:
                    break  # sorted by offset: nothing further overlaps a
                la, lb = self.lifetimes[a], self.lifetimes[b]
                if la[0] <= lb[1] and lb[0] <= la[1]:
                    raise AssertionError(f"live tensors {a} and {b} overlap in the arena")
                del b0


def _round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def plan_memory(graph: Graph, sizes: dict[str, int]) -> MemoryPlan:
    """Plans every activation of `graph` for the largest step described by
    `sizes` (values of the shape symbols, e.g. {"T": 256, "O": 64})."""
    end = len(graph.nodes)
    start: dict[str, int] = {}
    last: dict[str, int] = {}
    for idx, node in enumerate(graph.nodes):
        for t in node.outputs:
            if graph.tensors[t].kind == "activation":
                start[t] = idx
                last[t] = idx
        for t in node.inputs:
            if t in start:
                last[t] = idx
    for t in graph.outputs:
        last[t] = end
    nbytes = {t: _round_up(graph.tensors[t].nbytes(sizes)) for t in start}

    offsets: dict[str, int] = {}
    live: list[str] = []  # placed tensors not yet dead
    top = 0
    for t in sorted(start, key=lambda n: (start[n], n)):
        s = start[t]
        live = [u for u in live if last[u] >= s]
        # free gaps between live tensors, in address order
        spans = sorted((offsets[u], offsets[u] + nbytes[u]) for u in live)
        best, best_size, cursor = None, None, 0
        for lo, hi in spans:
            gap = lo - cursor
            if gap >= nbytes[t] and (best_size is None or gap < best_size):
                best, best_size = cursor, gap
            cursor = max(cursor, hi)
        offsets[t] = best if best is not None else cursor
        top = max(top, offsets[t] + nbytes[t])
        live.append(t)
    plan = MemoryPlan(offsets, nbytes, {t: (start[t], last[t]) for t in start}, top,
                      sum(nbytes.values()))
    plan.check()
    return plan
