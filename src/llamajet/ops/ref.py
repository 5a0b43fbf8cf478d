"""Numpy reference of every op: the spec the C++ kernels are tested against.

Plain float64 numpy, written for clarity, not speed. Shapes follow the
kernels: activations [tokens, features]; matrices [N_out, K_in].
"""

from __future__ import annotations

import numpy as np

QK = 32  # elements per GGML block


# ------------------------------------------------------------------ storage


def dequantize(raw: np.ndarray, dtype: str, shape: tuple[int, int]) -> np.ndarray:
    """Raw storage of a [N, K] matrix (or [K] vector) -> float64 values."""
    n = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    k = shape[-1]
    raw = np.ascontiguousarray(raw)
    if dtype == "f32":
        out = raw.view(np.float32).astype(np.float64)
    elif dtype == "f16":
        out = raw.view(np.float16).astype(np.float64)
    elif dtype == "bf16":
        out = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    elif dtype in ("q8_0", "q4_0", "q4_1"):
        bb = {"q8_0": 34, "q4_0": 18, "q4_1": 20}[dtype]
        blocks = raw.view(np.uint8).reshape(n * (k // QK), bb)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float64)  # [nb, 1]
        if dtype == "q8_0":
            q = blocks[:, 2:].copy().view(np.int8).astype(np.float64)
            out = d * q
        else:
            nib = blocks[:, bb - 16 :]
            q = np.concatenate([nib & 0x0F, nib >> 4], axis=1).astype(np.float64)  # elements 0..15, 16..31
            if dtype == "q4_0":
                out = d * (q - 8.0)
            else:
                m = blocks[:, 2:4].copy().view(np.float16).astype(np.float64)
                out = d * q + m
    else:
        raise ValueError(f"unknown storage type {dtype!r}")
    return out.reshape(shape)


# ------------------------------------------------------------------ ops


def embed(table: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    return table[np.asarray(tokens)]


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def matmul(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """x [M, K] @ w[N, K]^T (+ bias [N]) -> [M, N]."""
    y = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    return y if bias is None else y + np.asarray(bias, np.float64).reshape(-1)


def rope_tables(inv_freq: np.ndarray, max_pos: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin of pos * inv_freq: [max_pos, hd/2] float64."""
    ang = np.outer(np.arange(max_pos, dtype=np.float64), np.asarray(inv_freq, np.float64))
    return np.cos(ang), np.sin(ang)


def rope(x: np.ndarray, positions, cos: np.ndarray, sin: np.ndarray, heads: int, hd: int,
         interleaved: bool) -> np.ndarray:
    """Rotate pairs of x [T, heads*hd]: (j, j+hd/2) (HF) or (2j, 2j+1) (GGUF order)."""
    x = np.asarray(x, np.float64).reshape(len(positions), heads, hd)
    c = cos[np.asarray(positions)][:, None, :]
    s = sin[np.asarray(positions)][:, None, :]
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x[..., : hd // 2], x[..., hd // 2 :]
    ra, rb = a * c - b * s, b * c + a * s
    out = np.empty_like(x)
    if interleaved:
        out[..., 0::2], out[..., 1::2] = ra, rb
    else:
        out[..., : hd // 2], out[..., hd // 2 :] = ra, rb
    return out.reshape(len(positions), heads * hd)


def k_pool_from_rows(rows: np.ndarray, kv_heads: int, hd: int, block_size: int) -> np.ndarray:
    """An fp32 / fp16 K pool's storage from its rows [slots, kv_heads*hd]: each block
    of block_size slots holds, per kv head, a [hd][block_size] K^T tile
    (csrc/kernels/attention.inc). Same shape and size as `rows`."""
    n, kvd = rows.shape
    return np.ascontiguousarray(rows.reshape(n // block_size, block_size, kv_heads, hd)
                                .transpose(0, 2, 3, 1).reshape(n, kvd))


def k_pool_rows(pool: np.ndarray, kv_heads: int, hd: int, block_size: int) -> np.ndarray:
    """Inverse of k_pool_from_rows: the rows [slots, kv_heads*hd] of an fp32 / fp16 K pool."""
    n, kvd = pool.shape
    return pool.reshape(n // block_size, kv_heads, hd, block_size).transpose(0, 3, 1, 2).reshape(n, kvd)


def k_pool_from_rows_i8(rows: np.ndarray, kv_heads: int, hd: int, block_size: int) -> np.ndarray:
    """An int8 K pool's storage (uint8 [slots, kv_heads*(hd+4)]) from its rows of
    per-head records (fp32 scale, hd codes): each block holds, per kv head, the
    [hd][block_size] tile of codes, then the block_size scales
    (csrc/kernels/attention.inc). Same shape and size as `rows`."""
    n = rows.shape[0]
    r = np.ascontiguousarray(rows).reshape(n // block_size, block_size, kv_heads, hd + 4)
    codes = r[..., 4:].transpose(0, 2, 3, 1).reshape(n // block_size, kv_heads, hd * block_size)
    scales = r[..., :4].transpose(0, 2, 1, 3).reshape(n // block_size, kv_heads, 4 * block_size)
    return np.ascontiguousarray(np.concatenate([codes, scales], axis=-1).reshape(rows.shape))


def k_pool_rows_i8(pool: np.ndarray, kv_heads: int, hd: int, block_size: int) -> np.ndarray:
    """Inverse of k_pool_from_rows_i8: the per-head records of every slot."""
    n = pool.shape[0]
    p = np.ascontiguousarray(pool).reshape(n // block_size, kv_heads, (hd + 4) * block_size)
    codes = p[..., : hd * block_size].reshape(-1, kv_heads, hd, block_size).transpose(0, 3, 1, 2)
    scales = p[..., hd * block_size :].reshape(-1, kv_heads, block_size, 4).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(np.concatenate([scales, codes], axis=-1).reshape(pool.shape))


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions, heads: int, kv_heads: int,
              hd: int, scale: float) -> np.ndarray:
    """Causal GQA for one sequence. q [T, heads*hd] at `positions`; k, v [L, kv_heads*hd]
    hold the sequence's keys/values for positions 0..L-1. Token t sees 0..positions[t]."""
    T = len(positions)
    q = np.asarray(q, np.float64).reshape(T, heads, hd)
    k = np.asarray(k, np.float64).reshape(-1, kv_heads, hd)
    v = np.asarray(v, np.float64).reshape(-1, kv_heads, hd)
    group = heads // kv_heads
    out = np.zeros((T, heads, hd))
    for t, p in enumerate(positions):
        for h in range(heads):
            s = k[: p + 1, h // group] @ q[t, h] * scale
            e = np.exp(s - s.max())
            out[t, h] = (e / e.sum()) @ v[: p + 1, h // group]
    return out.reshape(T, heads * hd)


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    g = np.asarray(gate, np.float64)
    return g / (1.0 + np.exp(-g)) * up


def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float64) + b


def gather(x: np.ndarray, rows) -> np.ndarray:
    return np.asarray(x)[np.asarray(rows)]
