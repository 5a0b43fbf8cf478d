"""Residual pass: a projection followed by the residual add writes x + W a
directly (the add moves into the matmul's epilogue): o-proj and down-proj.

Pattern: matmul(a, W) -> o, add(x, o) -> r.
Legality: o is read only by the add; same shape; the matmul has no epilogue
yet; x is produced before the matmul (so the fused node, in the matmul's
place, creates no cycle).
"""

from __future__ import annotations

from llamajet import ops
from llamajet.graph.ir import Graph
from llamajet.graph.passes._match import only_consumer


def run(graph: Graph, ctx) -> list[str]:
    log = []
    for add in [n for n in graph.nodes if n.op == "add"]:
        for f_o, f_x in (("b", "a"), ("a", "b")):  # which input of the add is the projection
            o, x = add.inputs[f_o], add.inputs[f_x]
            mm = graph.producer(o)
            if mm is None or mm.op != "matmul" or mm.attrs.get("epilogue", ops.Epilogue.STORE) != ops.Epilogue.STORE:
                continue
            if only_consumer(graph, o) is not add or graph.tensors[o].shape != graph.tensors[add.outputs["out"]].shape:
                continue
            px = graph.producer(x)
            if px is not None and graph.index(px) > graph.index(mm):
                continue  # the residual would be produced after the matmul: a cycle
            graph.nodes.remove(add)
            del graph.tensors[o]
            mm.outputs["out"] = add.outputs["out"]
            mm.inputs["residual"] = x
            mm.attrs["epilogue"] = ops.Epilogue.RESIDUAL
            log.append(f"residual: {mm.name} + {add.name} -> {mm.name} (+{x})")
            break
    return log
