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
from llamajet.graph.passes._match import index, prequant_copy, quant_readers


def run(graph: Graph, ctx) -> list[str]:
    log = []
    for norm in [n for n in graph.nodes if n.op == "rmsnorm"]:
        x, w = norm.inputs
        h = norm.outputs[0]
        prod = graph.producers()
        add = prod.get(x)
        fuse_add = add is not None and add.op == "add" and graph.tensors[add.outputs[0]].shape == graph.tensors[h].shape
        group = quant_readers(graph, h, ctx)
        if not fuse_add and group is None:
            continue
        inputs, outs = ([add.inputs[0], add.inputs[1], w] if fuse_add else [x, w]), {}
        name = norm.name
        pos = index(graph, add) if fuse_add else index(graph, norm)
        if group is not None:
            outs["q"] = prequant_copy(graph, h, name, group)
        if graph.consumers(h):
            outs["h"] = h
        else:
            del graph.tensors[h]
        if fuse_add:
            outs["r"] = add.outputs[0]
            graph.nodes.remove(add)
        graph.nodes.remove(norm)
        fused = graph.add(name, "add_rmsnorm", inputs, [t for t in (outs.get("h"), outs.get("r"), outs.get("q")) if t],
                          eps=norm.attrs["eps"], has_add=fuse_add, group=group or 0, outs=outs)
        graph.nodes.remove(fused)
        graph.nodes.insert(pos, fused)
        what = ("add + " if fuse_add else "") + "rmsnorm" + (f" + int8 g{group} on write" if group else "")
        log.append(f"add_rmsnorm: {name}: {what}")
    return log
