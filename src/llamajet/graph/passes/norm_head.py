"""Final norm + LM head: the RMSNorm of the output rows becomes the prologue of
the LM-head matmul (each thread normalizes the few output rows itself before
the input stage).

Pattern: rmsnorm(x, w) -> n, matmul(n, W) -> logits, logits a graph output.
Legality: n is read only by that matmul; the matmul has nothing fused yet;
not with FusionContext.prequant_head (the norm then quantizes on write, as
every other norm, and the head reads that: passes/outliers.py).
"""

from __future__ import annotations

from llamajet import ops
from llamajet.graph.ir import Graph
from llamajet.graph.passes._match import only_consumer, plain_matmul


def run(graph: Graph, ctx) -> list[str]:
    log = []
    if ctx.prequant_head:
        return log
    for norm in [n for n in graph.nodes if n.op == "rmsnorm"]:
        nrm = norm.outputs["out"]
        mm = only_consumer(graph, nrm)
        if not plain_matmul(mm) or mm.inputs["x"] != nrm or mm.outputs["out"] not in graph.outputs:
            continue
        graph.nodes.remove(norm)
        del graph.tensors[nrm]
        mm.inputs.update(x=norm.inputs["x"], norm_w=norm.inputs["w"])
        mm.attrs.update(prologue=ops.Prologue.RMSNORM, eps=norm.attrs["eps"])
        log.append(f"norm_head: {norm.name} -> prologue of {mm.name}")
    return log
