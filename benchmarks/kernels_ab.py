"""Two builds of llamajet side by side: kernel and model speed, paired.

    python benchmarks/kernels_ab.py --a OLD/.venv/bin/python --b .venv/bin/python [--rounds 5]

Each build runs in its own process (a worker: this file with --worker, under
that build's interpreter); the workers alternate A B B A ... so both see the
same drift of this shared machine. A worker measures, on the best ISA tier
of this CPU:
- matmul chains of random GGUF blocks repacked to their packed twins (Q4_0,
  Q4_1, Q8_0, Q5_0, Q4_K, Q6_K) at Llama-3.2-1B's layer shapes (distinct
  copies, so weights stream from memory as in decode): M = 1 (decode's
  GEMV), 16 (an AMX row block) and 128 (prefill's GEMM), int8 activations;
  Q4_1 at M = 1 with float activations (the a16 kernels) too;
- the default model as `llamajet bench` measures it: prefill of 128 and 512
  tokens and decode of 128 (greedy, EOS ignored, no prefix cache), which runs
  every epilogue (residual, SwiGLU, QKV + RoPE) and the other op families.
Per figure: each worker's best of its repetitions; the table gives the
medians over rounds and the median of the per-round ratios B / A of speed
(above 1: B is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

LAYER = [(2048, 2048), (512, 2048), (512, 2048), (2048, 2048), (8192, 2048), (8192, 2048), (2048, 8192)]
KINDS = ("q4_0", "q4_1", "q8_0", "q5_0", "q4_k", "q6_k")
MS = (1, 16, 128)


def _worker(layers: int, reps: int) -> dict:
    import gguf
    import numpy as np

    from llamajet import LLM, SamplingParams, ops
    from llamajet.formats.gguf_blocks import repack_gguf
    from llamajet.formats.weight import Kind, Weight

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from make_random_gguf import random_blocks

    isa = ops.resolve_isa()
    threads = ops.default_threads()
    rng = np.random.default_rng(0)
    out: dict = {"isa": isa, "threads": threads}

    def chain(kind: str, m: int, a16: bool):
        qt = gguf.GGMLQuantizationType[kind.upper()]
        ex = ops.Executor(isa=isa, n_threads=threads, max_tokens=m, max_out=m, max_seqs=1, max_blocks=1,
                          kv_slots=16, block_size=16, max_pos=1, scratch_floats=1 << 20)
        width = max(max(s) for s in LAYER)
        xb = ex.alloc_buffer(4 * width * m)
        ex.buffer(xb).view(np.float32)[:] = rng.normal(size=width * m)
        ob = ex.alloc_buffer(4 * width * m)
        keep = []
        for _ in range(layers):
            for n, k in LAYER:
                w = repack_gguf(Weight("w", Kind.MATRIX, kind, (n, k), random_blocks(qt, n, k, rng)))
                keep.append(w.data)
                p = ops.OPS["matmul"]()
                p.x = ops.Ref.in_buffer(xb, 0, ops.DType.F32, m, k)
                p.w = ops.Ref.from_array(w.data, ops.dtype(w.dtype), n, k, w.group)
                p.out = ops.Ref.in_buffer(ob, 0, ops.DType.F32, m, n)
                p.float_act = a16
                ex.add(p)
        z = np.zeros(m, np.int32)
        bt = np.zeros((1, 1), np.int32)
        ex.run(z, z, z, z, bt, z[:0])
        best = float("inf")
        for _ in range(reps * (8 if m == 1 else 1)):  # a GEMV step is ~1 ms: more of them, so a hiccup is outrun
            t0 = time.perf_counter()
            ex.run(z, z, z, z, bt, z[:0])
            best = min(best, time.perf_counter() - t0)
        return best, keep

    for kind in KINDS:
        for m in MS:
            out[f"{kind} M={m}"] = 1.0 / chain(kind, m, False)[0]  # steps/s
    out["q4_1 M=1 a16"] = 1.0 / chain("q4_1", 1, True)[0]

    llm = LLM(max_model_len=1024, max_tokens_per_step=512, enable_prefix_caching=False, max_num_seqs=1)
    vocab = llm.config.vocab_size
    greedy = dict(temperature=0, ignore_eos=True)

    def timed(ids, n):
        t = time.perf_counter()
        llm.generate([ids], SamplingParams(max_tokens=n, **greedy))
        return time.perf_counter() - t

    timed(rng.integers(0, vocab, 512).tolist(), 8)  # warm-up
    for p in (128, 512):
        out[f"model prefill {p}"] = p / min(timed(rng.integers(0, vocab, p).tolist(), 1) for _ in range(reps // 4 + 1))
    dec = []
    for _ in range(4):
        ids = rng.integers(0, vocab, 128).tolist()
        t1 = timed(ids, 1)
        dec.append(128 / (timed(ids, 129) - t1))
    out["model decode"] = max(dec)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", help="python of build A (the baseline)")
    ap.add_argument("--b", help="python of build B")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--worker", action="store_true")
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(_worker(a.layers, a.reps)))
        return
    runs: dict[str, list] = {"A": [], "B": []}
    load = os.getloadavg()[0]
    for r in range(a.rounds):
        for side in ("AB" if r % 2 == 0 else "BA"):
            py = a.a if side == "A" else a.b
            res = subprocess.run([py, __file__, "--worker", "--layers", str(a.layers), "--reps", str(a.reps)],
                                 capture_output=True, text=True, check=True)
            runs[side].append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}/{a.rounds} {side}: model decode {runs[side][-1]['model decode']:.1f} tok/s", flush=True)
    first = runs["A"][0]
    print(f"isa {first['isa']}, threads {first['threads']}, {a.rounds} rounds alternating; "
          f"load average before the run {load:.2f} on {os.cpu_count()} cores ({'busy' if load > 0.5 else 'quiet'})")
    print(f"{'figure':22s} {'A':>10s} {'B':>10s} {'B/A speed':>10s} {'min':>6s} {'max':>6s}")
    for key in first:
        if key in ("isa", "threads"):
            continue
        ra = [x[key] for x in runs["A"]]
        rb = [x[key] for x in runs["B"]]
        ratios = [y / x for x, y in zip(ra, rb)]
        unit = "tok/s" if key.startswith("model") else "step/s"
        print(f"{key:22s} {statistics.median(ra):10.2f} {statistics.median(rb):10.2f} {statistics.median(ratios):9.3f}x"
              f" {min(ratios):6.3f} {max(ratios):6.3f}  ({unit})")


if __name__ == "__main__":
    main()
