"""Storage formats of weights: what a Weight's bytes mean.

Three families, one small protocol (name, code, packed, np_dtype,
storage_shape, group_for, to_f32):
- FloatFormat: f32, f16, bf16 rows (bf16 held as raw uint16 bits);
- BlockFormat: GGML blocks along K, as in GGUF files (q8_0, q4_0, q4_1 read
  by the C++ core; q5_0, q5_1, q4_k, q5_k, q6_k held until repacked; block
  sizes checked against the `gguf` package's in tests);
- QuantScheme (formats/schemes.py): llamajet's packed, tile-interleaved schemes.
`get_format(name)` finds any of them by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llamajet import ops
from llamajet.errors import LlamajetError
from llamajet.formats.schemes import QuantScheme, get_scheme, schemes


@dataclass(frozen=True)
class FloatFormat:
    name: str            # f32 | f16 | bf16
    np_dtype: type       # numpy dtype of the storage (bf16: uint16 bits)

    packed = False

    @property
    def code(self) -> ops.DType:
        return ops.dtype(self.name)

    def group_for(self, k: int) -> int:
        return 0

    def storage_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(shape)

    def to_f32(self, data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        if self.name == "f32":
            return np.array(data, dtype=np.float32, copy=True)
        if self.name == "f16":
            return data.astype(np.float32)
        out = np.empty(data.shape, np.uint32)  # bf16: the top half of an fp32 (one array, no temporaries)
        out[...] = data
        out <<= 16
        return out.view(np.float32)


@dataclass(frozen=True)
class BlockFormat:
    """GGML blocks along the last dim, as in GGUF files. q8_0, q4_0, q4_1 are
    read by the C++ core as they are (the reference kernels); the others (q5_0,
    q5_1, q4_k, q5_k, q6_k) only hold a file's bytes until they are repacked
    into their packed twins (formats/gguf_blocks.py) or dequantized."""

    name: str

    packed = False
    np_dtype = np.uint8

    @property
    def native(self) -> bool:
        return self.name in ("q8_0", "q4_0", "q4_1")

    @property
    def code(self) -> ops.DType:
        if not self.native:
            raise LlamajetError(f"{self.name} blocks have no kernel of their own: they are repacked at load "
                                "(kernels='fast' or 'a16') or dequantized (kernels='reference')")
        return ops.dtype(self.name)

    def _qtype(self):
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType[self.name.upper()]

    @property
    def block_elems(self) -> int:
        from gguf import GGML_QUANT_SIZES

        return GGML_QUANT_SIZES[self._qtype()][0]

    @property
    def block_bytes(self) -> int:
        if self.native:
            return ops.ggml_block_bytes(self.code)
        from gguf import GGML_QUANT_SIZES

        return GGML_QUANT_SIZES[self._qtype()][1]

    def group_for(self, k: int) -> int:
        return 0

    def storage_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        qk = self.block_elems
        if not shape or shape[-1] % qk:
            raise ValueError(f"{self.name} needs the last dim of {tuple(shape)} to be a multiple of {qk}")
        return (*shape[:-1], shape[-1] // qk * self.block_bytes)

    def to_f32(self, data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        from gguf.quants import dequantize

        return np.ascontiguousarray(dequantize(data, self._qtype()), dtype=np.float32).reshape(shape)


Format = FloatFormat | BlockFormat | QuantScheme

FLOATS = {f.name: f for f in (FloatFormat("f32", np.float32), FloatFormat("f16", np.float16),
                              FloatFormat("bf16", np.uint16))}
BLOCKS = {b: BlockFormat(b) for b in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")}


def get_format(name: str) -> Format:
    """The format called `name`: a float type, a GGML block type or a packed scheme."""
    if name in FLOATS:
        return FLOATS[name]
    if name in BLOCKS:
        return BLOCKS[name]
    try:
        return get_scheme(name)
    except LlamajetError:
        known = ", ".join([*FLOATS, *BLOCKS, *sorted(s.name for s in schemes())])
        raise LlamajetError(f"unknown weight format {name!r}; known: {known}") from None


__all__ = ["BLOCKS", "FLOATS", "BlockFormat", "FloatFormat", "Format", "QuantScheme", "get_format"]
