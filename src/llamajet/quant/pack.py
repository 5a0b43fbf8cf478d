"""Packed weight layout for the kernels, and its numpy reference.

A packed [N, K] matrix is cut into tiles of TILE_ROWS (16) rows and, along
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

import dataclasses
from dataclasses import dataclass

import numpy as np

from llamajet.quant.schemes import FORMAT_VERSION, TILE_ROWS, QuantScheme, get_scheme

F16 = np.float16


def block_bytes(scheme: QuantScheme, g: int) -> int:
    codes = TILE_ROWS * g // 2 if scheme.bits == 4 else TILE_ROWS * g
    return codes + 2 * TILE_ROWS * (1 if scheme.symmetric else 2)


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A weight matrix in a packed scheme (see the module docstring)."""

    name: str
    scheme: QuantScheme
    shape: tuple[int, int]  # logical [N, K]
    data: np.ndarray        # uint8 [n_tiles, n_groups, block_bytes]
    version: int = FORMAT_VERSION
    rope_interleaved: bool = False  # carried over from the loaded weight (see loaders)

    packed = True  # tile-interleaved storage (loaders.WeightTensor: row-major)

    @property
    def dtype(self) -> str:  # the kernels' storage type name
        return self.scheme.kind

    @property
    def group(self) -> int:
        return self.scheme.group_for(self.shape[1])

    @property
    def k_pad(self) -> int:
        return self.scheme.k_padded(self.shape[1])

    @property
    def n_pad(self) -> int:
        return -(-self.shape[0] // TILE_ROWS) * TILE_ROWS

    @property
    def n_groups(self) -> int:
        return self.k_pad // self.group

    def to_f32(self) -> np.ndarray:
        return dequantize(self).astype(np.float32)


# ------------------------------------------------------------------ layout


def _pad(a: np.ndarray, n_pad: int, k_pad: int, fill_rows=0) -> np.ndarray:
    n, k = a.shape
    if k_pad > k:
        a = np.concatenate([a, np.repeat(a[:, -1:], k_pad - k, axis=1)], axis=1)
    if n_pad > n:
        a = np.concatenate([a, np.full((n_pad - n, a.shape[1]), fill_rows, a.dtype)], axis=0)
    return a


def pack(name: str, scheme: QuantScheme, shape: tuple[int, int], codes: np.ndarray, d: np.ndarray,
         m: np.ndarray | None = None) -> PackedWeight:
    """Lays out codes [N_pad, K_pad] (uint8 for int4, int8 for int8) and fp16
    scales d (and mins m) [N_pad, n_groups] in the kernels' order."""
    n_pad, k_pad = codes.shape
    g = scheme.group_for(shape[1])
    nt, ng = n_pad // TILE_ROWS, k_pad // g
    c = np.ascontiguousarray(codes).view(np.uint8).reshape(nt, TILE_ROWS, ng, g).transpose(0, 2, 1, 3)
    if scheme.bits == 4:
        c = c.reshape(nt, ng, TILE_ROWS, g // 8, 2, 4)
        c = (c[..., 0, :] | (c[..., 1, :] << 4)).transpose(0, 1, 3, 2, 4)  # [nt, ng, chunk, row, 4]
    else:
        c = c.reshape(nt, ng, TILE_ROWS, g // 4, 4).transpose(0, 1, 3, 2, 4)
    parts = [c.reshape(nt, ng, -1)]
    for s in (d, m) if m is not None else (d,):
        parts.append(np.ascontiguousarray(s.astype(F16)).view(np.uint8).reshape(nt, TILE_ROWS, ng, 2)
                     .transpose(0, 2, 1, 3).reshape(nt, ng, 2 * TILE_ROWS))
    data = np.ascontiguousarray(np.concatenate(parts, axis=-1))
    assert data.shape[-1] == block_bytes(scheme, g)
    return PackedWeight(name, scheme, tuple(shape), data)


def unpack(pw: PackedWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Inverse of pack: codes [N_pad, K_pad], d and m [N_pad, n_groups] (fp16)."""
    s, g, nt, ng = pw.scheme, pw.group, pw.n_pad // TILE_ROWS, pw.n_groups
    cb = block_bytes(s, g) - 2 * TILE_ROWS * (1 if s.symmetric else 2)
    raw = pw.data.reshape(nt, ng, -1)
    c = raw[..., :cb]
    if s.bits == 4:
        c = c.reshape(nt, ng, g // 8, TILE_ROWS, 4).transpose(0, 1, 3, 2, 4)
        c = np.stack([c & 0x0F, c >> 4], axis=-2).reshape(nt, ng, TILE_ROWS, g)
        codes = c
    else:
        codes = c.reshape(nt, ng, g // 4, TILE_ROWS, 4).transpose(0, 1, 3, 2, 4).reshape(
            nt, ng, TILE_ROWS, g).view(np.int8)
    codes = codes.transpose(0, 2, 1, 3).reshape(pw.n_pad, pw.k_pad)

    def scales(off):
        return np.ascontiguousarray(raw[..., off : off + 2 * TILE_ROWS]).view(F16).reshape(
            nt, ng, TILE_ROWS).transpose(0, 2, 1).reshape(pw.n_pad, ng)

    d = scales(cb)
    m = None if s.symmetric else scales(cb + 2 * TILE_ROWS)
    return codes, d, m


def dequantize(pw: PackedWeight) -> np.ndarray:
    """float64 [N, K] values of a packed weight."""
    codes, d, m = unpack(pw)
    g = pw.group
    c = codes.astype(np.float64).reshape(pw.n_pad, pw.n_groups, g)
    dd = d.astype(np.float64)[..., None]
    if pw.scheme.bits == 8:
        w = dd * c
    elif pw.scheme.symmetric:
        w = dd * (c - 8.0)
    else:
        w = dd * c + m.astype(np.float64)[..., None]
    return w.reshape(pw.n_pad, pw.k_pad)[: pw.shape[0], : pw.shape[1]]


# ------------------------------------------------------------------ quantizers


def quantize_rtn(name: str, w: np.ndarray, scheme: QuantScheme | str) -> PackedWeight:
    """Round-to-nearest quantization of float weights [N, K] (rule: module docstring)."""
    scheme = get_scheme(scheme) if isinstance(scheme, str) else scheme
    n, k = w.shape
    g = scheme.group_for(k)
    n_pad, k_pad = -(-n // TILE_ROWS) * TILE_ROWS, scheme.k_padded(k)
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
    return pack(name, scheme, (n, k), codes.reshape(n_pad, k_pad), d, m)


def repack_gguf(name: str, raw: np.ndarray, ggml_type: str, shape: tuple[int, int],
                rope_interleaved: bool = False) -> PackedWeight:
    """GGUF Q4_0 / Q4_1 / Q8_0 blocks -> the equivalent packed scheme, without loss:
    Q4_0 = int4 sym g32, Q4_1 = int4 asym g32 (its min is our m), Q8_0 = int8 g32."""
    n, k = shape
    nb = k // 32
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(n, nb, -1)
    d = blocks[..., 0:2].copy().view(F16)[..., 0]
    m = None
    if ggml_type == "q8_0":
        scheme = get_scheme("int8_g32")
        codes = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
    else:
        nib = blocks[..., -16:]
        codes = np.concatenate([nib & 0x0F, nib >> 4], axis=-1).reshape(n, k)
        if ggml_type == "q4_1":
            scheme = get_scheme("int4_asym_g32")
            m = blocks[..., 2:4].copy().view(F16)[..., 0]
        elif ggml_type == "q4_0":
            scheme = get_scheme("int4_sym_g32")
        else:
            raise ValueError(f"cannot repack {ggml_type!r} without loss")
    n_pad = -(-n // TILE_ROWS) * TILE_ROWS
    codes = _pad(codes, n_pad, k, fill_rows=0)
    d = _pad(d, n_pad, nb, fill_rows=0)
    m = _pad(m, n_pad, nb, fill_rows=0) if m is not None else None
    pw = pack(name, scheme, (n, k), codes, d, m)
    return dataclasses.replace(pw, rope_interleaved=rope_interleaved)


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


def matmul_a8_reference(x: np.ndarray, pw: PackedWeight) -> np.ndarray:
    """float64 result of the W*A8 kernel's arithmetic: integer dot per group,
    then the group's scales (the kernels do this part in fp32)."""
    codes, d, m = unpack(pw)
    g, ng = pw.group, pw.n_groups
    q, dx, sq = quantize_activations(x, g, pw.k_pad)
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
