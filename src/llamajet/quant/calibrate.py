"""Calibration: run the model over calibration text and hand each linear
layer its inputs, layer after layer, so a method quantizes a layer seeing the
outputs of the layers it already quantized (GPTQ's sequential order).

The forward here is numpy (float32 matmuls, the model's own ops as
ops/ref.py defines them: RMSNorm, RoPE in the weights' pair order, causal
GQA attention, SwiGLU), over the canonical float weights (a GGUF's blocks
dequantized). It is the calibration path only: the engine's steps are not
touched, so ordinary inference pays nothing for it. Inside a layer the
order is "true sequential": q/k/v are quantized from the attention norm's
output, the attention output projection from the attention computed with
the quantized q/k/v, gate/up from the MLP norm's output after the quantized
attention block, down from the activation of the quantized gate/up.

    calibration_windows(tokenizer, text, n=128, length=512)  -> token windows
    sequential(model, windows, quantize_layer, progress)      -> {name: Weight}
where quantize_layer(names, W-list, H) returns (dequantized W-list, packed Weights).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from llamajet.errors import LlamajetError, UnsupportedModelError
from llamajet.ops import ref


def calibration_windows(tokenizer, text: str, n: int, length: int) -> list[list[int]]:
    """The first `n` non-overlapping windows of `length` tokens of `text` (BOS
    first when the model wants one)."""
    ids = tokenizer.encode(text[: n * length * 8], add_special_tokens=False)
    body = length - (1 if tokenizer.add_bos else 0)
    out = []
    for i in range(min(n, len(ids) // body)):
        w = ids[i * body:(i + 1) * body]
        out.append(([tokenizer.bos_id] if tokenizer.add_bos else []) + w)
    if not out:
        raise LlamajetError(f"calibration text too short for one window of {length} tokens")
    return out


def _rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    xf = x.astype(np.float32)
    r = 1.0 / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * r * w).astype(np.float32)


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, heads: int, kv_heads: int, hd: int) -> np.ndarray:
    """Causal GQA over one sequence: q [T, heads*hd], k/v [T, kv_heads*hd]."""
    T = q.shape[0]
    qh = q.reshape(T, kv_heads, heads // kv_heads, hd).transpose(1, 2, 0, 3)  # [kv, g, T, hd]
    kh = k.reshape(T, kv_heads, hd).transpose(1, 0, 2)                          # [kv, T, hd]
    vh = v.reshape(T, kv_heads, hd).transpose(1, 0, 2)
    s = np.einsum("kgtd,ksd->kgts", qh, kh, optimize=True) / np.float32(np.sqrt(hd))
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    o = np.einsum("kgts,ksd->kgtd", s.astype(np.float32), vh, optimize=True)
    return o.transpose(2, 0, 1, 3).reshape(T, heads * hd)


def _gram(x: np.ndarray) -> np.ndarray:
    """2 X^T X over every token of x [S, T, K] (float64)."""
    flat = x.reshape(-1, x.shape[-1])
    return 2.0 * (flat.T @ flat).astype(np.float64)


LayerQuantizer = Callable[[list[str], list[np.ndarray], np.ndarray], tuple[list[np.ndarray], dict]]


def sequential(model, windows: list[list[int]], quantize: LayerQuantizer,
               progress: Callable[[int, int], None] | None = None, hidden: list | None = None) -> dict:
    """Quantizes every decoder matrix of `model` in order (module docstring);
    returns {canonical name: packed Weight}. `hidden` (a list) receives the
    last layer's output [S, T, D] (for checking the forward)."""
    cfg, W = model.config, model.weights
    if cfg.attention_bias or cfg.mlp_bias:
        raise UnsupportedModelError("calibrated methods do not handle attention/MLP biases yet")
    H, KV, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    cos, sin = ref.rope_tables(cfg.rope_inv_freq(), max(len(w) for w in windows))
    pos = np.arange(len(windows[0]))
    emb = W["token_embd"].to_f32()
    h = np.stack([emb[np.asarray(w)] for w in windows]).astype(np.float32)  # [S, T, D]
    out: dict = {}

    def f32(name):
        return W[name].to_f32().astype(np.float32)

    for layer in range(cfg.num_layers):
        p = f"blk.{layer}."
        xa = _rmsnorm(h, f32(p + "attn_norm"), eps)
        names = [p + "attn_q", p + "attn_k", p + "attn_v"]
        (wq, wk, wv), packed = quantize(names, [f32(n) for n in names], _gram(xa))
        out.update(packed)
        att = np.empty((h.shape[0], h.shape[1], H * hd), np.float32)
        for s in range(h.shape[0]):
            q = ref.rope(xa[s] @ wq.T, pos, cos, sin, H, hd, W[p + "attn_q"].rope_interleaved)
            k = ref.rope(xa[s] @ wk.T, pos, cos, sin, KV, hd, W[p + "attn_k"].rope_interleaved)
            att[s] = _attention(q.astype(np.float32), k.astype(np.float32), (xa[s] @ wv.T).astype(np.float32),
                                H, KV, hd)
        (wo,), packed = quantize([p + "attn_output"], [f32(p + "attn_output")], _gram(att))
        out.update(packed)
        h = h + (att @ wo.T).astype(np.float32)
        del att, xa
        xm = _rmsnorm(h, f32(p + "ffn_norm"), eps)
        names = [p + "ffn_gate", p + "ffn_up"]
        (wg, wu), packed = quantize(names, [f32(n) for n in names], _gram(xm))
        out.update(packed)
        g = xm @ wg.T
        act = (g / (1.0 + np.exp(-g)) * (xm @ wu.T)).astype(np.float32)
        del g, xm
        (wd,), packed = quantize([p + "ffn_down"], [f32(p + "ffn_down")], _gram(act))
        out.update(packed)
        h = h + (act @ wd.T).astype(np.float32)
        del act
        if progress is not None:
            progress(layer + 1, cfg.num_layers)
    if hidden is not None:
        hidden.append(h)
    return out
