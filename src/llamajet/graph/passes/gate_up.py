"""Gate/up pass: the feed-forward's gate and up projections and SwiGLU become
one matmul over gate and up rows alternating in 16-row tiles (packed once at
load) whose epilogue computes silu(gate) * up.

Pattern: matmul(h, Wg) -> g, matmul(h, Wu) -> u, swiglu(g, u) -> s.
Legality: same input; g and u read only by the swiglu; one storage kind and
K; F (rows of each) a whole number of 16-row tiles. Biases (Llama's
mlp_bias) are interleaved like their rows.
"""

from __future__ import annotations

from llamajet import ops
from llamajet.formats.stack import interleave_tiles, same_kind
from llamajet.graph.ir import Graph
from llamajet.graph.passes._match import biases, drop_unread_weights, only_consumer, plain_matmul


def run(graph: Graph, ctx) -> list[str]:
    log = []
    for sw in [n for n in graph.nodes if n.op == "swiglu"]:
        g, u = sw.inputs["gate"], sw.inputs["up"]
        mg, mu = graph.producer(g), graph.producer(u)
        if not plain_matmul(mg) or not plain_matmul(mu) or mg.inputs["x"] != mu.inputs["x"]:
            continue
        if only_consumer(graph, g) is not sw or only_consumer(graph, u) is not sw:
            continue
        wg, wu = graph.weights[mg.inputs["w"]], graph.weights[mu.inputs["w"]]
        if not same_kind([wg, wu]) or wg.shape != wu.shape or wg.shape[0] % ops.TILE:
            continue
        wname = f"{mg.name.rsplit('.', 1)[0]}.ffn_gate_up"
        graph.weight(wname, interleave_tiles(wname, wg, wu))
        ins = {"x": mg.inputs["x"], "w": wname}
        bs = biases(graph, [mg, mu], wname)
        if bs:
            ins["bias"] = graph.weight(f"{wname}.bias", interleave_tiles(f"{wname}.bias", *bs))
        pos = min(graph.index(mg), graph.index(mu))
        for n in (mg, mu, sw):
            graph.nodes.remove(n)
        for t in (g, u):
            del graph.tensors[t]
        fused = graph.add(wname, "matmul", ins, {"out": sw.outputs["out"]},
                          epilogue=ops.Epilogue.SWIGLU)
        graph.insert(pos, fused)
        drop_unread_weights(graph, [m.inputs[k] for m in (mg, mu) for k in ("w", "bias") if k in m.inputs])
        log.append(f"gate_up: {mg.name} + {mu.name} + {sw.name} -> {wname}")
    return log
