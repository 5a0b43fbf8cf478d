"""The Llama-3 forward pass as a graph of named ops, and Llama's tensor spec.

Reads like the paper: per block,
    h = x + o_proj(attention(rope(q_proj(norm(x))), rope(k_proj(...)), v_proj(...)))
    x = h + down(silu(gate(norm(h))) * up(norm(h)))
then the final norm and the LM head on the rows whose logits are wanted. A
projection adds its bias where the checkpoint has one (Llama's attention_bias
/ mlp_bias; Qwen2's q/k/v, model/qwen2.py). Nothing here runs: it only
describes. Names follow GGUF (``blk.3.attn_q``); operands are named by the
fields of each op's params struct (graph/ir.py).
"""

from __future__ import annotations

import numpy as np

from llamajet.config import ModelConfig
from llamajet.formats.weight import Kind, float_weight
from llamajet.graph.ir import Graph
from llamajet.model.registry import register
from llamajet.model.spec import ArchSpec, decoder_tensors
from llamajet.ops import ref


def rope_tables(cfg: ModelConfig, max_pos: int):
    """cos/sin of position * inv_freq, [max_pos, head_dim/2] fp32 tables.

    Angles are formed in float64 (ops/ref.py) and rounded once, so positions in
    the thousands keep full fp32 accuracy (HF forms them in fp32; the
    difference is below fp32 resolution of the rotated values, ~1e-7 relative)."""
    cos, sin = ref.rope_tables(cfg.rope_inv_freq(), max_pos)
    return float_weight("rope_cos", Kind.TABLE, cos), float_weight("rope_sin", Kind.TABLE, sin)


