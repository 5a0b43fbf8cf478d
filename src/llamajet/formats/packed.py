"""The packed weight layout for the kernels, and its numpy reference.

A packed [N, K] matrix is cut into tiles of ops.TILE (16) rows and, along
K, into groups of G elements (N and K padded up; padded rows are zero,
padded columns repeat the row's last value so group statistics are not
distorted; activations are zero there, so they never contribute). Storage is
one uint8 stream, tile-major, group-minor, so a thread streams its tiles
front to back:

    data[tile, group] = codes | d[16] fp16 | m[16] fp16 (asymmetric only)

codes, for one tile and group, in chunks of 64 bytes (16 rows x 4 bytes: one
AVX-512 register, one `vpdpbusd` per chunk and nibble half):
  int4: G/8 chunks; chunk c, byte 4r+j = c(r, 8c+j) | c(r, 8c+4+j) << 4
  int8: G/4 chunks; chunk c, byte 4r+j = c(r, 4c+j) (signed byte)
Row r's 4 codes for 4 consecutive k are one little-endian uint32, which is
what the scalar tier reads.

Rounding rule of the quantizers here (RTN), all in float32, round half to
even (np.rint / the CPU's default mode), scale rounded to fp16 first and the
codes computed with the rounded scale:
  int4 sym : d = x* / -8 (x* = the element of largest magnitude), c = clip(rint(x/d) + 8, 0, 15)
  int4 asym: d = (max-min)/15, m = min, c = clip(rint((x-m)/d), 0, 15)
  int8 sym : d = max|x| / 127, c = clip(rint(x/d), -127, 127)
(x/d is computed as x * (1/d), 1/d in float32; d == 0 gives codes of 0 value.)
"""

from __future__ import annotations

import numpy as np

from llamajet import ops
from llamajet.formats.schemes import QuantScheme, get_scheme
from llamajet.formats.weight import Kind, Weight

F16 = np.float16
T = ops.TILE


def _pad(a: np.ndarray, n_pad: int, k_pad: int, fill_rows=0) -> np.ndarray:
    n, k = a.shape
    if k_pad > k:
        a = np.concatenate([a, np.repeat(a[:, -1:], k_pad - k, axis=1)], axis=1)
    if n_pad > n:
        a = np.concatenate([a, np.full((n_pad - n, a.shape[1]), fill_rows, a.dtype)], axis=0)
    return a


def tail_parts(scheme: QuantScheme) -> list[tuple[str, type, bool]]:
    """The tail of a (tile, super-block) block, in order: (name, dtype, per
    group?) — per group: [N_pad, n_groups] arrays, else [N_pad, n_super]."""
    kind = scheme.kind
    if kind in ("pk_q4k", "pk_q5k"):
        return [("D", F16, False), ("DM", F16, False), ("sc", np.uint8, True), ("mn", np.uint8, True)]
    if kind == "pk_q6k":
        return [("D", F16, False), ("sc", np.int8, True)]
    return [("d", F16, True)] + ([] if scheme.symmetric else [("m", F16, True)])


