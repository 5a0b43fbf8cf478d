"""First-load time, llamajet beside llama.cpp: each load in a fresh process
(imports done before the clock starts), engines alternating round by round,
warm page cache, both at the same context (llamajet as bench_latency's
worker builds it: one context of KV pool, 512-token steps, no prefix cache;
llama.cpp with n_batch 512 and flash attention). Prints every round, the
medians and min, and their ratios. The issue's rule: llamajet's load <= 2x
llama.cpp's (1.2x at 8B); speeds and page faults on shared machines drift, so
read the medians over several rounds.

    python benchmarks/load_time.py MODEL.gguf [--rounds 6] [--ctx 4240]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

LLAMAJET = """
import sys, time
from llamajet import LLM
t = time.perf_counter()
LLM(sys.argv[1], max_model_len=int(sys.argv[2]), max_tokens_per_step=512, enable_prefix_caching=False,
    max_num_seqs=1, kv_cache_tokens=int(sys.argv[2]))
print(time.perf_counter() - t)
"""
LLAMA_CPP = """
import sys, time
import llama_cpp
from llamajet.ops import default_threads
n = default_threads()
t = time.perf_counter()
llama_cpp.Llama(model_path=sys.argv[1], n_threads=n, n_threads_batch=n, n_ctx=int(sys.argv[2]), n_batch=512,
                flash_attn=True, verbose=False)
print(time.perf_counter() - t)
"""


def _load(code: str, model: str, ctx: int) -> float:
    out = subprocess.run([sys.executable, "-c", code, model, str(ctx)], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--ctx", type=int, default=4240)
    a = ap.parse_args(argv)
    times = {"llamajet": [], "llama.cpp": []}
    for r in range(a.rounds):
        order = [("llamajet", LLAMAJET), ("llama.cpp", LLAMA_CPP)][:: 1 if r % 2 == 0 else -1]
        for name, code in order:
            times[name].append(_load(code, a.model, a.ctx))
        print(f"round {r + 1}: llamajet {times['llamajet'][-1]:.2f} s, llama.cpp {times['llama.cpp'][-1]:.2f} s",
              flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    low = {k: min(v) for k, v in times.items()}
    print(f"median: llamajet {med['llamajet']:.2f} s, llama.cpp {med['llama.cpp']:.2f} s "
          f"({med['llamajet'] / med['llama.cpp']:.2f}x); min: {low['llamajet']:.2f} s, {low['llama.cpp']:.2f} s "
          f"({low['llamajet'] / low['llama.cpp']:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