def build_graph(cfg: ModelConfig, weights: dict, max_pos: int) -> Graph:
    """The whole-step graph for any mix of prefill and decode tokens.

    `weights` maps canonical names to loaded weights; `max_pos` sizes the
    RoPE tables (the longest context this engine will serve)."""
    g = Graph()
    D, F = cfg.hidden_size, cfg.intermediate_size
    H, KVH, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    cos, sin = rope_tables(cfg, max_pos)
    g.weight(cos.name, cos)
    g.weight(sin.name, sin)

    def w(name: str) -> str:
        return g.weight(name, weights[name])

    def act(name: str, *shape) -> str:
        return g.tensor(name, shape)

    def matmul(name: str, x: str, weight: str, out: str) -> None:
        ins = {"x": x, "w": w(weight)}
        if f"{weight}.bias" in weights:
            ins["bias"] = w(f"{weight}.bias")
        g.add(name, "matmul", ins, {"out": out})

    tokens = g.tensor("tokens", ("T",), "i32", kind="input")
    x = act("embd", "T", D)
    g.add("token_embd", "embed", {"table": w("token_embd"), "tokens": tokens}, {"out": x})

    for i in range(cfg.num_layers):
        p = f"blk.{i}"
        # -- attention
        h = act(f"{p}.attn_norm.out", "T", D)
        g.add(f"{p}.attn_norm", "rmsnorm", {"x": x, "w": w(f"{p}.attn_norm")}, {"out": h}, eps=cfg.rms_norm_eps)
        q = act(f"{p}.attn_q.out", "T", H * hd)
        k = act(f"{p}.attn_k.out", "T", KVH * hd)
        v = act(f"{p}.attn_v.out", "T", KVH * hd)
        for proj, out in (("attn_q", q), ("attn_k", k), ("attn_v", v)):
            matmul(f"{p}.{proj}", h, f"{p}.{proj}", out)
        qr = act(f"{p}.rope_q.out", "T", H * hd)
        kr = act(f"{p}.rope_k.out", "T", KVH * hd)
        for name, src, dst, heads, wn in (("rope_q", q, qr, H, "attn_q"), ("rope_k", k, kr, KVH, "attn_k")):
            g.add(f"{p}.{name}", "rope", {"x": src, "cos": cos.name, "sin": sin.name}, {"out": dst},
                  heads=heads, head_dim=hd, interleaved=weights[f"{p}.{wn}"].rope_interleaved)
        kv = g.tensor(f"{p}.kv", (), kind="state")  # orders the cache write before attention
        g.add(f"{p}.kv_write", "kv_write", {"k": kr, "v": v}, {"kv": kv}, layer=i, kv_heads=KVH, head_dim=hd)
        a = act(f"{p}.attn.out", "T", H * hd)
        g.add(f"{p}.attn", "attention", {"q": qr, "kv": kv}, {"out": a}, layer=i, heads=H, kv_heads=KVH,
              head_dim=hd, scale=1.0 / float(np.sqrt(hd)))
        o = act(f"{p}.attn_output.out", "T", D)
        matmul(f"{p}.attn_output", a, f"{p}.attn_output", o)
        x_attn = act(f"{p}.attn_residual.out", "T", D)
        g.add(f"{p}.attn_residual", "add", {"a": x, "b": o}, {"out": x_attn})
        # -- feed-forward (SwiGLU)
        h2 = act(f"{p}.ffn_norm.out", "T", D)
        g.add(f"{p}.ffn_norm", "rmsnorm", {"x": x_attn, "w": w(f"{p}.ffn_norm")}, {"out": h2}, eps=cfg.rms_norm_eps)
        gate = act(f"{p}.ffn_gate.out", "T", F)
        up = act(f"{p}.ffn_up.out", "T", F)
        matmul(f"{p}.ffn_gate", h2, f"{p}.ffn_gate", gate)
        matmul(f"{p}.ffn_up", h2, f"{p}.ffn_up", up)
        s = act(f"{p}.ffn_swiglu.out", "T", F)
        g.add(f"{p}.ffn_swiglu", "swiglu", {"gate": gate, "up": up}, {"out": s})
        d = act(f"{p}.ffn_down.out", "T", D)
        matmul(f"{p}.ffn_down", s, f"{p}.ffn_down", d)
        x_out = act(f"{p}.ffn_residual.out", "T", D)
        g.add(f"{p}.ffn_residual", "add", {"a": x_attn, "b": d}, {"out": x_out})
        x = x_out

    # -- head: only the rows whose logits are wanted (the last token of each
    # sequence while generating; every row when scoring)
    xo = act("output_gather.out", "O", D)
    g.add("output_gather", "gather", {"x": x}, {"out": xo})
    n = act("output_norm.out", "O", D)
    g.add("output_norm", "rmsnorm", {"x": xo, "w": w("output_norm")}, {"out": n}, eps=cfg.rms_norm_eps)
    head = "output" if "output" in weights else "token_embd"  # tied embeddings
    logits = act("logits", "O", cfg.vocab_size)
    matmul("output", n, head, logits)
    # greedy ids: each logits row's argmax, made by the step's threads (numpy's
    # argmax over 16 rows of 49152 logits took 0.17-0.20 ms, single-threaded)
    greedy = g.tensor("greedy", ("O",), "i32")
    g.add("output_argmax", "argmax", {"x": logits}, {"out": greedy})
    g.outputs += [logits, greedy]
    g.verify()
    return g


LLAMA = register(ArchSpec(
    "llama",
    decoder_tensors(qkv_bias=lambda c: c.attention_bias, o_bias=lambda c: c.attention_bias,
                    mlp_bias=lambda c: c.mlp_bias),
    build_graph,
    gguf_rope_interleaved=True,  # llama.cpp's converter permutes q/k rows to interleaved pairs
    # rotary buffers some HF checkpoints carry; llama.cpp's precomputed llama3
    # RoPE divisors (ModelConfig.rope_freq_factors): config, not weights
    ignored=("model.layers.{i}.self_attn.rotary_emb.inv_freq", "rope_freqs.weight"),
))
