"""The one naming of weights: canonical (GGUF-style, no ".weight") names, and
the maps from Hugging Face and GGUF tensor names onto them.

Canonical names and their logical shapes (row-major, matrices [N_out, K_in]):

    token_embd              [vocab, hidden]
    output_norm             [hidden]
    output                  [vocab, hidden]      absent when embeddings are tied
    blk.{i}.attn_norm       [hidden]
    blk.{i}.attn_q          [num_heads * head_dim, hidden]
    blk.{i}.attn_k          [num_kv_heads * head_dim, hidden]
    blk.{i}.attn_v          [num_kv_heads * head_dim, hidden]
    blk.{i}.attn_output     [hidden, num_heads * head_dim]
    blk.{i}.ffn_norm        [hidden]
    blk.{i}.ffn_gate        [intermediate, hidden]
    blk.{i}.ffn_up          [intermediate, hidden]
    blk.{i}.ffn_down        [hidden, intermediate]
"""

from __future__ import annotations

import re
from typing import Iterator

from llamajet.config import ModelConfig

# canonical -> HF, outside the blocks
_GLOBAL_TO_HF = {
    "token_embd": "model.embed_tokens.weight",
    "output_norm": "model.norm.weight",
    "output": "lm_head.weight",
}
# canonical suffix -> HF suffix, inside block i ("blk.{i}.<x>" <-> "model.layers.{i}.<y>")
_BLOCK_TO_HF = {
    "attn_norm": "input_layernorm.weight",
    "attn_q": "self_attn.q_proj.weight",
    "attn_k": "self_attn.k_proj.weight",
    "attn_v": "self_attn.v_proj.weight",
    "attn_output": "self_attn.o_proj.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "ffn_gate": "mlp.gate_proj.weight",
    "ffn_up": "mlp.up_proj.weight",
    "ffn_down": "mlp.down_proj.weight",
}
_HF_GLOBAL = {v: k for k, v in _GLOBAL_TO_HF.items()}
_HF_BLOCK = {v: k for k, v in _BLOCK_TO_HF.items()}

_HF_BLOCK_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_CANON_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)")

# llama.cpp's precomputed llama3 RoPE divisors (GGUF only); folded into ModelConfig
ROPE_FREQS = "rope_freqs"
# GGUF stores these rows in interleaved-RoPE order (see WeightTensor.rope_interleaved)
ROPE_ROTATED = frozenset({"attn_q", "attn_k"})


def hf_to_canonical(hf_name: str) -> str | None:
    """Canonical name of an HF tensor, or None for one llamajet does not use
    (e.g. a stray ``rotary_emb.inv_freq`` buffer)."""
    if hf_name in _HF_GLOBAL:
        return _HF_GLOBAL[hf_name]
    m = _HF_BLOCK_RE.fullmatch(hf_name)
    if m and m.group(2) in _HF_BLOCK:
        return f"blk.{int(m.group(1))}.{_HF_BLOCK[m.group(2)]}"
    return None


def canonical_to_hf(name: str) -> str:
    if name in _GLOBAL_TO_HF:
        return _GLOBAL_TO_HF[name]
    m = _CANON_BLOCK_RE.fullmatch(name)
    if m and m.group(2) in _BLOCK_TO_HF:
        return f"model.layers.{m.group(1)}.{_BLOCK_TO_HF[m.group(2)]}"
    raise KeyError(f"no HF name for canonical tensor {name!r}")


def gguf_to_canonical(gguf_name: str) -> str | None:
    """Canonical name of a GGUF tensor, or None for one outside the Llama set
    (``rope_freqs`` included: it is config, not a weight)."""
    if not gguf_name.endswith(".weight"):
        return None
    name = gguf_name[: -len(".weight")]
    if name in _GLOBAL_TO_HF:
        return name
    m = _CANON_BLOCK_RE.fullmatch(name)
    if m and m.group(2) in _BLOCK_TO_HF:
        return f"blk.{int(m.group(1))}.{m.group(2)}"
    return None


def canonical_to_gguf(name: str) -> str:
    return name + ".weight"


def is_rope_rotated(name: str) -> bool:
    """True for attn_q / attn_k: the projections whose rows RoPE rotates."""
    return name.rsplit(".", 1)[-1] in ROPE_ROTATED


def iter_expected(config: ModelConfig, with_output: bool) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every canonical tensor a Llama of ``config`` has, with its logical shape,
    lazily: a corrupt layer count (2**32) fails at the first missing layer, not
    after building billions of names. ``with_output``: include the LM head."""
    c = config
    yield "token_embd", (c.vocab_size, c.hidden_size)
    yield "output_norm", (c.hidden_size,)
    if with_output:
        yield "output", (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        yield f"blk.{i}.attn_norm", (c.hidden_size,)
        yield f"blk.{i}.attn_q", (c.q_size, c.hidden_size)
        yield f"blk.{i}.attn_k", (c.kv_size, c.hidden_size)
        yield f"blk.{i}.attn_v", (c.kv_size, c.hidden_size)
        yield f"blk.{i}.attn_output", (c.hidden_size, c.q_size)
        yield f"blk.{i}.ffn_norm", (c.hidden_size,)
        yield f"blk.{i}.ffn_gate", (c.intermediate_size, c.hidden_size)
        yield f"blk.{i}.ffn_up", (c.intermediate_size, c.hidden_size)
        yield f"blk.{i}.ffn_down", (c.hidden_size, c.intermediate_size)


def expected_shapes(config: ModelConfig, with_output: bool) -> dict[str, tuple[int, ...]]:
    """``iter_expected`` as a dict."""
    return dict(iter_expected(config, with_output))
