"""GGUF block formats -> the kernels' packed layout, without loss.

Q4_0 = int4 sym g32 (x = d * (q - 8)), Q4_1 = int4 asym g32 (x = d * q + m:
its min is our m), Q8_0 = int8 g32 (x = d * q): the same codes and fp16
scales, rearranged into 16-row tiles (formats/packed.py), so the packed weight
dequantizes to exactly the GGUF's values (tested against gguf.quants).
"""

from __future__ import annotations

import numpy as np

from llamajet import ops
from llamajet.formats.packed import _pad, pack
from llamajet.formats.schemes import get_scheme
from llamajet.formats.weight import Weight

# GGUF block type -> the scheme that holds it without loss
LOSSLESS = {"q4_0": "int4_sym_g32", "q4_1": "int4_asym_g32", "q8_0": "int8_g32"}


def repack_gguf(w: Weight) -> Weight:
    """A Q4_0 / Q4_1 / Q8_0 weight as its lossless packed twin (same name, kind, RoPE order)."""
    if w.dtype not in LOSSLESS:
        raise ValueError(f"{w.name}: cannot repack {w.dtype!r} without loss")
    n, k = w.shape
    nb = k // ops.QK
    blocks = np.ascontiguousarray(w.data).view(np.uint8).reshape(n, nb, -1)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    m = None
    if w.dtype == "q8_0":
        codes = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
    else:
        nib = blocks[..., -16:]  # low nibbles: elements 0..15 of the block, high: 16..31
        codes = np.concatenate([nib & 0x0F, nib >> 4], axis=-1).reshape(n, k)
        if w.dtype == "q4_1":
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    n_pad = -(-n // ops.TILE) * ops.TILE
    codes = _pad(codes, n_pad, k, fill_rows=0)
    d = _pad(d, n_pad, nb, fill_rows=0)
    m = _pad(m, n_pad, nb, fill_rows=0) if m is not None else None
    return pack(w.name, get_scheme(LOSSLESS[w.dtype]), (n, k), codes, d, m, w.kind, w.rope_interleaved)
