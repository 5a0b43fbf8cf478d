"""Where the default path's KL comes from: a numpy forward of the model
(quant/calibrate.py's ops) with the kernels' int8 activation rounding
(formats.packed.quantize_activations: one scale per group of 32) applied
to chosen matmuls only, KL against the same forward without it (the same
weights: a Q4_1 GGUF's are what the default path runs as they are).

    python benchmarks/act_sensitivity.py [--windows 2]

Rows: every matmul; one kind of matmul alone (q/k/v, attention output,
gate/up, down, the output head); every matmul with groups of 16; every
matmul with its k largest input channels (by max |x| over 2 calibration
windows of WikiText-2 test text after character 600,000, disjoint from the
scored windows) kept in float — the per-weight outlier lists a future
kernel could use.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from llamajet.engine.sampling import log_softmax
from llamajet.eval.perplexity import corpus_windows
from llamajet.formats.packed import quantize_activations
from llamajet.loaders import load_model
from llamajet.models import default_model_path
from llamajet.ops import ref
from llamajet.quant.calibrate import _attention, _rmsnorm, calibration_windows
from llamajet.tokenizer import tokenizer_from_gguf

CORPUS = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "corpora" / "wikitext-2-raw-test.txt"
KINDS = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "attn_output": "o", "ffn_gate": "gate/up",
         "ffn_up": "gate/up", "ffn_down": "down", "head": "head"}


def a8(x: np.ndarray, g: int) -> np.ndarray:
    q, dx, _ = quantize_activations(x, g, x.shape[1])
    return (q.reshape(len(x), -1, g).astype(np.float32) * dx[..., None]).reshape(x.shape)


class Forward:
    def __init__(self, model):
        self.cfg, self.W = model.config, model.weights
        self.F = {n: w.to_f32().astype(np.float32) for n, w in self.W.items()}
        self.F["head"] = self.F.get("output", self.F["token_embd"])
        self.cos, self.sin = ref.rope_tables(self.cfg.rope_inv_freq(), 4096)
        self.stats: dict[str, np.ndarray] = {}

    def __call__(self, ids, kinds=frozenset(), group=32, outliers=None, k=0, record=False):
        cfg, F, W = self.cfg, self.F, self.W
        H, KV, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        pos = np.arange(len(ids))

        def lin(x, name):
            if record:
                self.stats[name] = np.maximum(self.stats.get(name, 0), np.abs(x).max(0))
            if KINDS[name.split(".")[-1]] not in kinds:
                return x @ F[name].T
            if not k:
                return a8(x, group) @ F[name].T
            o = outliers[name][:k]
            xr = x.copy()
            xr[:, o] = 0
            return a8(xr, group) @ F[name].T + x[:, o] @ F[name][:, o].T

        h = F["token_embd"][np.asarray(ids)]
        for i in range(cfg.num_layers):
            p = f"blk.{i}."
            xa = _rmsnorm(h, F[p + "attn_norm"], eps)
            q = ref.rope(lin(xa, p + "attn_q"), pos, self.cos, self.sin, H, hd, W[p + "attn_q"].rope_interleaved)
            kk = ref.rope(lin(xa, p + "attn_k"), pos, self.cos, self.sin, KV, hd, W[p + "attn_k"].rope_interleaved)
            att = _attention(q.astype(np.float32), kk.astype(np.float32), lin(xa, p + "attn_v").astype(np.float32),
                             H, KV, hd)
            h = h + lin(att, p + "attn_output")
            xm = _rmsnorm(h, F[p + "ffn_norm"], eps)
            g = lin(xm, p + "ffn_gate")
            h = h + lin((g / (1 + np.exp(-g)) * lin(xm, p + "ffn_up")).astype(np.float32), p + "ffn_down")
        return lin(_rmsnorm(h, F["output_norm"], eps), "head")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=2)
    a = ap.parse_args(argv)
    model = load_model(default_model_path())
    tok = tokenizer_from_gguf(model.gguf_reader)
    text = CORPUS.read_text(encoding="utf-8")
    windows = corpus_windows(tok, text, 512, a.windows)
    fwd = Forward(model)
    for w in calibration_windows(tok, text[600000:], 2, 512):
        fwd(w, record=True)
    outliers = {n: np.argsort(-s) for n, s in fwd.stats.items()}
    refs = [log_softmax(fwd(w).astype(np.float64)) for w in windows]

    def kl(**kw) -> float:
        t = n = 0
        for w, r in zip(windows, refs):
            lp = log_softmax(fwd(w, **kw).astype(np.float64))
            t += float((np.exp(r) * (r - lp)).sum(-1)[:-1].sum())
            n += len(w) - 1
        return t / n

    every = frozenset(KINDS.values())
    print(f"KL vs float activations, {len(windows)} windows x 512 tokens")
    print(f"  every matmul:                 {kl(kinds=every):.3e}")
    for kind in sorted(every):
        print(f"  {kind:>8} only:                {kl(kinds={kind}):.3e}")
    print(f"  every matmul, groups of 16:   {kl(kinds=every, group=16):.3e}")
    for k in (2, 4, 8, 16):
        print(f"  every matmul, {k:>2} outlier channels in float: {kl(kinds=every, outliers=outliers, k=k):.3e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
