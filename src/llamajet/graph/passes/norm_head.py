"""Final norm + LM head: the RMSNorm of the output rows becomes the prologue of
the LM-head matmul (each thread normalizes the few output rows itself before
the input stage).

Pattern: rmsnorm(x, w) -> n, matmul(n, W) -> logits.
Legality: n is read only by that matmul; the matmul has no prologue yet.
"""

from __future__ import annotations

from llamajet.graph.ir import Graph
from llamajet.graph.passes._match import only_consumer


def run(graph: Graph, ctx) -> list[str]:
    log = []
    for norm in [n for n in graph.nodes if n.op == "rmsnorm" and n.name == "output_norm"]:
        nrm = norm.outputs[0]
        mm = only_consumer(graph, nrm)
        if mm is None or mm.op != "matmul" or mm.inputs[0] != nrm or mm.attrs.get("prologue", "none") != "none":
            continue
        x, w = norm.inputs
        graph.nodes.remove(norm)
        del graph.tensors[nrm]
        mm.inputs = [x] + mm.inputs[1:] + [w]
        mm.attrs.update(prologue="rmsnorm", norm_w=w, eps=norm.attrs["eps"])
        log.append(f"norm_head: {norm.name} -> prologue of {mm.name}")
    return log
