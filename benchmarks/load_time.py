"""First-load time, llamajet beside llama.cpp: each load in a fresh process
(imports done before the clock starts), engines alternating round by round,
warm page cache, both at the same context and threads (llamajet as
bench_latency's worker builds it: one context of KV pool, 512-token steps, no
prefix cache; llama.cpp with n_batch 512 and flash attention).

Each process times its load, then the first prefill after it: the same 128
token ids (seeded draws from the vocabulary) in one step, its last logits row
computed. Load + prefill is the figure the issue's rule reads (llamajet's
<= 2x llama.cpp's), so that work a load leaves for later (a lazy repack, page
faults of weights first read by the first step) is counted where a user
waits for it. Prints every round, the medians and min of load, prefill and
their sum, and the ratios; speeds and page faults on shared machines drift,
so read the medians over several rounds. Whether the machine was busy: the
CPU time other processes used while the workers ran.

    python benchmarks/load_time.py MODEL.gguf [--rounds 6] [--ctx 4240] [--prefill 128]
        [--llama-cpp-python PYTHON]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from busy import Others  # noqa: E402

# argv: model, ctx, prefill tokens, threads
LLAMAJET = """
import json, sys, time
import numpy as np
from llamajet import LLM, SamplingParams
t = time.perf_counter()
llm = LLM(sys.argv[1], max_model_len=int(sys.argv[2]), max_tokens_per_step=512, enable_prefix_caching=False,
          max_num_seqs=1, kv_cache_tokens=int(sys.argv[2]), n_threads=int(sys.argv[4]))
t1 = time.perf_counter()
ids = np.random.default_rng(0).integers(0, llm.config.vocab_size, int(sys.argv[3])).tolist()
llm.generate([ids], SamplingParams(max_tokens=1, temperature=0))
t2 = time.perf_counter()
print(json.dumps([t1 - t, t2 - t1]))
"""
LLAMA_CPP = """
import json, sys, time
import numpy as np
import llama_cpp
n = int(sys.argv[4])
t = time.perf_counter()
m = llama_cpp.Llama(model_path=sys.argv[1], n_threads=n, n_threads_batch=n, n_ctx=int(sys.argv[2]), n_batch=512,
                    flash_attn=True, verbose=False)
t1 = time.perf_counter()
ids = np.random.default_rng(0).integers(0, m.n_vocab(), int(sys.argv[3])).tolist()
m.eval(ids)
t2 = time.perf_counter()
print(json.dumps([t1 - t, t2 - t1]))
"""


OTHERS = Others()


def _run(python: str, code: str, model: str, ctx: int, prefill: int, threads: int) -> tuple[float, float]:
    out = OTHERS.run([python, "-c", code, model, str(ctx), str(prefill), str(threads)])
    if out.returncode != 0:
        raise SystemExit(f"{python}: failed\n{out.stderr[-3000:]}")
    load, pre = json.loads(out.stdout.strip().splitlines()[-1])
    return load, pre


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--ctx", type=int, default=4240)
    ap.add_argument("--prefill", type=int, default=128, help="tokens of the first prefill timed after the load")
    ap.add_argument("--threads", type=int, default=None, help="both engines' threads (default: usable cores)")
    ap.add_argument("--llama-cpp-python", default=sys.executable, metavar="PYTHON",
                    help="a Python with llama-cpp-python installed (default: this one)")
    ap.add_argument("--llamajet-python", default=sys.executable, metavar="PYTHON",
                    help="a Python with the llamajet build to time (default: this one)")
    a = ap.parse_args(argv)
    if a.threads is None:
        from llamajet.ops import default_threads

        a.threads = default_threads()
    engines = [("llamajet", a.llamajet_python, LLAMAJET), ("llama.cpp", a.llama_cpp_python, LLAMA_CPP)]
    times: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in engines}
    print(f"{a.model}: ctx {a.ctx}, {a.threads} threads, first prefill {a.prefill} tokens; fresh process per load",
          flush=True)
    for r in range(a.rounds):
        for name, python, code in engines[:: 1 if r % 2 == 0 else -1]:
            times[name].append(_run(python, code, a.model, a.ctx, a.prefill, a.threads))
        print(f"round {r + 1}: " + ", ".join(
            f"{n} load {v[-1][0]:.2f} + prefill {v[-1][1]:.2f} = {sum(v[-1]):.2f} s" for n, v in times.items()),
            flush=True)
    stat = {}
    for name, v in times.items():
        cols = {"load": [x[0] for x in v], "prefill": [x[1] for x in v], "load+prefill": [sum(x) for x in v]}
        stat[name] = {k: (statistics.median(c), min(c)) for k, c in cols.items()}
    for k in ("load", "prefill", "load+prefill"):
        lj, lc = stat["llamajet"][k], stat["llama.cpp"][k]
        print(f"{k:>12}: median llamajet {lj[0]:.2f} s, llama.cpp {lc[0]:.2f} s ({lj[0] / lc[0]:.2f}x); "
              f"min {lj[1]:.2f} / {lc[1]:.2f} s ({lj[1] / lc[1]:.2f}x)")
    print(f"machine: {OTHERS.line()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
