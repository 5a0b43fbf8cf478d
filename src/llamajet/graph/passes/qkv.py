"""QKV pass: the q, k and v projections of a block and their RoPE become one
matmul over [Wq; Wk; Wv] (stacked once, at load) whose epilogue rotates q and
k: outputs q_rot, k_rot and v, as before the pass.

Pattern (per attention): matmul(h, Wq) -> q, matmul(h, Wk) -> k, matmul(h, Wv) -> v,
rope(q) -> q_rot, rope(k) -> k_rot, where kv_write(k_rot, v) feeds the
attention that reads q_rot (so q, k and v are told apart by their roles).
Legality: the three matmuls read the same input; q and k have no consumer
outside the pattern (k_rot and v keep theirs: the kv_write); the weights have
one storage kind and K; q and k columns are whole 16-column tiles and whole
heads. Q/K rows in rotate-half order are permuted to interleaved order when
stacked, so the epilogue's RoPE pairs sit side by side in every tile. Biases
(Qwen2's q/k/v) are stacked and permuted like their rows (a matmul without
one gets zeros), and the epilogue adds them before RoPE.

The KV-cache write stays a kv_write op on purpose: the epilogue once wrote
the cache itself, but a weight tile's epilogue covers every token of the
step, so one core wrote all the K rows (the fp16 K^T layout spreads a row
over hd / 2 lines per head, each a write miss) which the other core's
attention then read back; kv_write splits its rows like attention's work
items, so each core writes the rows it will read (measured at 16 decode
sequences, SmolLM2-135M: the K write cost the fused op 0.36 ms per step).
"""

from __future__ import annotations

from llamajet import ops
from llamajet.formats.stack import rope_interleave_rows, same_kind, stack_rows
from llamajet.graph.ir import Graph
from llamajet.graph.passes._match import biases, drop_unread_weights, only_consumer, plain_matmul


def run(graph: Graph, ctx) -> list[str]:
    log = []
    for kvw in [n for n in graph.nodes if n.op == "kv_write"]:
        prod = graph.producer
        atts = [n for n in graph.consumers(kvw.outputs["kv"]) if n.op == "attention"]
        if len(atts) != 1:
            continue
        rq, rk = prod(atts[0].inputs["q"]), prod(kvw.inputs["k"])
        if rq is None or rk is None or rq.op != "rope" or rk.op != "rope":
            continue
        q, k, v = rq.inputs["x"], rk.inputs["x"], kvw.inputs["v"]
        mq, mk, mv = prod(q), prod(k), prod(v)
        if not all(plain_matmul(m) for m in (mq, mk, mv)):
            continue
        h = mq.inputs["x"]
        if mk.inputs["x"] != h or mv.inputs["x"] != h:
            continue
        if only_consumer(graph, q) is not rq or only_consumer(graph, k) is not rk:
            continue
        if (rq.inputs["cos"], rq.inputs["sin"]) != (rk.inputs["cos"], rk.inputs["sin"]):
            continue
        ws = [graph.weights[m.inputs["w"]] for m in (mq, mk, mv)]
        hd, H, KVH = rq.attrs["head_dim"], rq.attrs["heads"], rk.attrs["heads"]
        nq, nk = ws[0].shape[0], ws[1].shape[0]
        if (not same_kind(ws) or nq % ops.TILE or nk % ops.TILE or ws[2].shape[0] != nk
                or nq != H * hd or nk != KVH * hd or rk.attrs["head_dim"] != hd):
            continue
        wname = f"{mq.name.rsplit('.', 1)[0]}.attn_qkv"
        bs = biases(graph, [mq, mk, mv], wname)
        parts = [ws] + ([bs] if bs else [])
        for p in parts:  # rows and their biases alike: interleaved RoPE pairs
            if not rq.attrs["interleaved"]:
                p[0] = rope_interleave_rows(p[0], H, hd)
            if not rk.attrs["interleaved"]:
                p[1] = rope_interleave_rows(p[1], KVH, hd)
        graph.weight(wname, stack_rows(wname, ws))
        ins = {"x": h, "w": wname, "cos": rq.inputs["cos"], "sin": rq.inputs["sin"]}
        if bs:
            ins["bias"] = graph.weight(f"{wname}.bias", stack_rows(f"{wname}.bias", bs))
        pos = graph.index(mq)
        for n in (mq, mk, mv, rq, rk):
            graph.nodes.remove(n)
        for t in (q, k):
            del graph.tensors[t]
        fused = graph.add(wname, "matmul", ins, {"out": rq.outputs["out"], "k_out": rk.outputs["out"], "v_out": v},
                          epilogue=ops.Epilogue.QKV, head_dim=hd)
        graph.insert(pos, fused)
        drop_unread_weights(graph, [m.inputs[k] for m in (mq, mk, mv) for k in ("w", "bias") if k in m.inputs])
        log.append(f"qkv: {mq.name} + {mk.name} + {mv.name} + {rq.name} + {rk.name} -> {wname} "
                   f"[{nq}+{nk}+{nk} cols]")
    return log
