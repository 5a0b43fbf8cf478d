"""Storage for weights written at load (GGUF repacks, stacked matrices).

``empty(shape)`` is np.empty's twin for uint8 weight storage: from 2 MiB a
mapping of its own (_core.page_buffer: 2 MiB-aligned, transparent huge pages
asked for, unmapped with the array), committed as it is first written.
In the VMs this runs on, committing fresh memory is most of a load: 300 MiB
written once in a fresh process cost 1.9-3.2 s/GiB from np.empty (malloc'd,
unaligned) and 0.75-1.0 s/GiB from such a mapping (2-core Zen 4 VM, 2026-12-07).
"""

from __future__ import annotations

import math

import numpy as np

from llamajet import _core


def empty(shape) -> np.ndarray:
    """An uninitialised uint8 array of `shape` (no memory committed yet)."""
    shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    return _core.page_buffer(math.prod(shape)).reshape(shape)
