"""GGUF block formats -> the kernels' packed layout, without loss.

Every GGUF type below has a packed twin holding the same codes and scales,
rearranged into 16-row tiles (formats/packed.py, common.h), so the packed
weight dequantizes to exactly gguf.quants' values (tested for every type):
  Q4_0 = int4_sym_g32 (x = d * (q - 8)), Q4_1 = int4_asym_g32 (x = d * q + m),
  Q8_0 = int8_g32 (x = d * q), Q5_0 / Q5_1 = gguf_q5_0 / gguf_q5_1 (5-bit
  codes), Q4_K / Q5_K = gguf_q4_k / gguf_q5_k (super-blocks of 8 x 32: fp16
  D, DM; 6-bit sc, mn per 32 kept as bytes: +2.8% / +2.3% bytes),
  Q6_K = gguf_q6_k (16 x 16: fp16 D, int8 sc; the file's bytes exactly).
repack_gguf runs in C++ (csrc/runtime/repack.cpp), threaded, from the file's
bytes into the final array (or a stacked one: formats/pending.py);
repack_gguf_reference is its numpy specification, a slab of rows at a time.

GGUF block layouts (ggml-quants, checked through gguf.quants in tests):
  Q5_0: d f16 | qh u32 (bit i: element i's bit 4) | qs[16] (lo nibble: element
        j, hi: j + 16);  Q5_1: d f16 | m f16 | qh | qs
  Q4_K: d f16 | dmin f16 | scales[12] (8 x (6-bit sc, 6-bit min)) | qs[128]:
        qs[32 i + j] lo nibble = element 64 i + j, hi = 64 i + 32 + j
  Q5_K: d | dmin | scales[12] | qh[32] (bit b of qh[j]: element 32 b + j) | qs[128]
  Q6_K: ql[128] | qh[64] | sc[16] int8 | d f16: for half h, ql[64 h + l] lo
        nibble = element 128 h + l, hi = 128 h + 64 + l; bits 2s.. of qh[32 h + l]
        = bits 4, 5 of element 128 h + 32 s + l; sc per 16 elements
"""

from __future__ import annotations

import numpy as np

from llamajet import ops
from llamajet.formats import pages
from llamajet.formats.packed import _pad, pack_parts
from llamajet.formats.schemes import get_scheme
from llamajet.formats.weight import Weight

# GGUF block type -> the scheme that holds it without loss
LOSSLESS = {"q4_0": "int4_sym_g32", "q4_1": "int4_asym_g32", "q8_0": "int8_g32", "q5_0": "gguf_q5_0",
            "q5_1": "gguf_q5_1", "q4_k": "gguf_q4_k", "q5_k": "gguf_q5_k", "q6_k": "gguf_q6_k"}

