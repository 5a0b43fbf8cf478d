"""Small-M GEMM micro-benchmark: what batching buys in the matmuls alone.

One executor step runs the matmul chain of SmolLM2-135M (q, k, v, o, gate,
up, down per layer, 30 layers, distinct weight copies so they stream from
memory as in decode) at M activation rows. For each M: ms/step, rows/s and
the ratio to M = 1 — the ceiling on the batch speed-up of `llamajet bench
--batch` — and the integer multiply-accumulates per second.

    python benchmarks/gemm_small_m.py [--threads 2] [--ms 1,4,8,16] [--scheme int4_asym_g32]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from gemv_bandwidth import SHAPES, build  # the same chain, here at M rows
from llamajet import ops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--ms", default="1,4,8,16")
    ap.add_argument("--scheme", default="int4_asym_g32")
    ap.add_argument("--isa", default=None)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    isa = a.isa or ops.resolve_isa()
    ms = [int(v) for v in a.ms.split(",")]
    exs = {m: build(isa, a.threads, a.scheme, a.layers, rng, m) for m in ms}
    macs = a.layers * sum(n * k for n, k in SHAPES)  # per row
    z = np.zeros(max(ms), np.int32)
    bt = np.zeros((1, 1), np.int32)
    best = {m: float("inf") for m in ms}
    for _ in range(a.reps):  # interleaved: every M sees the same machine
        for m in ms:
            ex = exs[m][0]
            t0 = time.perf_counter()
            ex.run(z[:m], z[:m], z[:m], z[:m], bt, z[:0])
            best[m] = min(best[m], time.perf_counter() - t0)
    print(f"{a.scheme} {isa} threads={a.threads}")
    print(f"{'M':>4s} {'ms/step':>8s} {'rows/s':>8s} {'vs M=1':>7s} {'GMAC/s':>7s}")
    for m in ms:
        t = best[m]
        print(f"{m:4d} {t * 1e3:8.2f} {m / t:8.0f} {(m / t) / (1 / best[ms[0]]) if ms[0] == 1 else float('nan'):6.2f}x"
              f" {m * macs / t / 1e9:7.1f}")


if __name__ == "__main__":
    main()
