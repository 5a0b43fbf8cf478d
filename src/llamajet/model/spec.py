"""Tensor specs: which tensors an architecture's checkpoints hold, by name.

One naming of weights, mapped once: each TensorRule gives a tensor's
canonical name (GGUF-style, without ".weight": ``blk.{i}.attn_q``,
``blk.{i}.attn_q.bias``), its Kind, its logical shape from the ModelConfig,
its name in a Hugging Face folder and in a GGUF file, and when it is present.
Loaders map every tensor of a file through its architecture's ArchSpec: an
unknown tensor is an error that names it (only the spec's `ignored` names,
e.g. RoPE buffers that are config, not weights, are skipped).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterator

from llamajet.config import ModelConfig
from llamajet.formats.weight import Kind


def _always(cfg: ModelConfig) -> bool:
    return True


@dataclass(frozen=True)
class TensorRule:
    name: str                                   # canonical pattern; "{i}" is the layer
    kind: Kind
    shape: Callable[[ModelConfig], tuple]       # logical shape, matrices [N_out, K_in]
    hf: str                                     # name pattern in a Hugging Face folder
    gguf: str                                   # name pattern in a GGUF file
    when: Callable[[ModelConfig], bool] = _always  # present iff
    rope: bool = False                          # rows RoPE rotates (q/k projections and their biases)

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.name


def _pattern(p: str) -> re.Pattern:
    return re.compile(re.escape(p).replace(re.escape("{i}"), r"(\d+)"))


@dataclass(frozen=True)
class ArchSpec:
    """An architecture: its tensors, how its checkpoints name them, its graph builder."""

    name: str                                   # ModelConfig.architecture: HF model_type, GGUF general.architecture
    tensors: tuple[TensorRule, ...]
    build: Callable                             # build(cfg, weights, max_pos) -> Graph
    gguf_rope_interleaved: bool                 # llama.cpp's converter permutes q/k rows of this architecture
    ignored: tuple[str, ...] = ()               # file names that are not weights (either format)
    _hf: tuple = field(default=(), init=False, repr=False, compare=False)
    _gguf: tuple = field(default=(), init=False, repr=False, compare=False)
    _ignored: tuple = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "_hf", tuple((_pattern(r.hf), r) for r in self.tensors))
        object.__setattr__(self, "_gguf", tuple((_pattern(r.gguf), r) for r in self.tensors))
        object.__setattr__(self, "_ignored", tuple(_pattern(p) for p in self.ignored))

    def expected(self, cfg: ModelConfig) -> Iterator[tuple[str, TensorRule]]:
        """Every canonical tensor a model of `cfg` has, lazily (a corrupt layer
        count of 2**32 fails at the first missing layer, not after building
        billions of names)."""
        for r in self.tensors:
            if not r.per_layer and r.when(cfg):
                yield r.name, r
        for i in range(cfg.num_layers):
            for r in self.tensors:
                if r.per_layer and r.when(cfg):
                    yield r.name.format(i=i), r

    def _map(self, table, native: str) -> tuple[str, TensorRule] | None:
        for pat, rule in table:
            m = pat.fullmatch(native)
            if m:
                return (rule.name.format(i=int(m.group(1))) if rule.per_layer else rule.name), rule
        return None

    def from_hf(self, native: str) -> tuple[str, TensorRule] | None:
        return self._map(self._hf, native)

    def from_gguf(self, native: str) -> tuple[str, TensorRule] | None:
        return self._map(self._gguf, native)

    def is_ignored(self, native: str) -> bool:
        return any(p.fullmatch(native) for p in self._ignored)

    def rule(self, canonical: str) -> TensorRule | None:
        for r in self.tensors:
            if _pattern(r.name).fullmatch(canonical):
                return r
        return None

    def native_name(self, canonical: str, which: str) -> str:
        """The file's name ("hf" or "gguf") of a canonical tensor."""
        r = self.rule(canonical)
        if r is None:
            return canonical
        pat = getattr(r, which)
        if r.per_layer:
            return pat.format(i=int(_pattern(r.name).fullmatch(canonical).group(1)))
        return pat


def decoder_tensors(*, qkv_bias: Callable[[ModelConfig], bool], o_bias: Callable[[ModelConfig], bool],
                    mlp_bias: Callable[[ModelConfig], bool]) -> tuple[TensorRule, ...]:
    """The tensors of a Llama-style decoder (pre-norm, GQA attention, SwiGLU
    MLP), with the given biases. Names as transformers' LlamaForCausalLM and
    llama.cpp's converter write them."""
    D = lambda c: (c.hidden_size,)  # noqa: E731
    L = "model.layers.{i}."
    rules = [
        TensorRule("token_embd", Kind.EMBEDDING, lambda c: (c.vocab_size, c.hidden_size), "model.embed_tokens.weight",
                   "token_embd.weight"),
        TensorRule("output_norm", Kind.NORM, D, "model.norm.weight", "output_norm.weight"),
        TensorRule("output", Kind.MATRIX, lambda c: (c.vocab_size, c.hidden_size), "lm_head.weight", "output.weight",
                   when=lambda c: not c.tie_word_embeddings),
        TensorRule("blk.{i}.attn_norm", Kind.NORM, D, L + "input_layernorm.weight", "blk.{i}.attn_norm.weight"),
        TensorRule("blk.{i}.ffn_norm", Kind.NORM, D, L + "post_attention_layernorm.weight", "blk.{i}.ffn_norm.weight"),
    ]
    proj = [("attn_q", "self_attn.q_proj", lambda c: (c.q_size, c.hidden_size), True, qkv_bias),
            ("attn_k", "self_attn.k_proj", lambda c: (c.kv_size, c.hidden_size), True, qkv_bias),
            ("attn_v", "self_attn.v_proj", lambda c: (c.kv_size, c.hidden_size), False, qkv_bias),
            ("attn_output", "self_attn.o_proj", lambda c: (c.hidden_size, c.q_size), False, o_bias),
            ("ffn_gate", "mlp.gate_proj", lambda c: (c.intermediate_size, c.hidden_size), False, mlp_bias),
            ("ffn_up", "mlp.up_proj", lambda c: (c.intermediate_size, c.hidden_size), False, mlp_bias),
            ("ffn_down", "mlp.down_proj", lambda c: (c.hidden_size, c.intermediate_size), False, mlp_bias)]
    for name, hf, shape, rope, bias in proj:
        rules.append(TensorRule(f"blk.{{i}}.{name}", Kind.MATRIX, shape, f"{L}{hf}.weight", f"blk.{{i}}.{name}.weight",
                                rope=rope))
        rules.append(TensorRule(f"blk.{{i}}.{name}.bias", Kind.BIAS, lambda c, s=shape: (s(c)[0],), f"{L}{hf}.bias",
                                f"blk.{{i}}.{name}.bias", when=bias, rope=rope))
    return tuple(rules)
