"""QKV pass: the q, k and v projections of a block, their RoPE and the
KV-cache write become one matmul over [Wq; Wk; Wv] (stacked once, at load)
whose epilogue rotates q and k and writes k, v into the cache.

Pattern (per block): matmul(h, Wq) -> q, matmul(h, Wk) -> k, matmul(h, Wv) -> v,
rope(q) -> q_rot, rope(k) -> k_rot, kv_write(k_rot, v) -> kv.
Legality: the three matmuls read the same input; q, k, v, k_rot have no
consumer outside the pattern; the weights have one storage kind and K; q and
k columns are whole 16-column tiles and whole heads; the KV cache is fp32 or
fp16 (the epilogue writes those, converting like kv_write). Q/K rows in rotate-half order are permuted
to interleaved order when stacked, so the epilogue's RoPE pairs sit side by
side in every tile.
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
            rk, kvw = graph.node(f"{prefix}.rope_k"), graph.node(f"{prefix}.kv_write")
        except KeyError:
            continue
        if ctx.kv_dtype not in ("f32", "f16") or not all(m.op == "matmul" and not m.attrs for m in (mq, mk, mv)):
            continue
        h = mq.inputs[0]
        if mk.inputs[0] != h or mv.inputs[0] != h:
            continue
        q, k, v = mq.outputs[0], mk.outputs[0], mv.outputs[0]
        if (only_consumer(graph, q) is not rq or only_consumer(graph, k) is not rk
                or only_consumer(graph, v) is not kvw or only_consumer(graph, rk.outputs[0]) is not kvw):
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
        for n in (mq, mk, mv, rq, rk, kvw):
            graph.nodes.remove(n)
        for t in (q, k, v, rk.outputs[0]):
            del graph.tensors[t]
        fused = graph.add(wname, "matmul", [h, wname, cos, sin], [rq.outputs[0], kvw.outputs[0]],
                          epilogue="qkv", nq=nq, nk=nk, head_dim=hd, layer=kvw.attrs["layer"], cos=cos, sin=sin)
        graph.nodes.remove(fused)
        graph.nodes.insert(pos, fused)
        log.append(f"qkv: {prefix}.attn_q/k/v + rope_q/k + kv_write -> {wname} [{nq}+{nk}+{nk} cols]")
    return log