def pack_parts(name: str, scheme: QuantScheme, shape: tuple[int, int], codes: np.ndarray, parts: dict,
               kind: Kind = Kind.MATRIX, rope_interleaved: bool = False, out: np.ndarray | None = None) -> Weight:
    """Lays out codes [N_pad, K_pad] (uint8; int8 for int8 kinds) and the tail
    arrays `parts` (tail_parts) in the kernels' order (layout: common.h).
    With `out` (tiles [t0, t0 + N_pad / 16) of a larger storage array: the
    rows given are those tiles'), writes there and returns None."""
    n_pad, k_pad = codes.shape
    g, S, bits = scheme.group_for(shape[1]), scheme.super, scheme.bits
    nt, ng = n_pad // T, k_pad // g
    nsb = ng // S
    c = np.ascontiguousarray(codes).view(np.uint8).reshape(nt, T, ng, g).transpose(0, 2, 1, 3)  # [nt, ng, T, g]
    if bits == 8:
        code_bytes = c.reshape(nt, ng, T, g // 4, 4).transpose(0, 1, 3, 2, 4).reshape(nt, ng, -1)
    else:
        c6 = c.reshape(nt, ng, T, g // 8, 2, 4)
        nib = c6 & 0x0F
        nib = (nib[..., 0, :] | (nib[..., 1, :] << 4)).transpose(0, 1, 3, 2, 4).reshape(nt, ng, -1)
        code_bytes = nib
        if bits > 4:  # the plane: slot s = 2 chunk + half at bits [hb s, hb s + hb) of byte (row, j)
            hb = bits - 4
            assert g * hb == 32, "one 64-byte plane per group"
            hi = (c6 >> 4).astype(np.uint32)
            shifts = (hb * (2 * np.arange(g // 8)[:, None] + np.arange(2)[None, :])).astype(np.uint32)
            plane = (hi << shifts[None, None, None, :, :, None]).sum(axis=(3, 4)).astype(np.uint8)  # [nt, ng, T, 4]
            code_bytes = np.concatenate([nib, plane.reshape(nt, ng, -1)], axis=-1)
    blocks = [code_bytes.reshape(nt, nsb, -1)]
    for pname, dt, per_group in tail_parts(scheme):
        a = np.ascontiguousarray(np.asarray(parts[pname]).astype(dt)).view(np.uint8)
        width = 2 if dt == F16 else 1
        per = S if per_group else 1
        blocks.append(a.reshape(nt, T, nsb, per, width).transpose(0, 2, 3, 1, 4).reshape(nt, nsb, -1))
    data = np.concatenate(blocks, axis=-1)
    assert data.shape[-1] == scheme.block_bytes(shape[1])
    if out is not None:
        out[...] = data
        return None
    return Weight(name, kind, scheme, tuple(shape), np.ascontiguousarray(data), rope_interleaved)


def pack(name: str, scheme: QuantScheme, shape: tuple[int, int], codes: np.ndarray, d: np.ndarray,
         m: np.ndarray | None = None, kind: Kind = Kind.MATRIX, rope_interleaved: bool = False) -> Weight:
    """Lays out codes [N_pad, K_pad] (uint8 for int4, int8 for int8) and fp16
    scales d (and mins m) [N_pad, n_groups] in the kernels' order."""
    parts = {"d": d} if m is None else {"d": d, "m": m}
    return pack_parts(name, scheme, shape, codes, parts, kind, rope_interleaved)


def _geometry(scheme: QuantScheme, shape: tuple[int, int]):
    n, k = shape
    g = scheme.group_for(k)
    n_pad, k_pad = -(-n // T) * T, scheme.k_padded(k)
    return g, n_pad, k_pad, n_pad // T, k_pad // g


def unpack_parts(scheme: QuantScheme, data: np.ndarray, shape: tuple[int, int]):
    """Inverse of pack_parts: codes [N_pad, K_pad] and the tail arrays."""
    g, n_pad, k_pad, nt, ng = _geometry(scheme, shape)
    S, bits = scheme.super, scheme.bits
    nsb = ng // S
    raw = np.asarray(data).reshape(nt, nsb, -1)
    cgb = T * g * bits // 8
    cb = raw[..., : S * cgb].reshape(nt, ng, cgb)
    if bits == 8:
        codes = cb.reshape(nt, ng, g // 4, T, 4).transpose(0, 1, 3, 2, 4).reshape(nt, ng, T, g).view(np.int8)
    else:
        nib = cb[..., : T * g // 2].reshape(nt, ng, g // 8, T, 4).transpose(0, 1, 3, 2, 4)  # [nt, ng, T, chunk, 4]
        codes = np.stack([nib & 0x0F, nib >> 4], axis=-2)  # [nt, ng, T, chunk, 2, 4]
        if bits > 4:
            hb = bits - 4
            plane = cb[..., T * g // 2:].reshape(nt, ng, T, 1, 1, 4)
            shifts = (hb * (2 * np.arange(g // 8)[:, None] + np.arange(2)[None, :])).astype(np.uint8)
            codes = codes | (((plane >> shifts[None, None, None, :, :, None]) & ((1 << hb) - 1)) << 4)
        codes = codes.reshape(nt, ng, T, g)
    codes = codes.transpose(0, 2, 1, 3).reshape(n_pad, k_pad)
    parts, off = {}, S * cgb
    for pname, dt, per_group in tail_parts(scheme):
        width = 2 if dt == F16 else 1
        per = S if per_group else 1
        nbytes = per * T * width
        a = np.ascontiguousarray(raw[..., off : off + nbytes]).reshape(nt, nsb, per, T, width)
        parts[pname] = a.transpose(0, 3, 1, 2, 4).reshape(n_pad, nsb * per * width).view(dt)
        off += nbytes
    return codes, parts


def unpack_data(scheme: QuantScheme, data: np.ndarray, shape: tuple[int, int]):
    """codes [N_pad, K_pad], d and m [N_pad, n_groups] (fp16) of an RTN kind's storage."""
    codes, parts = unpack_parts(scheme, data, shape)
    return codes, parts["d"], parts.get("m")


def unpack(w: Weight):
    """Codes [N_pad, K_pad], d and m [N_pad, n_groups] of a packed weight of an RTN kind."""
    return unpack_data(w.scheme, w.data, w.shape)


def dequantize_data(scheme: QuantScheme, data: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """float64 [N, K] values of packed storage: the fp32 operations of
    gguf.quants' dequantization for the GGUF twins (so equal bit for bit):
    d * (c - bias), or d * c + m (m = -DM * mn for the K-quants)."""
    codes, parts = unpack_parts(scheme, data, shape)
    g, n_pad, k_pad, _, ng = _geometry(scheme, shape)
    d, m, bias = group_scales(scheme, parts)  # fp32 values, held in float64 exactly
    f32 = np.float32
    c = codes.astype(f32).reshape(n_pad, ng, g)
    dd = d.astype(f32)[..., None]
    w = dd * (c - f32(bias)) if m is None else dd * c + m.astype(f32)[..., None]
    return w.astype(np.float64).reshape(n_pad, k_pad)[: shape[0], : shape[1]]


def dequantize(w: Weight) -> np.ndarray:
    """float64 [N, K] values of a packed weight."""
    return dequantize_data(w.scheme, w.data, w.shape)


# ------------------------------------------------------------------ quantizers


def rtn_scales(x: np.ndarray, scheme: QuantScheme) -> tuple[np.ndarray, np.ndarray | None]:
    """fp16 scale d (and min m) of each group of x [..., g] (float32) by the
    RTN rule: sym int4: the first largest-magnitude value maps to code -8 (GGUF
    Q4_0); asym int4: [min, max] over 15 steps (Q4_1); int8: amax / 127."""
    x = np.asarray(x, np.float32)
    if scheme.bits == 4 and scheme.symmetric:
        idx = np.abs(x).argmax(axis=-1)[..., None]
        return (np.take_along_axis(x, idx, -1)[..., 0] / np.float32(-8)).astype(F16), None
    if scheme.bits == 4:
        mn, mx = x.min(axis=-1), x.max(axis=-1)
        return ((mx - mn) / np.float32(15)).astype(F16), mn.astype(F16)
    return (np.abs(x).max(axis=-1) / np.float32(127)).astype(F16), None


def _rtn(w: np.ndarray, scheme: QuantScheme, n_rows: int):
    """RTN codes [n_rows, K_pad] and fp16 scales d (mins m) [n_rows, n_groups] of w [N, K]
    (columns padded as the packing pads them, rows with zeros up to n_rows)."""
    g, _, k_pad, _, _ = _geometry(scheme, w.shape)
    x = _pad(np.asarray(w, np.float32), n_rows, k_pad).reshape(n_rows, k_pad // g, g)
    d, m = rtn_scales(x, scheme)
    inv = np.divide(np.float32(1), d.astype(np.float32), out=np.zeros(d.shape, np.float32), where=d != 0)
    if scheme.bits == 4 and scheme.symmetric:
        codes = np.clip(np.rint(x * inv[..., None]) + 8, 0, 15).astype(np.uint8)
    elif scheme.bits == 4:
        codes = np.clip(np.rint((x - m.astype(np.float32)[..., None]) * inv[..., None]), 0, 15).astype(np.uint8)
    else:
        codes = np.clip(np.rint(x * inv[..., None]), -127, 127).astype(np.int8)
    return codes.reshape(n_rows, k_pad), d, m


def quantize_rtn(name: str, w: np.ndarray, scheme: QuantScheme | str, kind: Kind = Kind.MATRIX,
                 rope_interleaved: bool = False) -> Weight:
    """Round-to-nearest quantization of float weights [N, K] (rule: module docstring)."""
    scheme = get_scheme(scheme) if isinstance(scheme, str) else scheme
    _, n_pad, _, _, _ = _geometry(scheme, w.shape)
    codes, d, m = _rtn(w, scheme, n_pad)
    return pack(name, scheme, tuple(w.shape), codes, d, m, kind, rope_interleaved)


def rtn_dequant(w: np.ndarray, scheme: QuantScheme) -> np.ndarray:
    """float64 [N, K]: the values RTN gives w, as dequantize(quantize_rtn(w)) without the packing
    (the methods' searches call it many times)."""
    n, k = w.shape
    g = scheme.group_for(k)
    codes, d, m = _rtn(w, scheme, n)
    c = codes.astype(np.float64).reshape(n, -1, g)
    if scheme.bits == 4 and scheme.symmetric:
        c = c - 8
    v = c * d.astype(np.float64)[..., None]
    if m is not None:
        v = v + m.astype(np.float64)[..., None]
    return v.reshape(n, -1)[:, :k]


# ------------------------------------------------------------------ activations


def quantize_activations(x: np.ndarray, g: int, k_pad: int, span: int | None = None
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The matmul's input stage (numpy twin): each row of x [M, K], zero-padded
    to k_pad, in groups of g, one scale per span values (default g; the K-quants'
    Q8_ACTK: 256): dx = amax/127 over the span, q = clip(rint(x * (127/amax)), -127, 127).
    Returns q int8 [M, k_pad], dx float32 [M, k_pad/g] (a span's groups share
    theirs), sum(q) int32 [M, k_pad/g]."""
    x = np.asarray(x, np.float32)
    span = span or g
    M, K = x.shape
    xp = np.zeros((M, k_pad), np.float32)
    xp[:, :K] = x
    xs = xp.reshape(M, k_pad // span, span)
    amax = np.abs(xs).max(axis=-1)
    dx = np.repeat(amax / np.float32(127), span // g, axis=-1)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax != 0)
    q = np.clip(np.rint(xs * inv[..., None]), -127, 127).astype(np.int8)
    return q.reshape(M, k_pad), dx, q.astype(np.int32).reshape(M, k_pad // g, g).sum(axis=-1)


def group_scales(scheme: QuantScheme, parts: dict):
    """Per-group float64 scales of a packed weight's rows: w = d * (c - bias)
    + m. Returns d [N_pad, ng], m [N_pad, ng] or None, and the code bias."""
    S, kind = scheme.super, scheme.kind
    if kind in ("pk_q4k", "pk_q5k", "pk_q6k"):
        f32 = np.float32  # D * sc as the kernels (and gguf.quants) form it: exact in fp32
        d = (np.repeat(parts["D"].astype(f32), S, axis=1) * parts["sc"].astype(f32)).astype(np.float64)
        if kind == "pk_q6k":
            return d, None, 32
        dm = np.repeat(parts["DM"].astype(f32), S, axis=1) * parts["mn"].astype(f32)
        return d, -dm.astype(np.float64), 0
    d = parts["d"].astype(np.float64)
    if not scheme.symmetric:
        return d, parts["m"].astype(np.float64), 0
    return d, None, {4: 8, 5: 16, 8: 0}[scheme.bits]


def matmul_a8_reference(x: np.ndarray, pw: Weight) -> np.ndarray:
    """float64 result of the W*A8 kernel's arithmetic: integer dot per group,
    then the group's scales (the kernels do this part in fp32)."""
    codes, parts = unpack_parts(pw.scheme, pw.data, pw.shape)
    g, _, k_pad, _, ng = _geometry(pw.scheme, pw.shape)
    q, dx, sq = quantize_activations(x, g, k_pad, pw.scheme.act_span(pw.shape[1]))
    n = pw.shape[0]
    c = codes[:n].astype(np.int64).reshape(n, ng, g)
    acc = np.einsum("mgk,ngk->mng", q.astype(np.int64).reshape(-1, ng, g), c)  # exact integers
    d, m, bias = group_scales(pw.scheme, parts)
    dd = d[:n][None]  # [1, n, ng]
    dxx = dx.astype(np.float64)[:, None, :]
    y = dd * dxx * (acc - bias * sq[:, None, :])
    if m is not None:
        y = y + m[:n][None] * dxx * sq[:, None, :]
    return y.sum(axis=-1)
