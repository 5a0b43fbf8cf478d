"""Attention + quantize on write: when every reader of an attention output is
a W*A8 matmul with one group size dividing head_dim (the o projection), the
attention kernel also writes each finished head row as int8 codes with
scales, and the projection skips its own input stage: it no longer has every
thread quantize all rows of the attention output, half of them written by the
other core.

Pattern: attention(q, kv) -> a, matmul(a, W) for every reader of a.
Legality: the readers are packed matmuls with int8 activations, no prologue,
one group G with head_dim % G == 0 and G % 8 == 0 (whole groups inside a head,
so per-head quantization is the row's own), and the values under one scale
(G, or the K-quants' 256) inside a head too: a Q4_K o projection of 64- or
128-wide heads quantizes its own input; a stays written (the kernel's float
output) but nobody reads it.
"""

from __future__ import annotations

from llamajet.graph.ir import Graph
from llamajet.graph.passes._match import prequant_copy, quant_readers


def run(graph: Graph, ctx) -> list[str]:
    log = []
    for att in [n for n in graph.nodes if n.op == "attention"]:
        a = att.outputs["out"]
        qi = quant_readers(graph, a, ctx)
        if qi is None or att.attrs["head_dim"] % qi.span or qi.group % 8:
            continue
        att.outputs["qout"] = prequant_copy(graph, a, att.name, qi)
        log.append(f"attn_quant: {att.name}: {qi} on write")
    return log
