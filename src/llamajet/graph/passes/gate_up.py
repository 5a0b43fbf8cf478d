"""Gate/up pass: the feed-forward's gate and up projections and SwiGLU become
one matmul over gate and up rows alternating in 16-row tiles (packed once at
load) whose epilogue computes silu(gate) * up.

Pattern: matmul(h, Wg) -> g, matmul(h, Wu) -> u, swiglu(g, u) -> s.
Legality: same input; g and u read only by the swiglu; one storage kind and
K; F (rows of each) a whole number of 16-row tiles.
"""

from __future__ import annotations

from llamajet.graph.ir import Graph
from llamajet.graph.passes._match import index, interleave_tiles, only_consumer, same_kind
from llamajet.quant.schemes import TILE_ROWS


def run(graph: Graph, ctx) -> list[str]:
    log = []
    for sw in [n for n in graph.nodes if n.op == "swiglu"]:
        g, u = sw.inputs
        prod = graph.producers()
        mg, mu = prod.get(g), prod.get(u)
        if mg is None or mu is None or mg.op != "matmul" or mu.op != "matmul" or mg.attrs or mu.attrs:
            continue
        if mg.inputs[0] != mu.inputs[0] or only_consumer(graph, g) is not sw or only_consumer(graph, u) is not sw:
            continue
        wg, wu = graph.weights[mg.inputs[1]], graph.weights[mu.inputs[1]]
        if not same_kind([wg, wu]) or wg.shape != wu.shape or wg.shape[0] % TILE_ROWS:
            continue
        prefix = mg.name.rsplit(".", 1)[0]
        wname = f"{prefix}.ffn_gate_up"
        graph.weight(wname, interleave_tiles(wname, wg, wu))
        pos = min(index(graph, mg), index(graph, mu))
        for n in (mg, mu, sw):
            graph.nodes.remove(n)
        for t in (g, u):
            del graph.tensors[t]
        fused = graph.add(wname, "matmul", [mg.inputs[0], wname], [sw.outputs[0]], epilogue="swiglu")
        graph.nodes.remove(fused)
        graph.nodes.insert(pos, fused)
        log.append(f"gate_up: {mg.name} + {mu.name} + {sw.name} -> {wname}")
    return log
