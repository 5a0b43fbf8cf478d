"""W*A16 (float activations) against W*A8 (int8 activations) on the same
packed weights: the matmul chain of Llama-3.2-1B's layer shapes (q, k, v, o,
gate, up, down; distinct weight copies per layer, so they stream from memory
as in decode) at M activation rows, one executor step per run, both paths
alternating, best of the rounds. Prints ms per step, weight GB/s, the read
bandwidth measured in the same run and a16 / a8 speed.

    python benchmarks/a16_gemv.py [--scheme int4_asym_g32] [--m 1] [--layers 8] [--isa amx]

2026-12-04, 2-core Sapphire Rapids, amx tier, int4_asym_g32, M = 1, 8 layers:
a8 10.8 ms, a16 13.9 ms (0.77x; the quarter-widening kernel before: 19.7 ms, 0.57x).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from gemv_bandwidth import build  # the same chain builder, here at the 1B's shapes
from llamajet import _core, ops

SHAPES = [(2048, 2048), (512, 2048), (512, 2048), (2048, 2048), (8192, 2048), (8192, 2048), (2048, 8192)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scheme", default="int4_asym_g32")
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--isa", default=None)
    a = ap.parse_args()
    isa = ops.resolve_isa(a.isa)
    rng = np.random.default_rng(0)
    z, bt = np.zeros(a.m, np.int32), np.zeros((1, 1), np.int32)
    exs = {a16: build(isa, ops.default_threads(), a.scheme, a.layers, rng, a.m, SHAPES, a16)
           for a16 in (False, True)}
    best = {a16: float("inf") for a16 in exs}
    for _ in range(a.rounds):
        for a16, (ex, _, _) in exs.items():
            t0 = time.perf_counter()
            ex.run(z, z, z, z, bt, z[:0])
            best[a16] = min(best[a16], time.perf_counter() - t0)
    nbytes = exs[False][2]
    bw = _core.read_bandwidth(nbytes, ops.default_threads(), 5)
    for a16, t in best.items():
        print(f"{a.scheme} M={a.m} {isa} {'a16' if a16 else 'a8 '}: {t * 1e3:7.2f} ms  {nbytes / t / 1e9:5.1f} GB/s")
    print(f"read bandwidth {bw / 1e9:.1f} GB/s; a16 / a8 speed {best[False] / best[True]:.2f}")


if __name__ == "__main__":
    main()
