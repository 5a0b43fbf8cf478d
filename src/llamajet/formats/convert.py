"""Weights as the kernels want them, prepared once at load.

repack=True (the packed kernels, W*A8 or W*A16):
  - GGUF Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K matrices ->
    their lossless packed twins (formats/gguf_blocks.py), deferred: their
    bytes are written by formats.pending.materialize after the fusion
    passes placed them (compile_graph);
  - with `scheme`, every quantizable float matrix (MATRIX, EMBEDDING) is
    RTN-quantized to it by the C++ quantizer (bit for bit formats.packed's
    numpy rule), on `n_threads` threads of tier `isa` -- except the token
    embedding and the output head, which keep at least 8 bits when `scheme`
    has fewer (head_scheme);
  - without `scheme`, float matrices (an HF checkpoint's) are RTN'd to
    `float_scheme` (RuntimeConfig.float_scheme: int8_g32 by default);
  - weights already packed (a saved model) pass through as mapped, unless
    `scheme` names another scheme (then re-quantized from their values).
repack=False (the reference kernels): weights as loaded, dequantized block by
block in fp32 inside the matmul (the GGUF block types without a reference
kernel, Q5_0 .. Q6_K: dequantized to fp32 here).
Always: NORM and BIAS vectors become fp32 (the kernels read fp32; an HF bf16
checkpoint stores them in its own dtype: a few KB per layer, copied once).
"""

from __future__ import annotations

import numpy as np

from llamajet import ops
from llamajet.errors import LlamajetError
from llamajet.formats import pages
from llamajet.formats.gguf_blocks import LOSSLESS
from llamajet.formats.pending import deferred_twin
from llamajet.formats.schemes import QuantScheme, get_scheme, rtn_scheme
from llamajet.formats.layout import BlockFormat, FloatFormat, get_format
from llamajet.formats.weight import Kind, Weight, float_weight


def prepare_weights(weights: dict[str, Weight], *, repack: bool = True, scheme: str | None = None,
                    float_scheme: str | None = None, isa: str | None = None, n_threads: int | None = None,
                    release=None) -> dict[str, Weight]:
    """Returns a new name -> Weight dict; untouched weights are the same objects.
    float_scheme: the scheme float matrices (only) are RTN'd to when `scheme` is None.
    release(w): called with each source weight once it was quantized (its file pages can go)."""
    if (scheme is not None or float_scheme is not None) and not repack:
        raise LlamajetError("a quantization scheme needs the packed kernels (kernels='fast' or 'a16')")
    sch = rtn_scheme(scheme) if scheme else None
    fsch = rtn_scheme(float_scheme) if float_scheme and not scheme else None
    out = {}
    for name, w in weights.items():
        wsch = head_scheme(w, sch) if sch is not None and is_head(w) else sch
        if w.kind in (Kind.NORM, Kind.BIAS) and w.dtype != "f32":
            out[name] = float_weight(name, w.kind, w.to_f32())
        elif not w.kind.quantizable:
            out[name] = w
        elif not repack:
            if isinstance(w.format, BlockFormat) and not w.format.native:  # no kernel reads these blocks
                w = Weight(name, w.kind, get_format("f32"), w.shape, w.to_f32(), w.rope_interleaved)
            out[name] = w
        elif (target := _rtn_target(w, wsch, fsch)) is not None:
            out[name] = w.with_data(name, target, w.shape, _rtn(target, w, isa, n_threads, release))
        elif w.dtype in LOSSLESS:
            out[name] = deferred_twin(w)  # written once, into its final buffer (formats/pending.py)
        else:
            out[name] = w  # already in the kernels' layout (a saved model): used as mapped, no copy
    return out


def _rtn_target(w: Weight, sch, fsch):
    """The scheme quantizable weight w is RTN'd to, or None: `scheme` for every
    weight not already in it (GGUF blocks whose lossless twin it is are
    repacked, not rounded again), else float_scheme for float matrices."""
    if sch is not None:
        return None if lossless_to(w, sch) else sch
    return fsch if isinstance(w.format, FloatFormat) else None


def lossless_to(w: Weight, sch: QuantScheme | None) -> bool:
    """w becomes scheme `sch` without a value changing: it is packed in it already, or it holds GGUF
    blocks whose packed twin `sch` is (None: kept as it is)."""
    if sch is None:
        return True
    if w.packed:
        return w.scheme == sch
    return LOSSLESS.get(w.dtype) == sch.name


HEAD_SCHEME = "int8_g32"  # the Q8_0 layout: what float embeddings / heads keep under a 4-bit scheme


def is_head(w: Weight) -> bool:
    """The token embedding and the (untied) output head: one row looked up per token, and the
    matrix whose error reaches every logit. A tied model's head is its embedding."""
    return w.kind is Kind.EMBEDDING or w.name == "output"


def head_scheme(w: Weight, sch: QuantScheme) -> QuantScheme:
    """The scheme the embedding / output head `w` takes when the model is quantized to `sch` and
    no scheme was named for them: `sch` itself when it has 8 bits or more; else the weight's own
    type when it is already quantized in a type the kernels hold without loss (a GGUF Q8_0 / Q4_1
    / Q6_K ... table, a saved model's scheme: rounding it again cannot restore what its first
    rounding lost, and keeps its size); else int8_g32 (float tables; the GGUF types without a
    twin, dequantized at load). Measured on SmolLM2 (issue 45, docs/quantization.md): RTN
    int4_sym_g128 with the head at int4 is PPL 62.87, with it kept at 8 bits 50.70 (float 34.97);
    llama.cpp's 4-bit mixes likewise keep the output matrix at Q6_K or better."""
    if sch.bits >= 8:
        return sch
    if w.packed:
        return w.scheme
    if w.dtype in LOSSLESS:
        return get_scheme(LOSSLESS[w.dtype])
    return rtn_scheme(HEAD_SCHEME)


_SLAB = 2048  # rows quantized per call: one slab's fp32 copy is the transient (16 MB at K = 2048)


def _rtn(sch, w: Weight, isa, n_threads, release=None):
    """RTN of w to scheme sch in slabs of rows, so the fp32 copy a float (or
    block) matrix passes through is one slab's, not the whole matrix's (a
    Llama-3 embedding table in fp32 is 1 GiB). Slabs are whole tiles, so the
    packed slabs are consecutive tiles of the result. release(src): each
    slab's (or the whole matrix's) source once quantized."""
    n, k = w.shape
    g = sch.group_for(k)
    if n <= _SLAB or isinstance(w.format, BlockFormat) or w.packed:
        data = ops.quantize_packed(sch.code, g, w.to_f32(), isa, n_threads)
        if release is not None:
            release(w)  # its file pages
        return data
    out = pages.empty(sch.storage_shape((n, k)))
    for r0 in range(0, n, _SLAB):
        src = w.data[r0 : r0 + _SLAB]
        part = ops.quantize_packed(sch.code, g, w.format.to_f32(src, (len(src), k)), isa, n_threads)
        out[r0 // ops.TILE : r0 // ops.TILE + part.shape[0]] = part
        if release is not None:
            release(src)  # this slab's file pages
    return out
