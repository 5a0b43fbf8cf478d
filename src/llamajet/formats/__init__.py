"""The one owner of weight layouts.

    weight.py       Weight (name, kind, format, shape, raw bytes) and Kind
    layout.py       the storage formats: float, GGML blocks, packed schemes
    schemes.py      the packed schemes: named, frozen, registered, versioned
    packed.py       the packed tile layout: pack / unpack, RTN, numpy references
    gguf_blocks.py  GGUF Q4_0 / Q4_1 / Q8_0 -> packed, without loss
    stack.py        tile stacking for fused weights (QKV, gate/up)
    convert.py      prepare_weights: weights as the kernels want them, at load
    safetensors.py  the safetensors container (mmap reading, aligned writing)
    saved.py        llamajet's saved format: reader and writer

Loaders produce Weights through it; graph passes ask it to stack them; the
quantization algorithms (quant/) produce packed Weights through it.
"""

from llamajet.formats.layout import Format, get_format
from llamajet.formats.schemes import FORMAT_VERSION, QuantScheme, get_scheme, schemes
from llamajet.formats.weight import Kind, Weight, float_weight

__all__ = ["FORMAT_VERSION", "Format", "Kind", "QuantScheme", "Weight", "float_weight", "get_format", "get_scheme",
           "schemes"]
