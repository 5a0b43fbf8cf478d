"""Weights as the kernels want them, prepared once at load.

repack=True (the packed kernels, W*A8 or W*A16):
  - GGUF Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K matrices ->
    their lossless packed twins (formats/gguf_blocks.py), deferred: their
    bytes are written by formats.pending.materialize after the fusion
    passes placed them (compile_graph);
  - with `scheme`, every quantizable float matrix (MATRIX, EMBEDDING) is
    RTN-quantized to it by the C++ quantizer (bit for bit formats.packed's
    numpy rule), on `n_threads` threads of tier `isa`;
  - weights already packed (a saved model) pass through as mapped, unless
    `scheme` names another scheme (then re-quantized from their values).
repack=False (the reference kernels): weights as loaded, dequantized block by
block in fp32 inside the matmul (the GGUF block types without a reference
kernel, Q5_0 .. Q6_K: dequantized to fp32 here).
Always: NORM and BIAS vectors become fp32 (the kernels read fp32; an HF bf16
checkpoint stores them in its own dtype: a few KB per layer, copied once).
"""

from __future__ import annotations

from llamajet import ops
from llamajet.errors import LlamajetError
from llamajet.formats.gguf_blocks import LOSSLESS
from llamajet.formats.pending import deferred_twin
from llamajet.formats.schemes import rtn_scheme
from llamajet.formats.layout import BlockFormat, get_format
from llamajet.formats.weight import Kind, Weight, float_weight


def prepare_weights(weights: dict[str, Weight], *, repack: bool = True, scheme: str | None = None,
                    isa: str | None = None, n_threads: int | None = None) -> dict[str, Weight]:
    """Returns a new name -> Weight dict; untouched weights are the same objects."""
    if scheme is not None and not repack:
        raise LlamajetError("a quantization scheme needs the packed kernels (kernels='fast' or 'a16')")
    sch = rtn_scheme(scheme) if scheme else None
    out = {}
    for name, w in weights.items():
        if w.kind in (Kind.NORM, Kind.BIAS) and w.dtype != "f32":
            out[name] = float_weight(name, w.kind, w.to_f32())
        elif not w.kind.quantizable:
            out[name] = w
        elif not repack:
            if isinstance(w.format, BlockFormat) and not w.format.native:  # no kernel reads these blocks
                w = Weight(name, w.kind, get_format("f32"), w.shape, w.to_f32(), w.rope_interleaved)
            out[name] = w
        elif w.packed and (sch is None or w.scheme == sch):
            out[name] = w  # already in the kernels' layout (a saved model): used as mapped, no copy
        elif sch is not None:
            data = ops.quantize_packed(sch.code, sch.group_for(w.shape[1]), w.to_f32(), isa, n_threads)
            out[name] = w.with_data(name, sch, w.shape, data)
        elif w.dtype in LOSSLESS:
            out[name] = deferred_twin(w)  # written once, into its final buffer (formats/pending.py)
        else:
            out[name] = w
    return out
