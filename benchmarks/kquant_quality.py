"""K-quant quality on real weights: SmolLM2-135M re-quantized by llama.cpp's
own quantizer, llamajet and llama.cpp on the same files, KL against the float
model on the same WikiText-2 windows.

    python benchmarks/kquant_quality.py [--windows 8] [--types q4_k_m,q6_k]

The float model is the default model's Q4_1 GGUF dequantized to fp32
(llamajet kernels='reference', fp32 KV): llama.cpp's quantizer
(llama_cpp.llama_model_quantize, allow_requantize) re-quantizes that file's
values into Q4_K_M / Q6_K / ... under a temporary directory. Each engine's
next-token distributions over the windows (every position but each window's
first) are compared with the float model's: mean KL(p_float || p) and top-1
agreement; the target is llamajet's KL within 5% of llama.cpp's.
"""

from __future__ import annotations

import argparse
import ctypes
import tempfile
from pathlib import Path

import numpy as np

from llamajet.engine.sampling import log_softmax

FTYPES = {"q4_k_m": 15, "q4_k_s": 14, "q5_k_m": 17, "q6_k": 18, "q8_0": 7, "q4_0": 2, "q5_0": 8}  # llama_ftype


def quantize(src: Path, dst: Path, kind: str) -> Path:
    import llama_cpp

    if dst.exists():
        return dst
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = FTYPES[kind]
    p.allow_requantize = True
    p.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize({kind}) failed: {rc}")
    return dst


def llama_cpp_logits(path: Path, windows) -> list[np.ndarray]:
    import llama_cpp

    lc = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_batch=512, logits_all=True, n_threads=2,
                         flash_attn=True, verbose=False)
    out = []
    for w in windows:
        lc.reset()
        lc.eval(w)
        out.append(np.array(lc.scores[: len(w)], copy=True))
    return out


def main(argv=None) -> int:
    from llamajet import LLM
    from llamajet.eval.perplexity import DEFAULT_CORPUS, corpus_windows
    from llamajet.models import default_model_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--types", default="q4_k_m,q6_k")
    ap.add_argument("--text", type=Path, default=DEFAULT_CORPUS)
    a = ap.parse_args(argv)
    src = Path(default_model_path())
    tmp = Path(tempfile.gettempdir()) / "llamajet-kquant-quality"
    tmp.mkdir(exist_ok=True)
    ref = LLM(src, max_model_len=512, kernels="reference", kv_dtype="f32")
    windows = corpus_windows(ref.tokenizer, a.text.read_text(encoding="utf-8"), 512, a.windows)
    ref_lp = [log_softmax(ref.logits(w)[:-1]) for w in windows]
    del ref

    def score(name, logits):
        kl, top, n = 0.0, 0, 0
        for lp_ref, lg in zip(ref_lp, logits):
            lp = log_softmax(lg[: len(lp_ref)])
            kl += float((np.exp(lp_ref) * (lp_ref - lp)).sum())
            top += int((lp.argmax(-1) == lp_ref.argmax(-1)).sum())
            n += len(lp_ref)
        return kl / n, top / n

    print(f"{len(windows)} windows x 512 tokens of {a.text.name}; float = {src.name} dequantized (fp32)")
    print(f"{'file':10s} {'engine':10s} {'KL vs float':>12s} {'top-1':>7s}")
    for kind in a.types.split(","):
        path = quantize(src, tmp / f"smollm2-{kind}.gguf", kind)
        lj = LLM(path, max_model_len=512, kv_dtype="f32")
        kinds = sorted({w.dtype for w in lj.engine.runner.weights.values() if w.kind.quantizable})
        kl_j, t_j = score("llamajet", [lj.logits(w)[:-1] for w in windows])
        del lj
        kl_c, t_c = score("llama.cpp", [x[:-1] for x in llama_cpp_logits(path, windows)])
        print(f"{kind:10s} {'llamajet':10s} {kl_j:12.3e} {100 * t_j:6.2f}%   ({', '.join(kinds)})")
        print(f"{kind:10s} {'llama.cpp':10s} {kl_c:12.3e} {100 * t_c:6.2f}%")
        print(f"{kind:10s} llamajet / llama.cpp KL: {kl_j / kl_c:.3f}  ({'PASS' if kl_j <= 1.05 * kl_c else 'MISS'} "
              "at <= 1.05)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
