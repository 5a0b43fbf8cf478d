"""The default path's quality and speed with and without outlier channels
(RuntimeConfig.act_outliers), side by side in one process.

    python benchmarks/default_path.py [--windows 20] [--rounds 5] [--outliers 0,8,16]

Model: the default (SmolLM2-135M-Instruct, its Q4_1 GGUF). Float reference:
the same weights dequantized in fp32 (kernels="reference"), so every row's KL
is the int8 activations' alone. Text: WikiText-2 test (../shared/data), the
first N windows of 512 tokens. Columns:
- KL / top-1 vs float over the windows (full-sequence prefill steps);
- the same on teacher-forced one-token decode steps over the first window
  (each step feeds the next true token; its logits row is scored);
- prefill tok/s (128-token prompts) and decode tok/s (32 tokens), median of
  --rounds rounds alternating over the configurations, another prompt each
  round, the prefix cache emptied (eval/quality.py speed);
- greedy chat replies (32 tokens, tests/chat_prompts.py's 20 prompts) equal to
  the float-activation path's (kernels="a16", the same weights);
- the weights' bytes read per token (outlier columns included).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from chat_prompts import PROMPTS  # noqa: E402

from llamajet import LLM, SamplingParams  # noqa: E402
from llamajet.engine.runner import StepBatch  # noqa: E402
from llamajet.engine.sampling import log_softmax  # noqa: E402
from llamajet.eval.bench import bench_prompts  # noqa: E402
from llamajet.eval.perplexity import corpus_windows, evaluate  # noqa: E402
from llamajet.eval.quality import speed  # noqa: E402

CORPUS = ROOT / ".." / "shared" / "data" / "corpora" / "wikitext-2-raw-test.txt"


def decode_steps(llm, ids: list[int]) -> np.ndarray:
    """log-probs [len(ids) - 1, vocab] from one-token steps: token i at position i, its row kept."""
    r = llm.engine.runner
    bt = np.arange(r.max_blocks, dtype=np.int32)[None]
    out = []
    for i in range(len(ids) - 1):
        p = np.array([i], np.int32)
        lg = r.execute(StepBatch(np.array([ids[i]], np.int32), p, p.copy(), np.zeros(1, np.int32), bt,
                                 np.zeros(1, np.int32)))
        out.append(log_softmax(lg[0].astype(np.float64)))
    return np.stack(out)


def weight_bytes(llm) -> int:
    return sum(w.data.nbytes for w in llm.engine.runner.weights.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--outliers", default="0,8,16")
    a = ap.parse_args(argv)
    ks = [int(k) for k in a.outliers.split(",")]
    kw = dict(max_model_len=640, n_threads=2)
    llms = {"float": LLM(kernels="reference", **kw), "a16": LLM(kernels="a16", **kw)}
    for k in ks:
        llms[f"a8 k={k}"] = LLM(act_outliers=k, **kw)
    tok = llms["float"].tokenizer
    windows = corpus_windows(tok, CORPUS.read_text(encoding="utf-8"), 512, a.windows)
    print(f"scoring {len(windows)} windows x 512 tokens", flush=True)
    scores = evaluate(llms, windows, reference="float")
    # teacher-forced decode steps over the first window (the engine's one-token steps)
    w0 = windows[0][:257]
    ref = log_softmax(llms["float"].logits(w0)[:-1].astype(np.float64))
    dec = {}
    for name in [n for n in llms if n.startswith("a8")]:
        lp = decode_steps(llms[name], w0)
        pre = log_softmax(llms[name].logits(w0)[:-1].astype(np.float64))
        dec[name] = (float((np.exp(ref) * (ref - lp)).sum(-1).mean()), float(np.abs(lp - pre).max()))
    # chat agreement with the float-activation path
    sp = SamplingParams(max_tokens=32, temperature=0)
    chats = {}
    for name, llm in llms.items():
        if name == "float":
            continue
        ids = [llm.chat_ids([{"role": "user", "content": p}]) for p in PROMPTS]
        chats[name] = [o.token_ids for o in llm.generate(ids, sp)]
    prompts = bench_prompts(tok, a.rounds, 128, CORPUS if CORPUS.is_file() else None, llms["float"].config.vocab_size)
    sp_ = speed({n: l for n, l in llms.items() if n.startswith("a8")}, prompts)
    base = sp_[f"a8 k={ks[0]}"]
    print(f"\n| config | KL vs float | top-1 | KL, decode steps | decode = prefill logits | chat = a16 (of 20) "
          f"| prefill tok/s | decode tok/s | vs k={ks[0]} | weight MB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, llm in llms.items():
        if name == "float":
            continue
        s = scores[name]
        same = sum(x == y for x, y in zip(chats[name], chats["a16"]))
        d = dec.get(name)
        sps = sp_.get(name)
        print(f"| {name} | {s.kl:.3e} | {100 * s.top1:.1f}% | {d[0]:.3e} | max |Δ| {d[1]:.1e} | {same} | "
              f"{sps[0]:.0f} | {sps[1]:.1f} | {sps[0] / base[0]:.2f}x / {sps[1] / base[1]:.2f}x | "
              f"{weight_bytes(llm) / 1e6:.1f} |" if d else
              f"| {name} | {s.kl:.3e} | {100 * s.top1:.1f}% | — | — | {same} | — | — | — | {weight_bytes(llm) / 1e6:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
