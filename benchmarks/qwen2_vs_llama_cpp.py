"""Qwen2 side by side: llamajet, llama.cpp and transformers on the same files.

A random-weight Qwen2ForCausalLM (the shapes of tests/test_qwen2.py: tied
embeddings, q/k/v biases randomized, the real Qwen2.5 tokenizer) saved as an
HF folder and converted to GGUF by llama.cpp's own convert_hf_to_gguf.py
(f32 and q8_0). For each GGUF: the next-token logits of a chat prompt from
llamajet (fast path) and llama.cpp (llama-cpp-python, logits_all), each
against transformers fp32 on the same weights (for q8_0: transformers loading
that GGUF, i.e. the dequantized values), and greedy ids over 32 tokens.

    python benchmarks/qwen2_vs_llama_cpp.py [--out DIR]

Needs llama-cpp-python (see README: built from source) and the converter
`make test` extracts to .venv/llama.cpp/.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="folder for the model and GGUFs (default: a temporary one)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    import torch
    import transformers
    import llama_cpp

    from conftest import QWEN25_TOKENIZER_DIR, convert_to_gguf
    from llamajet import LLM, SamplingParams

    out = Path(a.out or tempfile.mkdtemp(prefix="qwen2_vs_llama_cpp_"))
    folder = out / "hf"
    cfg = transformers.Qwen2Config(
        vocab_size=151936, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=True, use_sliding_window=False, initializer_range=0.1, bos_token_id=151643,
        eos_token_id=151645, attn_implementation="eager")
    torch.manual_seed(7)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        shutil.copy(QWEN25_TOKENIZER_DIR / f, folder / f)

    def rel(x, ref):
        return float(np.abs(x - ref).max() / np.abs(ref).max())

    print(f"{'file':8s} {'engine':10s} {'max |dlogit| / scale':>22s} {'top-1 agree':>12s} {'greedy 32 == HF':>16s}")
    for outtype in ("f32", "q8_0"):
        path = convert_to_gguf(folder, out / f"qwen2-{outtype}.gguf", outtype)
        ref_model = model if outtype == "f32" else transformers.AutoModelForCausalLM.from_pretrained(
            out, gguf_file=path.name, torch_dtype=torch.float32).eval()
        lj = LLM(path, max_model_len=512, n_threads=a.threads)
        ids = lj.chat_ids([{"role": "user", "content": "Name three colors, then count to five: 1, 2,"}])
        with torch.no_grad():
            ref = ref_model(torch.tensor([ids])).logits[0].double().numpy()
            hf_greedy = ref_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                           pad_token_id=0)[0, len(ids):].tolist()
        got = lj.logits(ids).astype(np.float64)
        lj_greedy = lj.generate([ids], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0].token_ids
        lc = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_threads=a.threads, n_batch=512, logits_all=True,
                             verbose=False)
        lc.eval(ids)
        lcl = np.array(lc.scores[: len(ids)], np.float64)
        lc.reset()
        lc_greedy = []
        for tok in lc.generate(ids, temp=0.0, top_k=1, reset=True):
            lc_greedy.append(int(tok))
            if len(lc_greedy) == 32:
                break
        for name, lg, gr in (("llamajet", got, lj_greedy), ("llama.cpp", lcl, lc_greedy)):
            agree = float((lg.argmax(-1) == ref.argmax(-1)).mean())
            print(f"{outtype:8s} {name:10s} {rel(lg, ref):22.2e} {agree:12.1%} {str(gr == hf_greedy):>16s}")
        print(f"{outtype:8s} {'lj vs lc':10s} {rel(got, lcl):22.2e} "
              f"{float((got.argmax(-1) == lcl.argmax(-1)).mean()):12.1%} {str(lj_greedy == lc_greedy):>16s}")
    print(f"(prompt of {len(ids)} tokens; files in {out})")


if __name__ == "__main__":
    main()
