"""Weight quantization schemes: named, frozen, registered, versioned.

Every packed weight is one of these. The packed *layout* (how codes and
scales are arranged for the kernels) is described in ``quant/pack.py``;
bumping FORMAT_VERSION is required whenever that layout changes, so a saved
model from an older layout is refused instead of silently misread.

Value of a weight, by kind (codes are unsigned bytes, scales fp16):
  int4 sym : w = d * (c - 8)        c in 0..15
  int4 asym: w = d * c + m          c in 0..15, m = the group's minimum (as GGUF Q4_1)
  int8 sym : w = d * c              c in -127..127 (signed byte; GGUF Q8_0 allows -128)
"""

from __future__ import annotations

from dataclasses import dataclass

FORMAT_VERSION = 1
TILE_ROWS = 16  # rows interleaved per tile: one AVX-512 vector of int32 lanes


@dataclass(frozen=True)
class QuantScheme:
    name: str
    bits: int              # 4 or 8
    group: int             # elements per scale along K; 0 = one group per row (per channel)
    symmetric: bool
    scale_dtype: str = "f16"

    @property
    def kind(self) -> str:  # the kernels' storage type name
        return {(4, True): "pk_i4s", (4, False): "pk_i4a", (8, True): "pk_i8"}[(self.bits, self.symmetric)]

    def group_for(self, k: int) -> int:
        """Group length used for a row of k elements (per channel: the padded row)."""
        return self.group if self.group else -(-k // 8) * 8

    def k_padded(self, k: int) -> int:
        """K rounded up to whole groups; the tail is zero weights (and zero activations)."""
        g = self.group_for(k)
        return -(-k // g) * g


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
        from llamajet.errors import LlamajetError

        raise LlamajetError(f"unknown quantization scheme {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None


def schemes() -> list[QuantScheme]:
    return list(_REGISTRY.values())
