"""Preparing loaded weights for the kernels (at load, once).

kernels="fast": GGUF Q4_0 / Q4_1 / Q8_0 matrices are repacked, without loss,
into the tile-interleaved packed schemes (Q4_0 -> int4_sym_g32, Q4_1 ->
int4_asym_g32, Q8_0 -> int8_g32) and run as W*A8 (int8 activations,
integer dot products). With `scheme`, float matrices are RTN-quantized to it.
kernels="a16": the same packed weights with float activations (W4A16/W8A16).
kernels="reference": weights as loaded, dequantized block by block in fp32
inside the matmul (the reference path the fast one is checked against).
Weights already packed (a model saved by `llamajet quantize`) pass through as
they are, unless `scheme` names a different one (then they are re-quantized
from their dequantized values).
"""

from __future__ import annotations

import dataclasses

from llamajet import ops
from llamajet.errors import LlamajetError
from llamajet.loaders import WeightTensor
from llamajet.quant.pack import PackedWeight, repack_gguf
from llamajet.quant.schemes import get_scheme

KERNELS = ("fast", "a16", "reference")
_GGUF_BLOCKS = ("q4_0", "q4_1", "q8_0")
_FLOATS = ("f32", "f16", "bf16")


def _is_matrix(name: str) -> bool:
    return not name.endswith("_norm")


def _norms_to_f32(weights: dict) -> dict:
    """RMSNorm weights as fp32 (the kernel reads fp32; HF bf16/f16 checkpoints
    store them in their own dtype). A few KB per layer, copied once."""
    out = dict(weights)
    for name, w in weights.items():
        if not _is_matrix(name) and getattr(w, "dtype", "f32") != "f32":
            out[name] = WeightTensor(name, "f32", tuple(w.shape), w.to_f32())
    return out


def prepare_weights(weights: dict, kernels: str = "fast", scheme: str | None = None) -> dict:
    """Returns a new name -> weight dict; untouched weights are the same objects."""
    if kernels not in KERNELS:
        raise LlamajetError(f"kernels={kernels!r}: use one of {', '.join(KERNELS)}")
    weights = _norms_to_f32(weights)
    if kernels == "reference":
        if scheme is not None:
            raise LlamajetError("a quantization scheme needs the packed kernels (kernels='fast' or 'a16')")
        return weights
    sch = get_scheme(scheme) if scheme else None
    out = {}
    for name, w in weights.items():
        inter = getattr(w, "rope_interleaved", False)
        if isinstance(w, PackedWeight) and (sch is None or w.scheme == sch):
            out[name] = w  # already in the kernels' layout (a saved model): used as mapped, no copy
        elif _is_matrix(name) and sch is not None and hasattr(w, "to_f32"):
            # the C++ quantizer: equal bit for bit to quantize_rtn (tests/test_packed.py), threaded
            data = ops.quantize_packed(sch.kind, sch.group_for(w.shape[1]), w.to_f32())
            pw = PackedWeight(name, sch, tuple(w.shape), data)
            out[name] = dataclasses.replace(pw, rope_interleaved=inter)
        elif _is_matrix(name) and getattr(w, "dtype", None) in _GGUF_BLOCKS:
            out[name] = repack_gguf(name, w.data, w.dtype, tuple(w.shape), rope_interleaved=inter)
        else:
            out[name] = w
    return out
