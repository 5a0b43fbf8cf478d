"""Prefill and decode tokens/s: llamajet beside llama.cpp, same GGUF, same threads.

Runs both engines in one process, alternating rounds (the machine is noisy:
side by side in one run is the only fair comparison), and prints per-round
figures, the medians and the ratios.

    python benchmarks/bench_vs_llama_cpp.py [--model F.gguf] [--threads 2] \
        [--prompt-tokens 128] [--new-tokens 128] [--rounds 3]

llama.cpp (PyPI llama-cpp-python, built with CMAKE_ARGS="-DGGML_NATIVE=ON")
runs at its best settings: flash attention on, n_batch 512, the same threads.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def bench_llamajet(llm, prompt_ids, new_tokens):
    from llamajet import SamplingParams

    p = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    llm.engine.blocks.reset_cache()  # every round a cold prefill, as llama.cpp's after reset()
    for _ in llm.engine.generate_ids(prompt_ids, p):
        pass
    s = llm.engine.last_stats
    return s.prompt_tokens / s.prefill_s, s.decode_tokens / s.decode_s


def bench_llama_cpp(lcpp, prompt_ids, new_tokens):
    lcpp.reset()
    t0 = time.perf_counter()
    lcpp.eval(prompt_ids)
    t1 = time.perf_counter()
    tok = int(np.argmax(lcpp.scores[lcpp.n_tokens - 1]))
    for _ in range(new_tokens - 1):
        lcpp.eval([tok])
        tok = int(np.argmax(lcpp.scores[lcpp.n_tokens - 1]))
    t2 = time.perf_counter()
    return len(prompt_ids) / (t1 - t0), (new_tokens - 1) / (t2 - t1)


def main() -> None:
    from llamajet import LLM
    from llamajet.models import default_model_path

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    path = str(a.model or default_model_path())

    import llama_cpp

    llm = LLM(path, n_threads=a.threads, max_model_len=2048)
    lcpp = llama_cpp.Llama(model_path=path, n_threads=a.threads, n_threads_batch=a.threads, n_ctx=2048,
                           n_batch=512, flash_attn=True, logits_all=False, verbose=False)
    text = open(__file__).read() * 4
    prompt = llm.tokenizer.encode(text)[: a.prompt_tokens]
    assert len(prompt) == a.prompt_tokens
    rows = {"llamajet": [], "llama.cpp": []}
    bench_llamajet(llm, prompt[:16], 4)  # warm-up both
    bench_llama_cpp(lcpp, prompt[:16], 4)
    for r in range(a.rounds):
        rows["llamajet"].append(bench_llamajet(llm, prompt, a.new_tokens))
        rows["llama.cpp"].append(bench_llama_cpp(lcpp, prompt, a.new_tokens))
        print(f"round {r}: " + "  ".join(f"{k} prefill {v[-1][0]:.1f} decode {v[-1][1]:.1f}"
                                          for k, v in rows.items()))
    med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v))
           for k, v in rows.items()}
    print(f"\nmodel {path}\nthreads {a.threads}, prompt {a.prompt_tokens} tokens, {a.new_tokens} new tokens, "
          f"llamajet isa {llm.isa}, llama-cpp-python {llama_cpp.__version__}")
    print(f"{'engine':10s} {'prefill tok/s':>14s} {'decode tok/s':>13s}")
    for k, (p, d) in med.items():
        print(f"{k:10s} {p:14.1f} {d:13.1f}")
    lj, lc = med["llamajet"], med["llama.cpp"]
    print(f"{'ratio':10s} {lj[0] / lc[0]:14.2f}x {lj[1] / lc[1]:12.2f}x")


if __name__ == "__main__":
    main()