_SLAB_ROWS = 256  # rows repacked per slab (16 tiles): ~1-4 MB of temporaries at K = 4096-14336


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """[.., 16] bytes -> [.., 32] codes: low nibbles are elements 0..15, high 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _k_scales(sc12: np.ndarray):
    """Q4_K / Q5_K's 12 scale bytes [.., 12] -> 6-bit sc, mn [.., 8]."""
    d, m, md = sc12[..., 0:4], sc12[..., 4:8], sc12[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _q4k_low(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K qs [.., 128] -> low 4 bits of the 256 elements."""
    q = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return np.concatenate([q & 0x0F, q >> 4], axis=-2).reshape(*qs.shape[:-1], 256)


def decode_blocks(dtype: str, blocks: np.ndarray):
    """Blocks [rows, n_blocks, block bytes] -> codes [rows, K] (uint8; int8 for
    Q8_0) and the packed twin's tail arrays (formats.packed.tail_parts)."""
    r, nb, _ = blocks.shape
    if dtype == "q8_0":
        return blocks[..., 2:].view(np.int8).reshape(r, -1), {"d": _f16(blocks[..., 0:2])}
    if dtype in ("q4_0", "q4_1"):
        codes = _nibbles_32(blocks[..., -16:]).reshape(r, -1)
        parts = {"d": _f16(blocks[..., 0:2])}
        if dtype == "q4_1":
            parts["m"] = _f16(blocks[..., 2:4])
        return codes, parts
    if dtype in ("q5_0", "q5_1"):
        o = 2 if dtype == "q5_0" else 4
        qh = np.ascontiguousarray(blocks[..., o : o + 4]).view(np.uint32)  # [r, nb, 1]
        hi = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        codes = (_nibbles_32(blocks[..., o + 4 : o + 20]) | (hi << 4)).reshape(r, -1)
        parts = {"d": _f16(blocks[..., 0:2])}
        if dtype == "q5_1":
            parts["m"] = _f16(blocks[..., 2:4])
        return codes, parts
    if dtype in ("q4_k", "q5_k"):
        sc, mn = _k_scales(blocks[..., 4:16])
        if dtype == "q4_k":
            codes = _q4k_low(blocks[..., 16:144])
        else:
            qh = blocks[..., 16:48].reshape(r, nb, 1, 32)
            hi = ((qh >> np.arange(8, dtype=np.uint8)[:, None]) & 1).reshape(r, nb, 256)
            codes = _q4k_low(blocks[..., 48:176]) | (hi << 4)
        parts = {"D": _f16(blocks[..., 0:2]), "DM": _f16(blocks[..., 2:4]),
                 "sc": sc.reshape(r, -1), "mn": mn.reshape(r, -1)}
        return codes.reshape(r, -1), parts
    if dtype == "q6_k":
        ql = blocks[..., 0:128].reshape(r, nb, 2, 1, 64)
        low = np.concatenate([ql & 0x0F, ql >> 4], axis=-2).reshape(r, nb, 2, 128)
        qh = blocks[..., 128:192].reshape(r, nb, 2, 1, 32)
        hi = ((qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3).reshape(r, nb, 2, 128)
        codes = (low | (hi << 4)).reshape(r, -1)
        parts = {"D": _f16(blocks[..., 208:210]), "sc": blocks[..., 192:208].view(np.int8).reshape(r, -1)}
        return codes, parts
    raise ValueError(f"no packed twin for {dtype!r}")


def twin_scheme(w: Weight):
    """The packed scheme holding GGUF block weight w without loss (checked)."""
    if w.dtype not in LOSSLESS:
        raise ValueError(f"{w.name}: cannot repack {w.dtype!r} without loss")
    sch = get_scheme(LOSSLESS[w.dtype])
    n, k = w.shape
    if k % (sch.group_for(k) * sch.super):
        raise ValueError(f"{w.name}: {w.dtype} rows of {k} are not whole blocks")
    return sch


def repack_gguf(w: Weight, n_threads: int | None = None, out: np.ndarray | None = None, offset: int = 0,
                tile_stride: int | None = None) -> Weight | None:
    """A GGUF block weight as its lossless packed twin (same name, kind, RoPE
    order), repacked by the C++ core straight from w's bytes (a view of the
    file) on n_threads threads. With `out` (uint8), its tiles go to out at
    byte offset + t * tile_stride instead (a stacked or interleaved matrix:
    formats/stack.py) and None is returned."""
    sch = twin_scheme(w)
    dst = out if out is not None else pages.empty(sch.storage_shape(w.shape))
    ops.repack_gguf(w.dtype, w.data, w.shape, dst, offset, tile_stride, n_threads)
    if out is not None:
        return None
    return Weight(w.name, w.kind, sch, w.shape, dst, w.rope_interleaved)


def repack_gguf_reference(w: Weight) -> Weight:
    """repack_gguf in numpy (decode_blocks + formats.packed.pack_parts), a
    slab of rows at a time: the specification the C++ repack is tested against."""
    sch = twin_scheme(w)
    n, k = w.shape
    blocks = np.asarray(w.data).view(np.uint8).reshape(n, k // w.format.block_elems, -1)
    out = np.empty(sch.storage_shape((n, k)), np.uint8)
    for r0 in range(0, n, _SLAB_ROWS):
        r1 = min(n, r0 + _SLAB_ROWS)
        codes, parts = decode_blocks(w.dtype, blocks[r0:r1])
        n_pad = -(-(r1 - r0) // ops.TILE) * ops.TILE  # padded rows are zero
        codes = _pad(codes, n_pad, k)
        parts = {p: _pad(a, n_pad, a.shape[1]) for p, a in parts.items()}
        t0 = r0 // ops.TILE
        pack_parts(w.name, sch, (r1 - r0, k), codes, parts, out=out[t0 : t0 + n_pad // ops.TILE])
    return Weight(w.name, w.kind, sch, (n, k), out, w.rope_interleaved)
