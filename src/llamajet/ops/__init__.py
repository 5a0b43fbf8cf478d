"""The bridge to the C++ core: the only module that imports ``llamajet._core``.

Every code comes from the extension, never re-declared here: storage types
(``DType``; Python names them by the lower-cased member name, e.g. ``"pk_i4a"``),
op kinds, matmul epilogues and prologues, the KV cache types by option name
(``KV_DTYPES``), the size rules (``tensor_bytes``) and one params class per
op family (``OPS[name]``, fields by name; see csrc/kernels/ops.h). ``ref``
holds the numpy twin of every op.
"""

from __future__ import annotations

import numpy as np

from llamajet import _core
from llamajet.ops.dispatch import (ThreadsClampedWarning, default_threads, resolve_isa, resolve_threads,
                                   supported_isas, usable_cores)

Executor = _core.Executor
Ref = _core.Ref
DType = _core.DType
OpKind = _core.OpKind
Epilogue = _core.Epilogue
Prologue = _core.Prologue
cpu_features = _core.cpu_features
step_allocations = _core.step_allocations
read_bandwidth = _core.read_bandwidth  # (nbytes, n_threads, reps) -> best bytes/s

OPS: dict[str, type] = dict(_core.OPS)          # graph op name -> params class
KV_DTYPES: dict[str, DType] = dict(_core.KV_DTYPES)  # KV cache option name -> storage type
TILE: int = _core.TILE                          # rows per packed tile
QK: int = _core.QK                              # elements per GGML quant block
ROWS_TOKENS: int = _core.ROWS_TOKENS            # a Ref's rows: the step's token count
ROWS_OUT: int = _core.ROWS_OUT                  # a Ref's rows: the step's logits rows


def dtype(name: str | DType) -> DType:
    """The storage type called `name` ("f32", "q4_1", "pk_i4a", "q8_act", ...)."""
    if isinstance(name, DType):
        return name
    try:
        return DType[name.upper()]
    except KeyError:
        known = ", ".join(m.name.lower() for m in DType)
        raise ValueError(f"unknown storage type {name!r}; known: {known}") from None


def dtype_name(code: DType | int) -> str:
    return DType(int(code)).name.lower()


def tensor_bytes(dt: str | DType, rows: int, cols: int, group: int = 0) -> int:
    """Bytes of a [rows, cols] tensor of storage type `dt` (the executor's rule)."""
    n = _core.tensor_bytes(dtype(dt), rows, cols, group)
    if n < 0:
        raise ValueError(f"{dtype_name(dtype(dt))} cannot hold a [{rows}, {cols}] tensor (group {group})"
                         + (f": rows need a multiple of {QK} elements" if dtype(dt) in GGML_BLOCK_TYPES else ""))
    return n


def row_bytes(dt: str | DType, k: int) -> int:
    """Bytes one row of k elements takes in a row-major storage type."""
    return tensor_bytes(dt, 1, k)


GGML_BLOCK_TYPES = frozenset(t for t in DType if _core.ggml_block_bytes(t) > 0)


def ggml_block_bytes(dt: str | DType) -> int:
    """Bytes of one GGML block of QK elements (q8_0: 34, ...)."""
    return _core.ggml_block_bytes(dtype(dt))


def packed_block_bytes(dt: str | DType, group: int) -> int:
    """Bytes of one (16-row tile, group) block of a packed storage type."""
    return _core.packed_block_bytes(dtype(dt), group)


def packed_super(dt: str | DType) -> int:
    """Groups per super-block of a packed type (1; the K-quants 8 or 16)."""
    return _core.packed_super(dtype(dt))


def packed_act_dtype(dt: str | DType) -> DType:
    """The int8 activation type a packed type's W*A8 kernels read: Q8_ACTK (one
    scale per 256 values, llama.cpp's Q8_K rule) for the K-quants, else Q8_ACT."""
    return _core.packed_act_dtype(dtype(dt))


def qact_span(dt: str | DType, group: int) -> int:
    """Values under one scale in a Q8_ACT (the group) or Q8_ACTK (256) row."""
    return _core.qact_span(dtype(dt), group)


def packed_code_bits(dt: str | DType) -> int:
    """Bits per code of a packed type (4, 5, 6, 8)."""
    return _core.packed_code_bits(dtype(dt))


def quantize_packed(dt: str | DType, group: int, w: np.ndarray, isa: str | None = None,
                    n_threads: int | None = None) -> np.ndarray:
    """C++ RTN quantization of float32 w [N, K] into packed `dt` ("pk_i4s",
    "pk_i4a", "pk_i8"): uint8 [tiles, groups, block bytes], equal bit for bit
    to formats.packed.quantize_rtn's data."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    return _core.quantize_packed(resolve_isa(isa), dtype(dt), group, w, n_threads or default_threads())


def dequantize_packed(dt: str | DType, group: int, shape: tuple[int, int], packed: np.ndarray,
                      isa: str | None = None, n_threads: int | None = None) -> np.ndarray:
    """C++ dequantization of a packed weight to float32 [N, K]."""
    return _core.dequantize_packed(resolve_isa(isa), dtype(dt), group, shape[0], shape[1],
                                   np.ascontiguousarray(packed), n_threads or default_threads())


def repack_gguf(gguf_type: str, src: np.ndarray, shape: tuple[int, int], dst: np.ndarray, dst_offset: int = 0,
                tile_stride: int | None = None, n_threads: int | None = None) -> None:
    """C++ repack of a GGUF [N, K] block matrix (its raw bytes, e.g. a view of
    the file's map) into its packed twin's tiles at dst (uint8, C-contiguous),
    tile t at byte dst_offset + t * tile_stride (default: the tile's bytes)."""
    _core.repack_gguf(gguf_type, np.ascontiguousarray(src).view(np.uint8).reshape(-1), shape[0], shape[1],
                      dst.reshape(-1), dst_offset, tile_stride or 0, n_threads or default_threads())


def i32(a) -> np.ndarray:
    """A C-contiguous int32 array, as the executor's step inputs require."""
    return np.ascontiguousarray(a, dtype=np.int32)


__all__ = [
    "DType", "Epilogue", "Executor", "GGML_BLOCK_TYPES", "KV_DTYPES", "OPS", "OpKind", "Prologue", "QK",
    "ROWS_OUT", "ROWS_TOKENS", "Ref", "TILE", "ThreadsClampedWarning", "cpu_features", "default_threads",
    "dequantize_packed", "dtype", "dtype_name", "ggml_block_bytes", "i32", "packed_act_dtype",
    "packed_block_bytes", "packed_code_bits", "packed_super", "qact_span", "quantize_packed", "repack_gguf",
    "resolve_isa", "resolve_threads", "row_bytes", "step_allocations", "supported_isas", "tensor_bytes",
    "usable_cores",
]
