"""Buffers for the weights the kernels stream every decode step.

A decode step reads every matrix once, front to back: at Llama-3.2-1B
Q4_K_M, 800 MB a token. In 4 KiB pages that is 200,000 pages a token, each a
TLB miss (a page walk) as the stream enters it. `weight_buffer` asks for
2 MiB pages instead (anonymous memory, MADV_HUGEPAGE, the region aligned to
2 MiB): Linux backs it with transparent huge pages where THP is "always" or
"madvise" (the common default); elsewhere it is ordinary memory and nothing
changes. Only the final weight buffers (packed twins written at load, the
stacked QKV / gate-up matrices) come from here; a mapped file (a saved model)
is the page cache's. Small buffers (< 4 MiB) stay on the ordinary heap.

LLAMAJET_HUGE_PAGES=0 turns it off (measurement: benchmarks/real_scale.py).
"""

from __future__ import annotations

import math
import mmap
import os

import numpy as np

HUGE = 2 << 20       # the x86-64 transparent huge page
MIN_BYTES = 4 << 20  # below this, a heap array (a partly used huge page would waste more than it saves)


def huge_pages_enabled() -> bool:
    return os.environ.get("LLAMAJET_HUGE_PAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")


def weight_buffer(shape, dtype=np.uint8) -> np.ndarray:
    """An uninitialized array of `shape`, 2 MiB-aligned and huge-page backed
    where the system allows (see above); the memory is committed as it is
    first written, like np.empty's."""
    shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    dt = np.dtype(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    if nbytes < MIN_BYTES or not huge_pages_enabled():
        return np.empty(shape, dt)
    mm = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = np.frombuffer(mm, np.uint8)
    off = -base.ctypes.data % HUGE
    try:
        mm.madvise(mmap.MADV_HUGEPAGE, 0, len(mm))
    except OSError:  # THP off or unsupported: ordinary pages
        pass
    return base[off : off + nbytes].view(dt).reshape(shape)
