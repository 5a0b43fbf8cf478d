"""Weights whose bytes are written once, into their final buffers.

A GGUF block matrix the packed kernels read is not repacked when the weights
are prepared: prepare_weights gives it its packed twin's format and shape
and an unwritten buffer (formats/pages.empty: address space, no memory yet), with a
Pending fill naming the file's bytes. The fusion passes stack such weights
(formats/stack.py) by giving the parts' fills slices of one new buffer; no
bytes move. `materialize` then runs every fill — the C++ repack, threaded,
from the memory-mapped file straight into the final buffer, one tensor at a
time — and hands each source to `release` (the loader drops its file pages),
so a load holds the final weights plus one tensor's file pages, never the
file, the parts and the stacks at once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from llamajet.formats import pages
from llamajet.formats.weight import Weight


@dataclass(frozen=True)
class Fill:
    src: Weight          # a GGUF block weight: the file's bytes
    dst: np.ndarray      # the final storage (uint8) the tiles go to
    offset: int          # byte offset of the source's first tile in dst
    stride: int          # bytes from one of its tiles to the next


@dataclass(frozen=True, eq=False)
class Pending:
    fills: tuple[Fill, ...]

    def run(self, n_threads: int | None = None, release: Callable[[Weight], None] | None = None) -> None:
        from llamajet.formats.gguf_blocks import repack_gguf

        for f in self.fills:
            repack_gguf(f.src, n_threads, out=f.dst, offset=f.offset, tile_stride=f.stride)
            if release is not None:
                release(f.src)


def deferred_twin(w: Weight) -> Weight:
    """w (GGUF blocks with a packed twin) as its twin, to be written by materialize."""
    from llamajet.formats.gguf_blocks import twin_scheme

    sch = twin_scheme(w)
    data = pages.empty(sch.storage_shape(w.shape))  # address space only, until written
    return Weight(w.name, w.kind, sch, w.shape, data, w.rope_interleaved,
                  pending=Pending((Fill(w, data, 0, data[0].nbytes),)))


def written(w: Weight, n_threads: int | None = None) -> Weight:
    """w with its bytes written (w itself when nothing is pending)."""
    if w.pending is None:
        return w
    w.pending.run(n_threads)
    return replace(w, pending=None)


def restack(ws, out: np.ndarray, offsets, stride_tiles: int) -> Pending | None:
    """Pending fills of parts `ws` retargeted into `out` (tile i of part j at
    byte offsets[j] + i * stride_tiles * tile bytes), or None when a part is
    not a fresh deferred twin (then the caller copies written bytes)."""
    if not all(w.pending is not None and len(w.pending.fills) == 1 for w in ws):
        return None
    tb = out[0].nbytes
    return Pending(tuple(Fill(w.pending.fills[0].src, out, off, stride_tiles * tb) for w, off in zip(ws, offsets)))


def materialize(weights: dict[str, Weight], n_threads: int | None = None,
                release: Callable[[Weight], None] | None = None) -> dict[str, Weight]:
    """Every pending weight written (in order, one source at a time); the
    others as they are."""
    out = {}
    for name, w in weights.items():
        if w.pending is not None:
            w.pending.run(n_threads, release)
            w = replace(w, pending=None)
        out[name] = w
    return out
