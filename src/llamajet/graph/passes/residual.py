"""Residual pass: a projection followed by the residual add writes x + W a
directly (the add moves into the matmul's epilogue): o-proj and down-proj.

Pattern: matmul(a, W) -> o, add(x, o) -> r.
Legality: o is read only by the add; same shape; x is produced before the
matmul (so the fused node, in the matmul's place, creates no cycle).
"""

from __future__ import annotations

from llamajet.graph.ir import Graph
from llamajet.graph.passes._match import index, only_consumer


def run(graph: Graph, ctx) -> list[str]:
    log = []
    for add in [n for n in graph.nodes if n.op == "add"]:
        prod = graph.producers()
        for i in (1, 0):  # which input of the add is the projection
            o, x = add.inputs[i], add.inputs[1 - i]
            mm = prod.get(o)
            if mm is None or mm.op != "matmul" or mm.attrs.get("epilogue", "store") != "store":
                continue
            if only_consumer(graph, o) is not add or graph.tensors[o].shape != graph.tensors[add.outputs[0]].shape:
                continue
            px = prod.get(x)
            if px is not None and index(graph, px) > index(graph, mm):
                continue  # the residual would be produced after the matmul: a cycle
            r = add.outputs[0]
            graph.nodes.remove(add)
            del graph.tensors[o]
            mm.outputs = [r]
            mm.inputs = mm.inputs + [x]
            mm.attrs.update(epilogue="residual", res=x)
            log.append(f"residual: {mm.name} + {add.name} -> {mm.name} (+{x})")
            break
    return log
