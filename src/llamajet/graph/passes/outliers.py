"""Outlier channels of the W*A8 matmuls' int8 inputs.

A matmul input quantized to int8 in groups of 32 shares one scale per group,
so a channel whose values run 10-100x the others' (LLMs have a few such
channels in every norm output and in the SwiGLU activations) sets the step
for the 31 values beside it. The fix kept per input, hence per weight: the
k channels of largest max |x| on calibration text (engine/outliers.py) are
held as 0 by the quantizer that writes the input (add_rmsnorm's qout, a
quantize op) and their float values written beside it (xo [T, k]); every
matmul reading that input adds the product of those columns of its weight
(ow: W[:, channels] in fp16, tile-transposed) to its result before the bias
and the epilogue (csrc/kernels/matmul_epilogue.inc, add_bias). A row's result still
depends on that row alone: batched equals alone, bit for bit.

Pattern: a node writing a Q8_ACT tensor (add_rmsnorm's qout, quantize's out)
that only prequant matmuls read, and a channel list for that node's name.
Legality: the readers are packed matmuls with the prequant prologue (the
fusion passes made them so); every reader gets the same channels (they share
the quantized input). Inputs quantized elsewhere (attention's quantize-on-
write for the output projection, a matmul's own input stage) are left as they
are: `quantized_inputs` lists only what this pass can rewrite.

Run after the fusion passes (with FusionContext(prequant_head=True), so the
LM head reads a quantized input too), not as one of them: the channels come
from running the fused graph.
"""

from __future__ import annotations

import numpy as np

from llamajet import ops
from llamajet.formats.layout import FLOATS, FloatFormat
from llamajet.formats.weight import Kind, Weight
from llamajet.graph.ir import Graph, Node

_I32 = FloatFormat("i32", np.int32)  # a table of channel indices (not a weight format users pick)
_WRITES = {"add_rmsnorm": "qout", "quantize": "out"}


def quantized_inputs(graph: Graph) -> list[tuple[Node, str, list[Node]]]:
    """(producer, its Q8_ACT output, the matmuls reading it) for every int8 input this pass can rewrite."""
    out = []
    for n in graph.nodes:
        field = _WRITES.get(n.op)
        t = n.outputs.get(field) if field else None
        if t is None or t in graph.outputs:
            continue
        readers = graph.consumers(t)
        if readers and all(r.op == "matmul" and r.inputs.get("qin") == t
                           and r.attrs.get("prologue") == ops.Prologue.PREQUANT for r in readers):
            out.append((n, t, readers))
    return out


def weight_columns(w: Weight, cols: np.ndarray) -> np.ndarray:
    """W[:, cols] in float32 ([N, k]), in the weight's own row order (stacked, tile-interleaved: as
    the kernel's tiles hold it)."""
    return np.ascontiguousarray(w.to_f32().reshape(w.shape[0], -1)[:, cols], np.float32)


def tile_columns(cols: np.ndarray) -> np.ndarray:
    """[N, k] columns as the kernel reads them: per 16-row tile [k][16] (rows past N zero), fp16."""
    n, k = cols.shape
    tiles = -(-n // ops.TILE)
    pad = np.zeros((tiles * ops.TILE, k), np.float32)
    pad[:n] = cols
    return np.ascontiguousarray(pad.reshape(tiles, ops.TILE, k).transpose(0, 2, 1).reshape(tiles * k, ops.TILE)
                                .astype(np.float16))


def apply(graph: Graph, channels: dict[str, np.ndarray], columns=weight_columns,
          tiled: dict[str, np.ndarray] | None = None) -> list[str]:
    """Gives each quantized input named in `channels` (by its producer's node name) its outlier
    channels: ocols and xo on the producer, ow and xo on every reader. `columns(w, cols)` gives
    W[:, cols] ([N, k] float32; default: from a float copy of the whole weight); `tiled` may hold
    a reader's ow already (by its weight's name: a weight_cache entry's, api.py), used when its
    shape fits. Returns the log."""
    log = []
    for prod, t, readers in quantized_inputs(graph):
        ch = channels.get(prod.name)
        if ch is None or len(ch) == 0:
            continue
        ch = np.unique(np.asarray(ch, np.int64))
        width = graph.tensors[t].shape[-1]
        if ch[0] < 0 or ch[-1] >= width:
            raise ValueError(f"{prod.name}: outlier channels outside 0..{width - 1}")
        k = len(ch)
        oc = graph.weight(f"{prod.name}.ocols", Weight(f"{prod.name}.ocols", Kind.TABLE, _I32, (k,),
                                                         ch.astype(np.int32)))
        xo = graph.tensor(f"{prod.name}.xo", (graph.tensors[t].shape[0], k))
        prod.inputs["ocols"] = oc
        prod.outputs["xo"] = xo
        for r in readers:
            w = graph.weights[r.inputs["w"]]
            ow = (tiled or {}).get(r.inputs["w"])
            if ow is None or ow.shape != (-(-w.shape[0] // ops.TILE) * k, ops.TILE) or ow.dtype != np.float16:
                ow = tile_columns(columns(w, ch))
            r.inputs["ow"] = graph.weight(f"{r.inputs['w']}.ow", Weight(f"{r.inputs['w']}.ow", Kind.TABLE,
                                                                           FLOATS["f16"], ow.shape, ow))
            r.inputs["xo"] = xo
        log.append(f"outliers: {prod.name}: {k} channels in float for {', '.join(r.name for r in readers)}")
    graph.verify()
    return log
