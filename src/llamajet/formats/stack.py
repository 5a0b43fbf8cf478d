"""Tile stacking for fused weights: the layouts the fusion passes ask for.

- stack_rows: [W0; W1; ...] along N (QKV);
- interleave_tiles: gate and up rows alternating in 16-row tiles (gate/up);
- rope_interleave_rows: q/k rows from rotate-half to interleaved RoPE order.
"""

from __future__ import annotations

import numpy as np

from llamajet import ops
from llamajet.quant.pack import PackedWeight, pack, unpack


def _row_view(w) -> np.ndarray:
    """Raw storage of a row-major weight as [N, row bytes] uint8."""
    return np.ascontiguousarray(w.data).view(np.uint8).reshape(w.shape[0], -1)


def _raw(name: str, like, rows: np.ndarray, n: int, rope_interleaved: bool):
    """A WeightTensor of `like`'s storage type over raw row bytes [n, row bytes]."""
    from llamajet.loaders import STORAGE_DTYPE, WeightTensor

    data = rows.view(STORAGE_DTYPE[like.dtype]).reshape(n, -1)
    return WeightTensor(name, like.dtype, (n, like.shape[1]), data, rope_interleaved=rope_interleaved)


def same_kind(ws) -> bool:
    """Weights whose rows can be stacked into one matrix: same storage type,
    same K, and for packed ones the same scheme."""
    w0 = ws[0]
    return all(w.dtype == w0.dtype and w.shape[1] == w0.shape[1] and
               getattr(w, "scheme", None) == getattr(w0, "scheme", None) for w in ws)


def stack_rows(name: str, ws):
    """[W0; W1; ...] along N (each N a multiple of 16 for packed ones: whole tiles)."""
    n = sum(w.shape[0] for w in ws)
    if ws[0].packed:
        data = np.concatenate([w.data for w in ws], axis=0)
        return PackedWeight(name, ws[0].scheme, (n, ws[0].shape[1]), data, rope_interleaved=True)
    return _raw(name, ws[0], np.concatenate([_row_view(w) for w in ws], axis=0), n, rope_interleaved=True)


def interleave_tiles(name: str, g, u):
    """Gate and up rows alternating in 16-row tiles: [g0..15, u0..15, g16..31, ...]."""
    n = 2 * g.shape[0]
    if g.packed:
        data = np.stack([g.data, u.data], axis=1).reshape(-1, *g.data.shape[1:])
        return PackedWeight(name, g.scheme, (n, g.shape[1]), data)
    gr, ur = _row_view(g), _row_view(u)
    rows = np.stack([gr.reshape(-1, ops.TILE, gr.shape[1]), ur.reshape(-1, ops.TILE, ur.shape[1])], axis=1)
    return _raw(name, g, rows.reshape(n, -1), n, rope_interleaved=False)


def rope_interleave_rows(w, heads: int, hd: int):
    """Rows of a q/k projection from rotate-half order (pairs j, j + hd/2) to
    interleaved order (pairs 2j, 2j+1): row 2j <- j, row 2j+1 <- j + hd/2 within
    each head. q.k is unchanged when q and k are permuted alike."""
    if getattr(w, "rope_interleaved", False):
        return w
    perm = np.arange(heads * hd).reshape(heads, 2, hd // 2).transpose(0, 2, 1).reshape(-1)
    if w.packed:
        codes, d, m = unpack(w)
        n = w.shape[0]
        codes, d = codes.copy(), d.copy()
        codes[:n], d[:n] = codes[:n][perm], d[:n][perm]
        if m is not None:
            m = m.copy()
            m[:n] = m[:n][perm]
        pw = pack(w.name, w.scheme, w.shape, codes, d, m)
        return PackedWeight(pw.name, pw.scheme, pw.shape, pw.data, rope_interleaved=True)
    return _raw(w.name, w, _row_view(w)[perm], w.shape[0], rope_interleaved=True)
