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
The GGUF twins (repacked from a file without loss, never RTN targets):
  gguf_q5_0: w = d * (c - 16)       c in 0..31, groups of 32
  gguf_q5_1: w = d * c + m          c in 0..31
  gguf_q4_k: w = (D * sc) * c - (DM * mn)   c in 0..15; groups of 32 in super-blocks of 8
             (D, DM fp16 per super-block, sc, mn 6-bit per group, stored as bytes)
  gguf_q5_k: the same, c in 0..31
  gguf_q6_k: w = (D * sc) * (c - 32)        c in 0..63; groups of 16 in super-blocks of 16, sc int8
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llamajet import ops
from llamajet.errors import LlamajetError

# 2: fused q/k/v and gate/up tensors in saved models (formats/saved.py); the packed layout is
# version 1's, so version 1 folders still read
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)


@dataclass(frozen=True)
class QuantScheme:
    name: str
    bits: int              # 4 or 8
    group: int             # elements per scale along K; 0 = one group per row (per channel)
    symmetric: bool
    storage: str | None = None  # the kernels' storage type when not the RTN kind of (bits, symmetric)

    packed = True          # tiles of 16 rows, groups along K (formats/packed.py)
    np_dtype = np.uint8    # storage: bytes [tiles, super-blocks, block bytes]

    @property
    def code(self) -> ops.DType:  # the kernels' storage type
        if self.storage:
            return ops.dtype(self.storage)
        return {(4, True): ops.DType.PK_I4S, (4, False): ops.DType.PK_I4A, (8, True): ops.DType.PK_I8}[
            (self.bits, self.symmetric)]

    @property
    def rtn(self) -> bool:
        """Whether float weights can be quantized to it (the GGUF twins only hold a file's blocks)."""
        return self.storage is None

    @property
    def super(self) -> int:
        """Groups per super-block: 1, or the K-quants' 8 / 16 (their shared scales)."""
        return ops.packed_super(self.code)

    @property
    def act_dtype(self) -> str:
        """The int8 activation rows its W*A8 kernels read: "q8_actk" (one scale per
        256 values, so a super-block sums in integers) for the K-quant twins, else "q8_act"."""
        return ops.dtype_name(ops.packed_act_dtype(self.code))

    def act_span(self, k: int) -> int:
        """Activation values under one scale for rows of k elements (the group, or 256)."""
        return ops.qact_span(self.act_dtype, self.group_for(k))

    @property
    def kind(self) -> str:  # the storage type's name ("pk_i4a")
        return ops.dtype_name(self.code)

    def group_for(self, k: int) -> int:
        """Group length used for a row of k elements (per channel: the padded row)."""
        return self.group if self.group else -(-k // 8) * 8

    def k_padded(self, k: int) -> int:
        """K rounded up to whole super-blocks; the tail is zero weights (and zero activations)."""
        g = self.group_for(k) * self.super
        return -(-k // g) * g

    def block_bytes(self, k: int) -> int:
        """Bytes of one (16-row tile, super-block) block for rows of k elements."""
        return ops.packed_block_bytes(self.code, self.group_for(k))

    def storage_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        n, k = shape
        g = self.group_for(k) * self.super
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
for _g in (32, 64, 128):
    register(QuantScheme(f"int8_g{_g}", 8, _g, True))
register(QuantScheme("int8_pc", 8, 0, True))
register(QuantScheme("gguf_q5_0", 5, 32, True, "pk_i5s"))
register(QuantScheme("gguf_q5_1", 5, 32, False, "pk_i5a"))
register(QuantScheme("gguf_q4_k", 4, 32, False, "pk_q4k"))
register(QuantScheme("gguf_q5_k", 5, 32, False, "pk_q5k"))
register(QuantScheme("gguf_q6_k", 6, 16, True, "pk_q6k"))


def get_scheme(name: str) -> QuantScheme:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise LlamajetError(f"unknown quantization scheme {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None


def rtn_scheme(name: str) -> QuantScheme:
    """The scheme called `name` as a quantization target (RTN schemes only)."""
    s = get_scheme(name)
    if not s.rtn:
        known = ", ".join(sorted(x.name for x in schemes() if x.rtn))
        raise LlamajetError(f"{name!r} holds a GGUF file's blocks as they are and is no quantization target; "
                            f"quantize to one of: {known}")
    return s


def schemes() -> list[QuantScheme]:
    return list(_REGISTRY.values())
