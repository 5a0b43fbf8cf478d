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


def pack(name: str, scheme: QuantScheme, shape: tuple[int, int], codes: np.ndarray, d: np.ndarray,
         m: np.ndarray | None = None, kind: Kind = Kind.MATRIX, rope_interleaved: bool = False) -> Weight:
    """Lays out codes [N_pad, K_pad] (uint8 for int4, int8 for int8) and fp16
    scales d (and mins m) [N_pad, n_groups] in the kernels' order."""
    n_pad, k_pad = codes.shape
    g = scheme.group_for(shape[1])
    nt, ng = n_pad // T, k_pad // g
    c = np.ascontiguousarray(codes).view(np.uint8).reshape(nt, T, ng, g).transpose(0, 2, 1, 3)
    if scheme.bits == 4:
        c = c.reshape(nt, ng, T, g // 8, 2, 4)
        c = (c[..., 0, :] | (c[..., 1, :] << 4)).transpose(0, 1, 3, 2, 4)  # [nt, ng, chunk, row, 4]
    else:
        c = c.reshape(nt, ng, T, g // 4, 4).transpose(0, 1, 3, 2, 4)
    parts = [c.reshape(nt, ng, -1)]
    for s in (d, m) if m is not None else (d,):
        parts.append(np.ascontiguousarray(s.astype(F16)).view(np.uint8).reshape(nt, T, ng, 2)
                     .transpose(0, 2, 1, 3).reshape(nt, ng, 2 * T))
    data = np.ascontiguousarray(np.concatenate(parts, axis=-1))
    assert data.shape[-1] == scheme.block_bytes(shape[1])
    return Weight(name, kind, scheme, tuple(shape), data, rope_interleaved)


def _geometry(scheme: QuantScheme, shape: tuple[int, int]):
    n, k = shape
    g = scheme.group_for(k)
    n_pad, k_pad = -(-n // T) * T, scheme.k_padded(k)
    return g, n_pad, k_pad, n_pad // T, k_pad // g


def unpack_data(scheme: QuantScheme, data: np.ndarray, shape: tuple[int, int]):
    """Inverse of pack: codes [N_pad, K_pad], d and m [N_pad, n_groups] (fp16)."""
    g, n_pad, k_pad, nt, ng = _geometry(scheme, shape)
    cb = scheme.block_bytes(shape[1]) - 2 * T * (1 if scheme.symmetric else 2)
    raw = data.reshape(nt, ng, -1)
    c = raw[..., :cb]
    if scheme.bits == 4:
        c = c.reshape(nt, ng, g // 8, T, 4).transpose(0, 1, 3, 2, 4)
        codes = np.stack([c & 0x0F, c >> 4], axis=-2).reshape(nt, ng, T, g)
    else:
        codes = c.reshape(nt, ng, g // 4, T, 4).transpose(0, 1, 3, 2, 4).reshape(nt, ng, T, g).view(np.int8)
    codes = codes.transpose(0, 2, 1, 3).reshape(n_pad, k_pad)

    def scales(off):
        return np.ascontiguousarray(raw[..., off : off + 2 * T]).view(F16).reshape(
            nt, ng, T).transpose(0, 2, 1).reshape(n_pad, ng)

    d = scales(cb)
    m = None if scheme.symmetric else scales(cb + 2 * T)
    return codes, d, m


def unpack(w: Weight):
    """Codes [N_pad, K_pad], d and m [N_pad, n_groups] of a packed weight."""
    return unpack_data(w.scheme, w.data, w.shape)


def dequantize_data(scheme: QuantScheme, data: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """float64 [N, K] values of packed storage."""
    codes, d, m = unpack_data(scheme, data, shape)
    g, n_pad, k_pad, _, ng = _geometry(scheme, shape)
    c = codes.astype(np.float64).reshape(n_pad, ng, g)
    dd = d.astype(np.float64)[..., None]
    if scheme.bits == 8:
        w = dd * c
    elif scheme.symmetric:
        w = dd * (c - 8.0)
    else:
        w = dd * c + m.astype(np.float64)[..., None]
    return w.reshape(n_pad, k_pad)[: shape[0], : shape[1]]


def dequantize(w: Weight) -> np.ndarray:
    """float64 [N, K] values of a packed weight."""
    return dequantize_data(w.scheme, w.data, w.shape)


# ------------------------------------------------------------------ quantizers


def quantize_rtn(name: str, w: np.ndarray, scheme: QuantScheme | str, kind: Kind = Kind.MATRIX,
                 rope_interleaved: bool = False) -> Weight:
    """Round-to-nearest quantization of float weights [N, K] (rule: module docstring)."""
    scheme = get_scheme(scheme) if isinstance(scheme, str) else scheme
    n, k = w.shape
    g, n_pad, k_pad, _, _ = _geometry(scheme, (n, k))
    x = _pad(np.asarray(w, np.float32), n_pad, k_pad).reshape(n_pad, k_pad // g, g)
    one = np.float32(1)
    if scheme.bits == 4 and scheme.symmetric:
        idx = np.abs(x).argmax(axis=-1)[..., None]
        d = (np.take_along_axis(x, idx, -1)[..., 0] / np.float32(-8)).astype(F16)
        inv = np.divide(one, d.astype(np.float32), out=np.zeros(d.shape, np.float32), where=d != 0)
        codes = np.clip(np.rint(x * inv[..., None]) + 8, 0, 15).astype(np.uint8)
        m = None
    elif scheme.bits == 4:
        mn, mx = x.min(axis=-1), x.max(axis=-1)
        d = ((mx - mn) / np.float32(15)).astype(F16)
        m = mn.astype(F16)
        inv = np.divide(one, d.astype(np.float32), out=np.zeros(d.shape, np.float32), where=d != 0)
        codes = np.clip(np.rint((x - m.astype(np.float32)[..., None]) * inv[..., None]), 0, 15).astype(np.uint8)
    else:
        d = (np.abs(x).max(axis=-1) / np.float32(127)).astype(F16)
        inv = np.divide(one, d.astype(np.float32), out=np.zeros(d.shape, np.float32), where=d != 0)
        codes = np.clip(np.rint(x * inv[..., None]), -127, 127).astype(np.int8)
        m = None
    return pack(name, scheme, (n, k), codes.reshape(n_pad, k_pad), d, m, kind, rope_interleaved)


# ------------------------------------------------------------------ activations


def quantize_activations(x: np.ndarray, g: int, k_pad: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The matmul's input stage (numpy twin): each row of x [M, K], zero-padded
    to k_pad, in groups of g: dx = amax/127, q = clip(rint(x * (127/amax)), -127, 127).
    Returns q int8 [M, k_pad], dx float32 [M, k_pad/g], sum(q) int32 [M, k_pad/g]."""
    x = np.asarray(x, np.float32)
    M, K = x.shape
    xp = np.zeros((M, k_pad), np.float32)
    xp[:, :K] = x
    xg = xp.reshape(M, k_pad // g, g)
    amax = np.abs(xg).max(axis=-1)
    dx = amax / np.float32(127)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax != 0)
    q = np.clip(np.rint(xg * inv[..., None]), -127, 127).astype(np.int8)
    return q.reshape(M, k_pad), dx, q.astype(np.int32).sum(axis=-1)


def matmul_a8_reference(x: np.ndarray, pw: Weight) -> np.ndarray:
    """float64 result of the W*A8 kernel's arithmetic: integer dot per group,
    then the group's scales (the kernels do this part in fp32)."""
    codes, d, m = unpack(pw)
    g, _, k_pad, _, ng = _geometry(pw.scheme, pw.shape)
    q, dx, sq = quantize_activations(x, g, k_pad)
    n = pw.shape[0]
    c = codes[:n].astype(np.int64).reshape(n, ng, g)
    acc = np.einsum("mgk,ngk->mng", q.astype(np.int64).reshape(-1, ng, g), c)  # exact integers
    dd = d[:n].astype(np.float64)[None]  # [1, n, ng]
    dxx = dx.astype(np.float64)[:, None, :]
    if pw.scheme.bits == 8:
        y = dd * dxx * acc
    elif pw.scheme.symmetric:
        y = dd * dxx * (acc - 8 * sq[:, None, :])
    else:
        y = dd * dxx * acc + m[:n].astype(np.float64)[None] * dxx * sq[:, None, :]
    return y.sum(axis=-1)
