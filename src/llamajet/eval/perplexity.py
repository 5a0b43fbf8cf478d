"""Perplexity and KL divergence on a text corpus (WikiText-2 by default).

Standard use (shared/data/README.md): tokenize the text, cut non-overlapping
windows of the evaluation context, score every token but the first of each
window. Several configurations of one model (e.g. KV cache precisions) are
scored on the same windows; each is compared with a reference configuration
by the KL divergence KL(p_ref || p) of the next-token distributions, averaged
over scored positions, and by top-1 agreement. KL sees changes perplexity
averages away (a config can be worse on some tokens and better on others).

    python -m llamajet.eval.perplexity --kv-dtype f32,f16,bf16,int8 --windows 8

The matmuls default to float activations (`--kernels a16`), which isolates
what the KV precision costs. With int8 activations (`--kernels fast`) any
change upstream — even fp16 rounding of K/V — moves some activations across
a rounding boundary, and the KL between two KV types approaches the int8
activations' own KL against the float model (measured on SmolLM2-135M, 1
window: fast f32-KV vs f16-KV 3.4e-3, fast vs reference kernels 3.2e-3 with
either KV type; a16 f32-KV vs f16-KV 5.8e-7).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llamajet.engine.sampling import log_softmax

DEFAULT_CORPUS = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "corpora" / "wikitext-2-raw-test.txt"


@dataclass
class Score:
    name: str
    tokens: int = 0          # scored tokens
    nll_sum: float = 0.0     # sum of -log p(token)
    kl_sum: float = 0.0      # sum of KL(p_ref || p)
    top1_same: int = 0       # positions whose argmax equals the reference's
    seconds: float = 0.0

    @property
    def nll(self) -> float:
        return self.nll_sum / max(self.tokens, 1)

    @property
    def ppl(self) -> float:
        return float(np.exp(self.nll))

    @property
    def kl(self) -> float:
        return self.kl_sum / max(self.tokens, 1)

    @property
    def top1(self) -> float:
        return self.top1_same / max(self.tokens, 1)


def corpus_windows(tokenizer, text: str, window: int, n_windows: int) -> list[list[int]]:
    """The first `n_windows` non-overlapping windows of `window` tokens."""
    need = window * n_windows
    chars = need * 8  # ~4 characters per token in English; tokenize only what is needed
    while True:
        ids = tokenizer.encode(text[:chars], add_special_tokens=False)
        if len(ids) >= need or chars >= len(text):
            break
        chars *= 2
    n = min(n_windows, len(ids) // window)
    if n == 0:
        raise ValueError(f"corpus too short for one window of {window} tokens")
    return [ids[i * window : (i + 1) * window] for i in range(n)]


def evaluate(llms: dict, windows: list[list[int]], reference: str | None = None,
             progress=None) -> dict[str, Score]:
    """Scores every window under every configuration in `llms` (name -> LLM);
    KL and top-1 agreement against `reference` (default: the first).
    progress(done, total) is called after each window."""
    names = list(llms)
    reference = reference or names[0]
    scores = {n: Score(n) for n in names}
    for wi, w in enumerate(windows):
        target = np.asarray(w[1:])
        rows = np.arange(len(target))
        ref_lp = None
        for name in [reference] + [n for n in names if n != reference]:
            t0 = time.perf_counter()
            lp = log_softmax(llms[name].logits(w)[:-1])  # position i predicts token i+1
            s = scores[name]
            s.seconds += time.perf_counter() - t0
            s.tokens += len(target)
            s.nll_sum -= float(lp[rows, target].sum())
            if ref_lp is None:
                ref_lp = lp
            s.kl_sum += float((np.exp(ref_lp) * (ref_lp - lp)).sum())
            s.top1_same += int((lp.argmax(-1) == ref_lp.argmax(-1)).sum())
        if progress is not None:
            progress(wi + 1, len(windows))
    return scores


def format_table(scores: dict[str, Score], reference: str, bytes_per_token: dict[str, int] | None = None) -> str:
    head = f"{'config':>10} {'tokens':>7} {'ppl':>9} {'Δppl %':>8} {'KL vs ' + reference:>12} {'top1 =':>7}"
    if bytes_per_token:
        head += f" {'KV B/token':>11}"
    lines = [head]
    base = scores[reference].ppl
    for n, s in scores.items():
        line = (f"{n:>10} {s.tokens:>7} {s.ppl:>9.4f} {100 * (s.ppl / base - 1):>+8.3f} {s.kl:>12.3e} "
                f"{100 * s.top1:>6.2f}%")
        if bytes_per_token:
            line += f" {bytes_per_token[n]:>11}"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from llamajet.api import LLM
    from llamajet.options import add_runtime_args, runtime_config

    ap = argparse.ArgumentParser(prog="python -m llamajet.eval.perplexity",
                                 description="Perplexity and KL of KV-cache precisions on a corpus")
    ap.add_argument("--model", "-m", default=None, help="HF folder or .gguf (default: the default model)")
    ap.add_argument("--kv-dtype", default="f32,f16,bf16,int8", help="comma-separated; the first is the reference")
    ap.add_argument("--corpus", default=str(DEFAULT_CORPUS))
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--windows", type=int, default=8)
    # a16 kernels isolate what the KV precision costs (see the docstring)
    add_runtime_args(ap, only=("n_threads", "isa", "kernels", "quantize", "fuse"), defaults={"kernels": "a16"})
    a = ap.parse_args(argv)
    dtypes = a.kv_dtype.split(",")
    cfg = runtime_config(a, max_model_len=a.window, kv_cache_tokens=a.window)
    llms = {d: LLM(a.model, cfg, kv_dtype=d) for d in dtypes}
    first = llms[dtypes[0]]
    windows = corpus_windows(first.tokenizer, Path(a.corpus).read_text(encoding="utf-8"), a.window, a.windows)
    scores = evaluate(llms, windows, dtypes[0])
    bpt = {d: llm.engine.runner.kv_bytes_per_block // llm.engine.runner.block_size for d, llm in llms.items()}
    print(f"model: {first.path.name}  kernels: {cfg.kernels}  corpus: {Path(a.corpus).name}  "
          f"{len(windows)} windows x {a.window} tokens")
    print(format_table(scores, dtypes[0], bpt))
    return 0


if __name__ == "__main__":
    sys.exit(main())
