"""Storage for weights written at load (GGUF repacks, stacked matrices).

``empty(shape)`` is np.empty's twin for uint8 weight storage: from 2 MiB a
mapping of its own (_core.page_buffer, runtime/pages.h: no transparent huge
pages, unmapped with the array), committed as it is first written. numpy
asks for huge pages on its big allocations, and with THP's defrag at
"madvise" the first touch of each compacts memory synchronously: most of a
first load in the VMs this runs on. Measured (2-core Zen 4 VM, 2026-12-07):
300 MiB written once in a fresh process, 1.9-3.2 s/GiB from np.empty and
0.75-1.0 s/GiB from such a mapping; a 1B Q6_K's first load, 8 alternating
rounds, median 2.64 s with huge pages asked for and 1.62 s without.
"""

from __future__ import annotations

import math

import numpy as np

from llamajet import _core


def empty(shape) -> np.ndarray:
    """An uninitialised uint8 array of `shape` (no memory committed yet)."""
    shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    return _core.page_buffer(math.prod(shape)).reshape(shape)
