"""Tile stacking for fused weights: the layouts the fusion passes ask for.

- stack_rows: [W0; W1; ...] along N (QKV), biases alike;
- interleave_tiles: gate and up rows alternating in 16-row tiles (gate/up);
- rope_interleave_rows: q/k rows from rotate-half to interleaved RoPE order.
Each works on any storage format (float and GGML rows, packed tiles) and on
bias vectors, which follow their matrix's rows. Parts not yet written
(formats/pending.py) stay unwritten: their fills are pointed at the stack.
"""

from __future__ import annotations

import numpy as np

from llamajet import ops
from llamajet.formats import pages
from llamajet.formats.packed import pack_parts, unpack_parts
from llamajet.formats.pending import restack, written
from llamajet.formats.weight import Weight


def _rows(w: Weight) -> np.ndarray:
    """Raw storage of a row-major weight as [N, row bytes] uint8 (a vector: [N, 4])."""
    return np.ascontiguousarray(w.data).view(np.uint8).reshape(w.shape[0], -1)


def _from_rows(name: str, like: Weight, rows: np.ndarray, n: int, rope_interleaved: bool) -> Weight:
    data = rows.view(like.format.np_dtype).reshape(n, -1) if len(like.shape) > 1 else rows.view(np.float32).reshape(n)
    return like.with_data(name, like.format, (n, *like.shape[1:]), data, rope_interleaved)


def saved_whole(ws, layout: str) -> np.ndarray | None:
    """The storage of the fused tensor a saved model holds `ws` in (formats/saved.py:
    every part, in order, of one whole saved with `layout`), or None."""
    s0 = ws[0].stacked
    if s0 is None:
        return None
    for i, w in enumerate(ws):
        if w.stacked is None or w.stacked[0] is not s0[0] or w.stacked[1:] != (layout, i, len(ws)):
            return None
    return s0[0]


def same_kind(ws) -> bool:
    """Weights whose rows can be stacked into one matrix: same format and K."""
    w0 = ws[0]
    return all(w.format == w0.format and w.shape[1:] == w0.shape[1:] for w in ws)


def stack_rows(name: str, ws, rope_interleaved: bool = True) -> Weight:
    """[W0; W1; ...] along N (each N a multiple of 16 for packed ones: whole tiles)."""
    n = sum(w.shape[0] for w in ws)
    whole = saved_whole(ws, "rows")
    if whole is not None:  # saved stacked: the file's bytes as they are
        return Weight(name, ws[0].kind, ws[0].format, (n, ws[0].shape[1]), whole, rope_interleaved)
    if ws[0].packed:
        shape = (sum(w.data.shape[0] for w in ws), *ws[0].data.shape[1:])
        out = pages.empty(shape)
        starts = np.cumsum([0] + [w.data.shape[0] for w in ws[:-1]]) * out[0].nbytes
        pending = restack(ws, out, starts.tolist(), 1)  # deferred parts: their fills go to out, nothing moves
        if pending is None:
            out = np.concatenate([written(w).data for w in ws], axis=0)
        return Weight(name, ws[0].kind, ws[0].format, (n, ws[0].shape[1]), out, rope_interleaved, pending=pending)
    return _from_rows(name, ws[0], np.concatenate([_rows(w) for w in ws], axis=0), n, rope_interleaved)


def interleave_tiles(name: str, g: Weight, u: Weight) -> Weight:
    """Gate and up rows alternating in 16-row tiles: [g0..15, u0..15, g16..31, ...]."""
    n = 2 * g.shape[0]
    whole = saved_whole([g, u], "tiles")
    if whole is not None:  # saved interleaved: the file's bytes as they are
        return Weight(name, g.kind, g.format, (n, g.shape[1]), whole, False)
    if g.packed:
        out = pages.empty((2 * g.data.shape[0], *g.data.shape[1:]))
        pending = restack([g, u], out, [0, out[0].nbytes], 2)
        if pending is None:
            out = np.stack([written(g).data, written(u).data], axis=1).reshape(-1, *g.data.shape[1:])
        return Weight(name, g.kind, g.format, (n, g.shape[1]), out, False, pending=pending)
    gr, ur = _rows(g), _rows(u)
    rows = np.stack([gr.reshape(-1, ops.TILE, gr.shape[1]), ur.reshape(-1, ops.TILE, ur.shape[1])], axis=1)
    return _from_rows(name, g, rows.reshape(n, -1), n, False)


def rope_interleave_rows(w: Weight, heads: int, hd: int) -> Weight:
    """Rows of a q/k projection (or its bias) from rotate-half order (pairs j,
    j + hd/2) to interleaved order (pairs 2j, 2j+1): row 2j <- j, row 2j+1 <-
    j + hd/2 within each head. q.k is unchanged when q and k are permuted alike."""
    if w.rope_interleaved:
        return w
    perm = np.arange(heads * hd).reshape(heads, 2, hd // 2).transpose(0, 2, 1).reshape(-1)
    if w.packed:  # every per-row array (codes, scales, super-block scales) follows its row
        w = written(w)
        codes, parts = unpack_parts(w.scheme, w.data, w.shape)
        n = w.shape[0]
        codes = codes.copy()
        codes[:n] = codes[:n][perm]
        for name, a in parts.items():
            a = a.copy()
            a[:n] = a[:n][perm]
            parts[name] = a
        return pack_parts(w.name, w.scheme, w.shape, codes, parts, w.kind, rope_interleaved=True)
    return _from_rows(w.name, w, _rows(w)[perm], w.shape[0], True)
