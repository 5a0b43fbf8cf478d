"""FFN quantize: the down projection's int8 input made once, by a quantize
op split by groups, instead of by every thread in the matmul's input stage.

The gate/up matmul splits its output columns between threads (each thread's
SwiGLU values stay in its core's cache); the down projection's input stage
had every thread quantize all rows, half of them read from the other core.
The quantize op gives each thread the groups it wrote, and the projection
reads the int8 codes with the prequant prologue. Same codes, same bits.
(Quantizing inside the gate/up epilogue instead was measured slower: the
epilogue then held up the tile loop.)

Pattern: matmul(h, W_gate_up) -> a (SwiGLU epilogue; unfused: swiglu(g, u)
-> a), matmul(a, W_down) for every reader of a.
Legality: the readers are packed matmuls with int8 activations, no prologue,
one group G (G % 8 == 0); a stays written by gate/up and is read by the
quantize op only.
"""

from __future__ import annotations

from llamajet import ops
from llamajet.graph.ir import Graph
from llamajet.graph.passes._match import prequant_copy, quant_readers


def run(graph: Graph, ctx) -> list[str]:
    log = []
    for mm in [n for n in graph.nodes
               if n.op == "swiglu" or (n.op == "matmul" and n.attrs.get("epilogue") == ops.Epilogue.SWIGLU)]:
        a = mm.outputs["out"]
        qi = quant_readers(graph, a, ctx)
        if qi is None or qi.group % 8:
            continue
        readers = graph.consumers(a)
        aq = prequant_copy(graph, a, mm.name, qi)
        node = graph.add(f"{mm.name}.quantize", "quantize", {"x": a}, {"out": aq})
        graph.insert(graph.index(mm) + 1, node)
        log.append(f"ffn_quant: {mm.name} -> {qi} for {', '.join(r.name for r in readers)}")
    return log
