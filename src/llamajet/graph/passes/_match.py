"""Helpers shared by the passes: graph queries and weight packing at load."""

from __future__ import annotations

import numpy as np

from llamajet.graph.ir import Graph, Node
from llamajet.quant.pack import PackedWeight, pack, unpack
from llamajet.quant.schemes import TILE_ROWS

PACKED_KINDS = ("pk_i4s", "pk_i4a", "pk_i8")


def only_consumer(graph: Graph, tensor: str) -> Node | None:
    """The single node reading `tensor` (None if zero or several, or if it is a graph output)."""
    if tensor in graph.outputs:
        return None
    cs = graph.consumers(tensor)
    return cs[0] if len(cs) == 1 else None


def index(graph: Graph, node: Node) -> int:
    return next(i for i, n in enumerate(graph.nodes) if n is node)


def same_kind(ws) -> bool:
    """Weights whose rows can be stacked into one matrix: same storage type,
    same K, and for packed ones the same scheme."""
    w0 = ws[0]
    return all(w.dtype == w0.dtype and w.shape[1] == w0.shape[1] and
               getattr(w, "scheme", None) == getattr(w0, "scheme", None) for w in ws)


def is_packed(w) -> bool:
    return isinstance(w, PackedWeight)


def quant_readers(graph: Graph, t: str, ctx) -> int | None:
    """The group size if every reader of t can take it pre-quantized (packed
    matmuls with int8 activations, no prologue, one group, K = t's width),
    else None."""
    readers = graph.consumers(t)
    if not ctx.act_int8 or not readers or t in graph.outputs:
        return None
    groups = set()
    for r in readers:
        if r.op != "matmul" or r.inputs[0] != t or r.attrs.get("prologue", "none") != "none":
            return None
        w = graph.weights[r.inputs[1]]
        if not is_packed(w) or w.shape[1] != graph.tensors[t].shape[-1]:
            return None
        groups.add(w.group)
    return groups.pop() if len(groups) == 1 else None


def prequant_copy(graph: Graph, t: str, name: str, group: int) -> str:
    """A new int8 tensor `name`.q8 holding t quantized in groups (the kernels'
    qact layout: codes padded to kpad, scales, sums), and every reader of t
    switched to read it with the prequant prologue. Returns its name."""
    rows, n_cols = graph.tensors[t].shape[0], graph.tensors[t].shape[-1]
    kpad = -(-n_cols // group) * group
    tq = graph.tensor(f"{name}.q8", (rows, kpad + 8 * (kpad // group) + 64), "i8")
    for r in graph.consumers(t):
        r.inputs[0] = tq
        r.attrs.update(prologue="prequant", qin=tq)
    return tq


def _row_view(w) -> np.ndarray:
    """Raw storage of a row-major weight as [N, row bytes] uint8."""
    return np.ascontiguousarray(w.data).view(np.uint8).reshape(w.shape[0], -1)


def _raw(name: str, like, rows: np.ndarray, n: int, rope_interleaved: bool):
    """A WeightTensor of `like`'s storage type over raw row bytes [n, row bytes]."""
    from llamajet.loaders import STORAGE_DTYPE, WeightTensor

    data = rows.view(STORAGE_DTYPE[like.dtype]).reshape(n, -1)
    return WeightTensor(name, like.dtype, (n, like.shape[1]), data, rope_interleaved=rope_interleaved)


def stack_rows(name: str, ws):
    """[W0; W1; ...] along N (each N a multiple of 16 for packed ones: whole tiles)."""
    n = sum(w.shape[0] for w in ws)
    if is_packed(ws[0]):
        data = np.concatenate([w.data for w in ws], axis=0)
        return PackedWeight(name, ws[0].scheme, (n, ws[0].shape[1]), data, rope_interleaved=True)
    return _raw(name, ws[0], np.concatenate([_row_view(w) for w in ws], axis=0), n, rope_interleaved=True)


def interleave_tiles(name: str, g, u):
    """Gate and up rows alternating in 16-row tiles: [g0..15, u0..15, g16..31, ...]."""
    n = 2 * g.shape[0]
    if is_packed(g):
        data = np.stack([g.data, u.data], axis=1).reshape(-1, *g.data.shape[1:])
        return PackedWeight(name, g.scheme, (n, g.shape[1]), data)
    gr, ur = _row_view(g), _row_view(u)
    rows = np.stack([gr.reshape(-1, TILE_ROWS, gr.shape[1]), ur.reshape(-1, TILE_ROWS, ur.shape[1])], axis=1)
    return _raw(name, g, rows.reshape(n, -1), n, rope_interleaved=False)


def rope_interleave_rows(w, heads: int, hd: int):
    """Rows of a q/k projection from rotate-half order (pairs j, j + hd/2) to
    interleaved order (pairs 2j, 2j+1): row 2j <- j, row 2j+1 <- j + hd/2 within
    each head. q.k is unchanged when q and k are permuted alike."""
    if getattr(w, "rope_interleaved", False):
        return w
    perm = np.arange(heads * hd).reshape(heads, 2, hd // 2).transpose(0, 2, 1).reshape(-1)
    if is_packed(w):
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
