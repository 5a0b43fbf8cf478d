"""Packed weight schemes: named, frozen, registered, versioned.

A scheme is one of the storage formats a Weight can have (formats/layout.py):
its matrices are packed for the kernels in tiles of 16 rows and groups of
`group` along K (the layout is formats/packed.py's). Bumping FORMAT_VERSION is
required whenever that layout changes, so a saved model from an older layout
is refused instead of silently misread.

Value of a weight, by kind (codes are unsigned bytes, scales fp16):
  int4 sym : w = d * (c - 8)        c in 0..15
  int4 asym: w = d * c + m          c in 0..15, m = the group's minimum (as GGUF Q4_1)
  int8 sym : w = d * c              c in -127..127 (signed byte; GGUF Q8_0 allows -128)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llamajet import ops
from llamajet.errors import LlamajetError

FORMAT_VERSION = 1


@dataclass(frozen=True)
class QuantScheme:
    name: str
    bits: int              # 4 or 8
    group: int             # elements per scale along K; 0 = one group per row (per channel)
    symmetric: bool
    scale_dtype: str = "f16"

    packed = True          # tiles of 16 rows, groups along K (formats/packed.py)
    np_dtype = np.uint8    # storage: bytes [tiles, groups, block bytes]

    @property
    def code(self) -> ops.DType:  # the kernels' storage type
        return {(4, True): ops.DType.PK_I4S, (4, False): ops.DType.PK_I4A, (8, True): ops.DType.PK_I8}[
            (self.bits, self.symmetric)]

    @property
    def kind(self) -> str:  # the storage type's name ("pk_i4a")
        return ops.dtype_name(self.code)

    def group_for(self, k: int) -> int:
        """Group length used for a row of k elements (per channel: the padded row)."""
        return self.group if self.group else -(-k // 8) * 8

    def k_padded(self, k: int) -> int:
        """K rounded up to whole groups; the tail is zero weights (and zero activations)."""
        g = self.group_for(k)
        return -(-k // g) * g

    def block_bytes(self, k: int) -> int:
        """Bytes of one (16-row tile, group) block for rows of k elements."""
        return ops.packed_block_bytes(self.code, self.group_for(k))

    def storage_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        n, k = shape
        g = self.group_for(k)
        return -(-n // ops.TILE), self.k_padded(k) // g, self.block_bytes(k)

    def to_f32(self, data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        from llamajet.formats.packed import dequantize_data

        return dequantize_data(self, data, shape).astype(np.float32)


_REGISTRY: dict[str, QuantScheme] = {}


def register(s: QuantScheme) -> QuantScheme:
    if s.name in _REGISTRY:
        raise ValueError(f"scheme {s.name!r} registered twice")
    _REGISTRY[s.name] = s
    return s


for _g in (16, 32, 64, 128):
    register(QuantScheme(f"int4_sym_g{_g}", 4, _g, True))
    register(QuantScheme(f"int4_asym_g{_g}", 4, _g, False))
register(QuantScheme("int8_g32", 8, 32, True))
register(QuantScheme("int8_pc", 8, 0, True))


def get_scheme(name: str) -> QuantScheme:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise LlamajetError(f"unknown quantization scheme {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None


def schemes() -> list[QuantScheme]:
    return list(_REGISTRY.values())
