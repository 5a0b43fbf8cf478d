"""`llamajet eval`: what a quantization choice costs, several configurations
scored on the same windows of a text.

    llamajet eval --text wiki.test.raw --scheme int8_g32,int4_sym_g128 --saved /tmp/gptq-a --windows 20

The reference is the model's float weights (the checkpoint's own values, a
GGUF's blocks dequantized: `kernels="reference"`). Every configuration reads
the same windows: non-overlapping windows of --ctx tokens, every token scored
but each window's first. Per configuration: perplexity, KL(p_float || p) of
the next-token distributions averaged over scored positions, top-1 agreement
with the float model, the weights' size as the kernels read them (MB and
bits per weight over the matrices and embeddings), and scored tokens per
second (the logits of whole windows). There is no default text: the
evaluation text is the user's choice (--text), never a file outside the
package.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from llamajet.eval.perplexity import corpus_windows, evaluate

REPORT_WINDOWS = 4


def weight_size(llm) -> tuple[int, float]:
    """(bytes, bits per weight) of the weights as the kernels read them;
    bits per weight over the matrices and embeddings."""
    total = params = qbytes = 0
    for w in llm.engine.runner.weights.values():
        total += w.data.nbytes
        if len(w.shape) == 2:
            params += w.shape[0] * w.shape[1]
            qbytes += w.data.nbytes
    return total, 8 * qbytes / max(params, 1)


SPEED_ROUNDS = 3
SPEED_DECODE = 32


def speed(llms: dict, prompts: list[list[int]], decode: int = SPEED_DECODE) -> dict[str, tuple[float, float]]:
    """Single-stream prefill and decode tok/s of every configuration: round r
    gives every configuration prompt r (each round another prompt, and the
    prefix cache emptied before each: asserted that none was served from it), greedy, `decode` tokens with EOS
    ignored; prefill = prompt tokens / time to the first token, decode =
    (decode - 1) tokens / the rest. Rounds alternate over the configurations
    (side by side on a noisy machine); each reports its median round."""
    from llamajet.engine.sampling import SamplingParams

    sp = SamplingParams(max_tokens=decode, temperature=0.0, ignore_eos=True)
    got: dict[str, list[tuple[float, float]]] = {n: [] for n in llms}
    for ids in prompts:
        for name, llm in llms.items():
            llm.engine.blocks.reset_cache()
            out = llm.generate([ids], sp)[0]
            m = out.metrics
            assert m.cached_tokens == 0, "a timed prompt came from the prefix cache"
            got[name].append((len(ids) / m.ttft_s, (len(out.token_ids) - 1) / (m.total_s - m.ttft_s)))
    return {n: (float(np.median([p for p, _ in v])), float(np.median([d for _, d in v]))) for n, v in got.items()}


def main(a) -> int:
    from llamajet.api import LLM
    from llamajet.options import runtime_config

    text_path = Path(a.text)
    if not text_path.is_file():
        raise SystemExit(f"llamajet eval: --text {a.text}: no such file")
    base = runtime_config(a, max_model_len=a.ctx, kv_cache_tokens=a.ctx)
    # the reference is the float model: float weights, float activations and an fp32 KV cache (the
    # other configurations keep the KV dtype they run with, so its rounding is part of their KL)
    configs: dict[str, tuple] = {"float": (a.model, {"kernels": "reference", "quantize": "none", "kv_dtype": "f32"})}
    configs["default"] = (a.model, {})
    for s in [x for x in (a.scheme or "").split(",") if x]:
        configs[s] = (a.model, {"quantize": s})
    for p in a.saved or []:
        configs[Path(p).name] = (p, {})
    llms = {}
    for name, (path, opts) in configs.items():
        llms[name] = LLM(path, base, **opts)
    text = text_path.read_text(encoding="utf-8")
    windows = corpus_windows(llms["float"].tokenizer, text, a.ctx, a.windows)

    def progress(i: int, n: int) -> None:
        print(f"\rllamajet eval: window {i}/{n}", end="" if i < n else "\n", file=sys.stderr, flush=True)

    scores = evaluate(llms, windows, "float", progress=progress)
    tps: dict = {}
    if a.speed:  # prompts from the text after the scored windows (never scored, never cached)
        plen = min(256, a.ctx - SPEED_DECODE)
        more = corpus_windows(llms["float"].tokenizer, text, plen, len(windows) * a.ctx // plen + SPEED_ROUNDS + 1)
        prompts = more[-SPEED_ROUNDS:] if len(more) * plen > len(windows) * a.ctx + SPEED_ROUNDS * plen else []
        if not prompts:
            print("llamajet eval: the text has no tokens left after the scored windows for --speed", file=sys.stderr)
        else:
            tps = speed(llms, prompts)  # the float row too: what the reference kernels cost is worth seeing
    ref_ppl = scores["float"].ppl
    rows = []
    for name, s in scores.items():
        size, bpw = weight_size(llms[name])
        rows.append({"config": name, "tokens": s.tokens, "ppl": s.ppl, "dppl_pct": 100 * (s.ppl / ref_ppl - 1),
                     "kl": s.kl, "top1": s.top1, "weights_mb": size / 1e6, "bits_per_weight": bpw,
                     "scored_tok_s": s.tokens / s.seconds if s.seconds else float("nan"),
                     "prefill_tok_s": tps.get(name, (float("nan"),) * 2)[0],
                     "decode_tok_s": tps.get(name, (float("nan"),) * 2)[1]})
    print(f"model: {llms['float'].path.name}  text: {text_path.name}  {len(windows)} windows x {a.ctx} tokens")
    print("| config | PPL | Δ PPL | KL vs float | top-1 | weights MB | bits/weight | scored tok/s | prefill tok/s "
          "| decode tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['ppl']:.3f} | {r['dppl_pct']:+.2f}% | {r['kl']:.3e} | {100 * r['top1']:.1f}% | "
              f"{r['weights_mb']:.1f} | {r['bits_per_weight']:.2f} | {r['scored_tok_s']:.0f} | "
              f"{r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} |")
    if getattr(a, "report", None):
        from llamajet.formats.schemes import rtn_scheme
        from llamajet.quant.report import write_eval_report

        which = {"default": (None, None), **{s: (None, rtn_scheme(s)) for s in configs if s not in ("float", "default")
                                             and configs[s][0] == a.model},
                 **{Path(p).name: (p, None) for p in a.saved or []}}
        # the per-layer inputs come from the float model over the first windows (REPORT_WINDOWS: the forward is numpy)
        write_eval_report(Path(a.report), llms["float"].path, which, windows[:REPORT_WINDOWS], rows)
        print(f"report: {a.report}/report.md")
    if a.json:
        Path(a.json).write_text(json.dumps({"windows": len(windows), "ctx": a.ctx, "text": str(text_path),
                                            "results": rows}, indent=1))
    return 0


__all__ = ["main", "weight_size"]
