"""`llamajet eval`'s scoring speed against llama-cpp-python computing the
same all-position logits, on the same file and windows.

    python benchmarks/eval_speed.py [--model FILE.gguf] [--windows 8] [--rounds 3]

llamajet: what `llamajet eval` times per configuration (eval/perplexity.py
`evaluate`): the logits of a whole window, then their log-softmax (float64),
default kernels. llama-cpp-python 0.3.36: `Llama(logits_all=True, n_ctx=512,
n_batch=512, n_threads=2)`, one `reset(); eval(window)` per window and the
logits copied out (no log-softmax: that work is ours alone, which only
handicaps llamajet). Neither has a prefix cache between windows (llamajet's
windows are all different; llama.cpp is reset). Rounds alternate between the
engines; each reports its median round's scored tokens per second (every
position but each window's first, as eval counts them).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np


def main(argv=None) -> int:
    import llama_cpp

    from llamajet import LLM
    from llamajet.engine.sampling import log_softmax
    from llamajet.eval.perplexity import DEFAULT_CORPUS, corpus_windows
    from llamajet.models import default_model_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--text", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    path = a.model or Path(default_model_path())
    lj = LLM(path, max_model_len=512, kv_cache_tokens=512, n_threads=a.threads)
    lc = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_batch=512, logits_all=True, n_threads=a.threads,
                         verbose=False)
    windows = corpus_windows(lj.tokenizer, a.text.read_text(encoding="utf-8"), 512, a.windows * a.rounds)
    scored = sum(len(w) - 1 for w in windows[: a.windows])

    def run_lj(ws):
        for w in ws:
            log_softmax(lj.logits(w)[:-1])

    def run_lc(ws):
        for w in ws:
            lc.reset()
            lc.eval(w)
            np.array(lc.scores[: len(w)], copy=True)

    times = {"llamajet": [], "llama-cpp-python": []}
    for r in range(a.rounds):  # every round its own windows: no engine sees a window twice
        ws = windows[r * a.windows:(r + 1) * a.windows]
        for name, fn in (("llamajet", run_lj), ("llama-cpp-python", run_lc)):
            t0 = time.perf_counter()
            fn(ws)
            times[name].append(time.perf_counter() - t0)
    tps = {n: scored / float(np.median(t)) for n, t in times.items()}
    print(f"model {path.name}, {a.windows} windows x 512 tokens ({scored} scored) per round, {a.rounds} rounds, "
          f"{a.threads} threads")
    for n, v in tps.items():
        print(f"  {n:>17}: {v:8.0f} scored tok/s  (rounds: {', '.join(f'{t:.2f}s' for t in times[n])})")
    print(f"  ratio llamajet / llama-cpp-python: {tps['llamajet'] / tps['llama-cpp-python']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
