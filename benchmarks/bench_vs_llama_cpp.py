"""Prefill and decode tokens/s, llamajet beside llama.cpp on the same GGUF and
threads, alternating rounds: a thin entry point to `llamajet bench
--vs-llama-cpp` (the code is llamajet.eval.bench_latency).

    python benchmarks/bench_vs_llama_cpp.py [--model F.gguf] [--threads 2] [--rounds 3] [--vs-no-fuse]
"""

from __future__ import annotations

import argparse

from llamajet.config import RuntimeConfig
from llamajet.eval.bench_latency import run

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vs-no-fuse", action="store_true")
    a = ap.parse_args()
    print(run(a.model, RuntimeConfig(n_threads=a.threads), a.rounds, vs_llama_cpp=True, vs_no_fuse=a.vs_no_fuse))
