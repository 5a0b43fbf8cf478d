"""The bridge to the C++ core: the only module that imports ``llamajet._core``.

Constants here mirror ``csrc/common.h`` (op kinds, storage types, row codes);
``Executor`` is the C++ executor; ``ref`` holds the numpy twin of every op.
"""

from __future__ import annotations

import numpy as np

from llamajet import _core
from llamajet.ops.dispatch import default_threads, resolve_isa, supported_isas

Executor = _core.Executor
cpu_features = _core.cpu_features

# Storage types (csrc/common.h DType).
DTYPES = {"f32": 0, "f16": 1, "bf16": 2, "q8_0": 3, "q4_0": 4, "q4_1": 5,
          # packed tile-interleaved schemes (quant/pack.py)
          "pk_i4s": 6, "pk_i4a": 7, "pk_i8": 8}
QUANT_BLOCK = 32  # elements per GGML block
_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}

# Op kinds (csrc/common.h OpKind).
OPS = {
    "embed": 0,
    "rmsnorm": 1,
    "matmul": 2,
    "rope": 3,
    "kv_write": 4,
    "attention": 5,
    "swiglu": 6,
    "add": 7,
    "gather": 8,
    "add_rmsnorm": 9,
    "quantize": 10,
    "argmax": 11,
}

# Leading-dimension codes resolved per step by the executor.
ROWS_TOKENS = -1
ROWS_OUT = -2


def row_bytes(dtype: str, k: int) -> int:
    """Bytes one row of k elements takes in storage type `dtype`."""
    if dtype in _BLOCK_BYTES:
        if k % QUANT_BLOCK:
            raise ValueError(f"{dtype} rows need a multiple of {QUANT_BLOCK} elements, got {k}")
        return k // QUANT_BLOCK * _BLOCK_BYTES[dtype]
    return k * {"f32": 4, "f16": 2, "bf16": 2}[dtype]


def quantize_packed(dtype: str, group: int, w: np.ndarray, isa: str | None = None,
                    n_threads: int | None = None) -> np.ndarray:
    """C++ RTN quantization of float32 w [N, K] into packed `dtype` ("pk_i4s",
    "pk_i4a", "pk_i8"): uint8 [tiles, groups, block bytes], equal bit for bit
    to quant.pack.quantize_rtn's data."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    return _core.quantize_packed(resolve_isa(isa), DTYPES[dtype], group, w, n_threads or default_threads())


def dequantize_packed(dtype: str, group: int, shape: tuple[int, int], packed: np.ndarray,
                      isa: str | None = None, n_threads: int | None = None) -> np.ndarray:
    """C++ dequantization of a packed weight to float32 [N, K]."""
    return _core.dequantize_packed(resolve_isa(isa), DTYPES[dtype], group, shape[0], shape[1],
                                   np.ascontiguousarray(packed), n_threads or default_threads())


def i32(a) -> np.ndarray:
    """A C-contiguous int32 array, as the executor's step inputs require."""
    return np.ascontiguousarray(a, dtype=np.int32)


__all__ = [
    "DTYPES", "Executor", "OPS", "QUANT_BLOCK", "ROWS_OUT", "ROWS_TOKENS", "cpu_features",
    "default_threads", "dequantize_packed", "i32", "quantize_packed", "resolve_isa", "row_bytes",
    "supported_isas",
]
