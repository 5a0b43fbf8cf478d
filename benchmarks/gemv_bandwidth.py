"""Decode GEMV micro-benchmark: achieved GB/s against this machine's own
measured read bandwidth (llamajet._core.read_bandwidth, same threads).

One executor step runs a chain of GEMVs (M = 1) over distinct weight
matrices of SmolLM2-135M's shapes (q, k, v, o, gate, up, down per layer;
30 layers, ~97 MB like the real model), so weights stream from memory as in
decode. Reports, per format and ISA: bytes/step, ms/step, GB/s and the
fraction of the measured read bandwidth.

    python benchmarks/gemv_bandwidth.py [--threads 2] [--layers 30] [--reps 20]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from llamajet import _core, ops
from llamajet.formats.packed import quantize_rtn

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]


def build(isa, threads, scheme, layers, rng, m=1, shapes=SHAPES, a16=False):
    """The matmul chain (shapes x layers, distinct weight copies) at m rows, with
    int8 activations or (a16) float ones; returns the executor, the weights it
    reads and their bytes."""
    ex = ops.Executor(isa=isa, n_threads=threads, max_tokens=m, max_out=m, max_seqs=1, max_blocks=1,
                      kv_slots=16, block_size=16, max_pos=1, scratch_floats=1 << 16)
    width = max(max(s) for s in shapes)
    xb = ex.alloc_buffer(4 * width * m)
    ex.buffer(xb).view(np.float32)[:] = rng.normal(size=width * m)
    ob = ex.alloc_buffer(4 * width * m)
    keep, nbytes = [], 0
    base = {s: quantize_rtn("w", rng.normal(size=s).astype(np.float32), scheme) for s in set(shapes)}
    for _ in range(layers):
        for (n, k) in shapes:
            pw = base[(n, k)]
            data = pw.data.copy()  # a distinct copy per layer: nothing stays cached
            keep.append(data)
            nbytes += data.nbytes
            p = ops.OPS["matmul"]()
            p.x = ops.Ref.in_buffer(xb, 0, ops.DType.F32, m, k)
            p.w = ops.Ref.from_array(data, ops.dtype(pw.dtype), n, k, pw.group)
            p.out = ops.Ref.in_buffer(ob, 0, ops.DType.F32, m, n)
            p.float_act = a16
            ex.add(p)
    return ex, keep, nbytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--schemes", default="int4_asym_g32,int4_sym_g32,int8_g32")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    z = np.zeros(1, np.int32)
    bt = np.zeros((1, 1), np.int32)
    print(f"{'scheme':16s} {'isa':7s} {'MB/step':>8s} {'ms/step':>8s} {'GB/s':>6s} {'of read bw':>10s}")
    for scheme in a.schemes.split(","):
        for isa in ops.supported_isas()[1:] or ["ref"]:
            ex, keep, nbytes = build(isa, a.threads, scheme, a.layers, rng)
            bw = _core.read_bandwidth(nbytes, a.threads, 5)  # same size, same threads, just before
            ex.run(z, z, z, z, bt, z[:0])
            best = float("inf")
            for _ in range(a.reps):
                t0 = time.perf_counter()
                ex.run(z, z, z, z, bt, z[:0])
                best = min(best, time.perf_counter() - t0)
            gbs = nbytes / best / 1e9
            print(f"{scheme:16s} {isa:7s} {nbytes / 1e6:8.1f} {best * 1e3:8.2f} {gbs:6.1f} {gbs / (bw / 1e9):9.0%}"
                  f"   (read bw {bw / 1e9:.1f} GB/s)")


if __name__ == "__main__":
    main()
