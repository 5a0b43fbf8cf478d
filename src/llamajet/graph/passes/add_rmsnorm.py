"""Add + RMSNorm (+ quantize on write): r = x + d and h = rmsnorm(r) in one
pass over the row; and when every reader of h is a W*A8 matmul with the same
group, the norm also writes h as int8 rows with scales (once), so those
matmuls skip their own input stage.

Patterns: add(x, d) -> r, rmsnorm(r, w) -> h   (r stays: the residual stream)
          rmsnorm(x, w) -> h                     (quantize-on-write only)
Legality: the add's result feeds the norm (other readers keep reading r);
same shape; quantize-on-write only if all readers of h are packed matmuls
with int8 activations, no prologue and one group size (h, then read by
nobody, is not written at all).
"""

from __future__ import annotations

from llamajet.graph.ir import Graph
from llamajet.graph.passes._match import prequant_copy, quant_readers


def run(graph: Graph, ctx) -> list[str]:
    log = []
    for norm in [n for n in graph.nodes if n.op == "rmsnorm"]:
        x, w, h = norm.inputs["x"], norm.inputs["w"], norm.outputs["out"]
        add = graph.producer(x)
        fuse_add = add is not None and add.op == "add" and graph.tensors[add.outputs["out"]].shape == graph.tensors[h].shape
        qi = quant_readers(graph, h, ctx)
        if not fuse_add and qi is None:
            continue
        inputs = {"x": add.inputs["a"], "d": add.inputs["b"], "w": w} if fuse_add else {"x": x, "w": w}
        outs = {}
        pos = graph.index(add) if fuse_add else graph.index(norm)
        if qi is not None:
            outs["qout"] = prequant_copy(graph, h, norm.name, qi)
        if graph.consumers(h):
            outs["out"] = h
        else:
            del graph.tensors[h]
        if fuse_add:
            outs["sum"] = add.outputs["out"]
            graph.nodes.remove(add)
        graph.nodes.remove(norm)
        graph.insert(pos, graph.add(norm.name, "add_rmsnorm", inputs, outs, eps=norm.attrs["eps"]))
        what = ("add + " if fuse_add else "") + "rmsnorm" + (f" + {qi} on write" if qi else "")
        log.append(f"add_rmsnorm: {norm.name}: {what}")
    return log
