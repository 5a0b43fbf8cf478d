"""QKV pass: the q, k and v projections of a block and their RoPE become one
matmul over [Wq; Wk; Wv] (stacked once, at load) whose epilogue rotates q and
k: outputs q_rot, k_rot and v, as before the pass.

Pattern (per block): matmul(h, Wq) -> q, matmul(h, Wk) -> k, matmul(h, Wv) -> v,
rope(q) -> q_rot, rope(k) -> k_rot.
Legality: the three matmuls read the same input; q and k have no consumer
outside the pattern (k_rot and v keep theirs: the kv_write); the weights have
one storage kind and K; q and k columns are whole 16-column tiles and whole
heads. Q/K rows in rotate-half order are permuted to interleaved order when
stacked, so the epilogue's RoPE pairs sit side by side in every tile.

The KV-cache write stays a kv_write op on purpose: the epilogue once wrote
the cache itself, but a weight tile's epilogue covers every token of the
step, so one core wrote all the K rows (the fp16 K^T layout spreads a row
over hd / 2 lines per head, each a write miss) which the other core's
attention then read back; kv_write splits its rows like attention's work
items, so each core writes the rows it will read (measured at 16 decode
sequences, SmolLM2-135M: the K write cost the fused op 0.36 ms per step).
"""

from __future__ import annotations

from llamajet.graph.ir import Graph
from llamajet.graph.passes._match import index, only_consumer, rope_interleave_rows, same_kind, stack_rows
from llamajet.quant.schemes import TILE_ROWS


def run(graph: Graph, ctx) -> list[str]:
    log = []
    for rq in [n for n in graph.nodes if n.op == "rope" and n.name.endswith(".rope_q")]:
        prefix = rq.name[: -len(".rope_q")]
        try:
            mq, mk, mv = (graph.node(f"{prefix}.attn_{p}") for p in "qkv")
            rk = graph.node(f"{prefix}.rope_k")
        except KeyError:
            continue
        if not all(m.op == "matmul" and not m.attrs for m in (mq, mk, mv)):
            continue
        h = mq.inputs[0]
        if mk.inputs[0] != h or mv.inputs[0] != h:
            continue
        q, k, v = mq.outputs[0], mk.outputs[0], mv.outputs[0]
        if only_consumer(graph, q) is not rq or only_consumer(graph, k) is not rk:
            continue
        ws = [graph.weights[m.inputs[1]] for m in (mq, mk, mv)]
        hd, H, KVH = rq.attrs["head_dim"], rq.attrs["heads"], rk.attrs["heads"]
        nq, nk = ws[0].shape[0], ws[1].shape[0]
        if not same_kind(ws) or nq % TILE_ROWS or nk % TILE_ROWS or ws[2].shape[0] != nk:
            continue
        wq = rope_interleave_rows(ws[0], H, hd)
        wk = rope_interleave_rows(ws[1], KVH, hd)
        wname = f"{prefix}.attn_qkv"
        graph.weight(wname, stack_rows(wname, [wq, wk, ws[2]]))
        pos = index(graph, mq)
        cos, sin = rq.inputs[1], rq.inputs[2]
        for n in (mq, mk, mv, rq, rk):
            graph.nodes.remove(n)
        for t in (q, k):
            del graph.tensors[t]
        fused = graph.add(wname, "matmul", [h, wname, cos, sin], [rq.outputs[0], rk.outputs[0], v],
                          epilogue="qkv", nq=nq, nk=nk, head_dim=hd, cos=cos, sin=sin)
        graph.nodes.remove(fused)
        graph.nodes.insert(pos, fused)
        log.append(f"qkv: {prefix}.attn_q/k/v + rope_q/k -> {wname} [{nq}+{nk}+{nk} cols]")
    return log
