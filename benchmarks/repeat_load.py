"""Repeated loads of the default model in one process, as a test session makes them (dozens of
LLM(...) of SmolLM2-135M-Instruct Q4_1): per load the wall time and its parts (the fusion passes,
the outlier probe, the GGUF repack), the median of the loads after the first (imports and the
page cache warmed by it). With --src, the llamajet under that folder is imported instead of this
checkout's (an A/B of two trees in alternating processes: `--src /tmp/old/src` with a copy of
_core*.so beside its package).

    python benchmarks/repeat_load.py [--loads 5] [--src DIR]

2026-12-06, 2 cores shared with quantization jobs (load average ~4), two A/B rounds of alternating
processes, medians of loads 2-5: before (3836249: consumer scans, every load probed) load 2.35 /
2.60 s, fuse 0.18 / 0.17 s, probe 1.05 / 1.12 s; after (graph/ir.py's reader index, the probe memo)
load 1.43 / 1.52 s, fuse 0.044 / 0.055 s, probe 0.09 / 0.09 s (the memo key: a SHA-1 of the
probe graph's weights). The repack (~0.75 s) is the same work in both.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loads", type=int, default=5)
    ap.add_argument("--src", help="import llamajet from this folder (its package holds _core*.so)")
    a = ap.parse_args(argv)
    if a.src:  # the editable install's finder would import this checkout's package first
        sys.meta_path[:] = [f for f in sys.meta_path if "Redirecting" not in type(f).__name__]
        sys.path.insert(0, a.src)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import SMOLLM2_GGUF

    import llamajet
    import llamajet.engine.runner as runner
    from llamajet import LLM

    spent: dict[str, float] = {}

    def timed(mod, name, key):
        f = getattr(mod, name)

        def wrapper(*args, **kw):
            t = time.perf_counter()
            try:
                return f(*args, **kw)
            finally:
                spent[key] = spent.get(key, 0.0) + time.perf_counter() - t
        setattr(mod, name, wrapper)

    timed(runner, "fuse_graph", "fuse")
    timed(runner.find_outliers, "input_absmax", "probe")
    timed(runner, "materialize", "repack")
    print(f"llamajet from {Path(llamajet.__file__).parent}")
    rows = []
    for i in range(a.loads):
        spent.clear()
        t = time.perf_counter()
        LLM(SMOLLM2_GGUF)
        rows.append({"load": time.perf_counter() - t, **spent})
        print(f"load {i}: " + "  ".join(f"{k} {v:.3f} s" for k, v in rows[-1].items()), flush=True)
    later = rows[1:] or rows
    print("median after the first: " + "  ".join(
        f"{k} {statistics.median(r[k] for r in later):.3f} s" for k in later[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
