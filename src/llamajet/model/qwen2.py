"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``, GGUF ``qwen2``): a Llama-style decoder
whose q, k and v projections have biases (o and the MLP none), with RoPE in
rotate-half order in both formats (llama.cpp runs qwen2 with NEOX RoPE, so its
converter leaves the q/k rows as they are). The graph is Llama's
(model/llama.py adds each projection's bias where the checkpoint has one)."""

from __future__ import annotations

from llamajet.model.llama import build_graph
from llamajet.model.registry import register
from llamajet.model.spec import ArchSpec, decoder_tensors

QWEN2 = register(ArchSpec(
    "qwen2",
    decoder_tensors(qkv_bias=lambda c: True, o_bias=lambda c: False, mlp_bias=lambda c: False),
    build_graph,
    gguf_rope_interleaved=False,
    ignored=("model.layers.{i}.self_attn.rotary_emb.inv_freq",),
))
