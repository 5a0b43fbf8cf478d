"""Model hyper-parameters: what a checkpoint says about the network's shape.

``ModelConfig`` is built once, from a Hugging Face ``config.json``
(``ModelConfig.from_hf``) or from GGUF metadata (``ModelConfig.from_gguf``),
and is frozen afterwards. ``architecture`` names the model family (HF
``model_type``, GGUF ``general.architecture``); whether llamajet runs it is the
model registry's answer (model/registry.py), asked by the loaders. Everything
else llamajet cannot honour is refused here, at load time, with the field and
value named — never discovered later as wrong logits.

RoPE is described in one of two equivalent ways:
- ``rope_scaling``: Llama-3.1's "llama3" frequency scaling, as HF configs state it;
- ``rope_freq_factors``: one divisor per frequency, as llama.cpp stores the same
  scaling precomputed in a GGUF ``rope_freqs`` tensor.
``rope_inv_freq()`` turns either into the per-pair inverse frequencies.

``RuntimeConfig`` (at the end) is the other half: every option of how a model
runs (threads, kernels, KV cache, batching), with its default, once.
"""

from __future__ import annotations

import json
import math
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from llamajet.errors import ModelFormatError, RequestError, UnsupportedModelError
from llamajet.gguf_meta import GGUFMeta, typed


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 "llama3" RoPE scaling: long wavelengths are stretched by
    ``factor``, short ones kept, and the band between is interpolated."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise ModelFormatError(f"rope_scaling.factor must be > 0, got {self.factor!r}")
        if not (0 < self.low_freq_factor < self.high_freq_factor):
            # the smoothing divides by (high - low): equal factors would divide by zero
            raise ModelFormatError(
                "rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"low_freq_factor={self.low_freq_factor!r}, high_freq_factor={self.high_freq_factor!r}"
            )
        if self.original_max_position_embeddings <= 0:
            raise ModelFormatError(
                "rope_scaling.original_max_position_embeddings must be > 0, got "
                f"{self.original_max_position_embeddings!r}"
            )


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA: num_heads % num_kv_heads == 0)
    head_dim: int  # may differ from hidden_size // num_heads when a config says so
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool  # True: the LM head reuses token_embd
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    name: str = ""  # informational only; never compared by the model
    # llama.cpp's precomputed llama3 scaling: [head_dim // 2] divisors of inv_freq
    rope_freq_factors: tuple[float, ...] | None = None
    # the model family (model/registry.py); "llama" for files saved before it was recorded
    architecture: str = "llama"
    attention_bias: bool = False  # Llama's flag: q, k, v and o projections have biases
    mlp_bias: bool = False        # Llama's flag: gate, up and down projections have biases

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ModelFormatError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim={self.head_dim} is odd; RoPE rotates pairs")
        if not (math.isfinite(self.rms_norm_eps) and self.rms_norm_eps > 0):
            raise ModelFormatError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 1):
            raise ModelFormatError(f"rope_theta must be > 1, got {self.rope_theta!r}")
        if self.rope_freq_factors is not None:
            if self.rope_scaling is not None:
                raise ModelFormatError("rope_scaling and rope_freq_factors are both set; give one")
            if len(self.rope_freq_factors) != self.head_dim // 2:
                raise ModelFormatError(
                    f"rope_freq_factors has {len(self.rope_freq_factors)} entries, "
                    f"expected head_dim // 2 = {self.head_dim // 2}"
                )
            if not all(math.isfinite(f) and f > 0 for f in self.rope_freq_factors):
                raise ModelFormatError("rope_freq_factors must all be finite and > 0")
        for name, ids in (("bos_token_id", () if self.bos_token_id is None else (self.bos_token_id,)),
                          ("eos_token_ids", self.eos_token_ids)):
            for tok in ids:
                if not 0 <= tok < self.vocab_size:
                    raise ModelFormatError(f"{name} {tok} is outside the vocabulary [0, {self.vocab_size})")

    # --- derived sizes -------------------------------------------------------------

    @property
    def q_size(self) -> int:
        """Width of the query projection: num_heads * head_dim."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of each of the key and value projections: num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    @property
    def kv_group(self) -> int:
        """Query heads sharing one KV head."""
        return self.num_heads // self.num_kv_heads

    # --- RoPE -------------------------------------------------------------------

    def rope_inv_freq(self) -> np.ndarray:
        """float64 [head_dim // 2]: the angle per position of each rotated pair.

        Unscaled: theta ** (-2i / head_dim). With llama3 scaling, the same
        arithmetic as HF transformers' ``_compute_llama3_parameters`` (done in
        float64 here, float32 there). With llama.cpp's factors: divided by them.
        """
        d = self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        if self.rope_freq_factors is not None:
            return inv_freq / np.asarray(self.rope_freq_factors, dtype=np.float64)
        rs = self.rope_scaling
        if rs is None:
            return inv_freq
        low_freq_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_freq_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # wavelen < high_freq_wavelen: unchanged; wavelen > low_freq_wavelen: / factor
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rs.factor, inv_freq)
        # in between: interpolate; the formula meets both branches at the band edges
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return np.where(is_medium, smoothed, scaled)

    # --- named constructors ---------------------------------------------------------

    @classmethod
    def from_hf(cls, path_or_dict: str | Path | Mapping[str, Any]) -> "ModelConfig":
        """From a Hugging Face ``config.json``: a model folder, the file, or its dict.

        From a folder, EOS ids in ``generation_config.json`` are added to the
        config's (Llama-3-Instruct lists ``<|eot_id|>`` only there).
        """
        extra_eos: list[int] = []
        name = ""
        if isinstance(path_or_dict, Mapping):
            cfg = dict(path_or_dict)
        else:
            path = Path(path_or_dict)
            if path.is_dir():
                name = path.name
                gen_path = path / "generation_config.json"
                path = path / "config.json"
                if gen_path.is_file():
                    try:
                        extra_eos = _as_id_list(_read_json(gen_path).get("eos_token_id"), "eos_token_id")
                    except ModelFormatError:
                        extra_eos = []  # generation defaults are optional; a bad file is not fatal
            cfg = _read_json(path)
        return _parse_hf(cfg, name or str(cfg.get("_name_or_path", "")), extra_eos)

    @staticmethod
    def architecture_of_hf(folder: str | Path) -> str:
        """The model family a Hugging Face folder's config.json names (checked
        before the rest of the config, so an unsupported family is named as such)."""
        return _hf_architecture(_read_json(Path(folder) / "config.json"))

    @staticmethod
    def architecture_of_gguf(reader) -> str:
        """The model family a GGUF names (general.architecture)."""
        arch = GGUFMeta(reader).require("general.architecture", str)
        if not arch:
            raise ModelFormatError("general.architecture is empty")
        return arch

    @classmethod
    def from_gguf(cls, reader) -> "ModelConfig":
        """From the metadata of an open ``gguf.GGUFReader`` (``<architecture>.*`` keys).

        Tied embeddings are inferred as llama.cpp does: no ``output.weight``
        tensor. A ``rope_freqs.weight`` tensor becomes ``rope_freq_factors``.
        """
        return _parse_gguf(reader)


# =====================================================================================
# Hugging Face config.json
# =====================================================================================

_HF_CAUSAL_LM = "ForCausalLM"  # transformers' class suffix of a generating model
_HF_MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")


MAX_CONFIG_BYTES = 64 * 1024 * 1024  # a real config.json is a few KB; read nothing bigger (docs/limits.md)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ModelFormatError(f"{path}: no such file")
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ModelFormatError(f"{path}: {size} bytes, above the limit of {MAX_CONFIG_BYTES} for a config file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path}: not valid JSON ({e})") from e
    except RecursionError:  # [[[[...]]]] past Python's parser's depth
        raise ModelFormatError(f"{path}: JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _as_id_list(value, field: str) -> list[int]:
    """An id or list of ids (HF allows both for eos_token_id) as a list."""
    if value is None:
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ModelFormatError(f"{field} must be an integer or a list of integers, got {value!r}")
    return list(values)


def _require(cfg: Mapping, key: str, kind=int):
    if key not in cfg or cfg[key] is None:
        raise ModelFormatError(f"config is missing required field {key!r}")
    return typed(cfg[key], key, kind)


def _hf_architecture(cfg: Mapping) -> str:
    """The model family: model_type, else derived from the class name
    ("Qwen2ForCausalLM" -> "qwen2"), which transformers names after it."""
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures")
    if isinstance(archs, str):
        archs = [archs]
    if model_type is None and not archs:
        raise ModelFormatError("config has neither 'model_type' nor 'architectures'")
    if archs:
        other = [a for a in archs if not (isinstance(a, str) and a.endswith(_HF_CAUSAL_LM))]
        if other:
            raise UnsupportedModelError(f"architectures={archs!r}: only causal language models "
                                        f"(*{_HF_CAUSAL_LM}) generate text")
    if model_type is not None:
        if not isinstance(model_type, str) or not model_type:
            raise ModelFormatError(f"model_type must be a non-empty string, got {model_type!r}")
        return model_type
    return archs[0][: -len(_HF_CAUSAL_LM)].lower()


def _refuse_unsupported_hf(cfg: Mapping) -> None:
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # one function, two names in transformers' ACT2FN
        raise UnsupportedModelError(f"hidden_act={act!r}; only 'silu' is supported")
    if cfg.get("use_sliding_window"):  # Qwen2 configs carry sliding_window but use it only when this is set
        raise UnsupportedModelError("use_sliding_window=True: sliding-window attention is not supported")
    for key in ("attention_bias", "mlp_bias"):
        if not isinstance(cfg.get(key, False), bool):
            raise ModelFormatError(f"{key} must be true or false, got {cfg[key]!r}")
    for key in _HF_MOE_FIELDS:
        if typed(cfg.get(key) or 0, key, int) > 0:
            raise UnsupportedModelError(f"{key}={cfg[key]!r}; mixture-of-experts models are not supported")
    qc = cfg.get("quantization_config")
    if qc:
        method = qc.get("quant_method") if isinstance(qc, Mapping) else qc
        raise UnsupportedModelError(
            f"quantization_config (quant_method={method!r}); load the unquantized checkpoint "
            "or a GGUF instead"
        )


def _parse_hf_rope(cfg: Mapping, max_pos: int) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from transformers-4 (``rope_scaling`` + top-level
    ``rope_theta``) or transformers-5 (``rope_parameters`` with theta inside) form."""
    params: dict = {}
    for key in ("rope_scaling", "rope_parameters"):  # v5's name wins where both say something
        value = cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, Mapping):
            raise ModelFormatError(f"{key} must be an object or null, got {value!r}")
        if any(isinstance(v, Mapping) for v in value.values()):
            raise UnsupportedModelError(f"{key}={dict(value)!r}: per-layer RoPE parameters are not supported")
        params.update(value)
    # theta: v5 keeps it in rope_parameters, v4 at top level; 10000 is LlamaConfig's default
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta")
    if theta is None:
        theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    theta = typed(theta, "rope_theta", float)
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise UnsupportedModelError(f"partial_rotary_factor={partial!r}; RoPE must cover the whole head")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise UnsupportedModelError(
            f"rope_scaling type {rope_type!r}; only 'default' and 'llama3' are supported"
        )
    def need(key: str, kind):
        if params.get(key) is None:
            raise ModelFormatError(f"llama3 rope_scaling is missing {key!r}")
        return typed(params[key], f"rope_scaling.{key}", kind)
    orig = params.get("original_max_position_embeddings")
    scaling = RopeScaling(
        factor=need("factor", float),
        low_freq_factor=need("low_freq_factor", float),
        high_freq_factor=need("high_freq_factor", float),
        # transformers documents this fallback for a missing value
        original_max_position_embeddings=max_pos if orig is None
        else typed(orig, "rope_scaling.original_max_position_embeddings", int),
    )
    return theta, scaling


def _parse_hf(cfg: Mapping, name: str, extra_eos: list[int]) -> ModelConfig:
    architecture = _hf_architecture(cfg)
    _refuse_unsupported_hf(cfg)
    hidden = _require(cfg, "hidden_size")
    num_heads = _require(cfg, "num_attention_heads")
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if hidden % num_heads:
            raise ModelFormatError(
                f"hidden_size={hidden} is not divisible by num_attention_heads={num_heads} and no head_dim is given"
            )
        head_dim = hidden // num_heads
    # Defaults below are LlamaConfig's, so a sparse config means what it means to transformers.
    max_pos = typed(cfg.get("max_position_embeddings", 2048), "max_position_embeddings", int)
    theta, scaling = _parse_hf_rope(cfg, max_pos)
    eos: list[int] = []
    for tok in _as_id_list(cfg.get("eos_token_id"), "eos_token_id") + extra_eos:
        if tok not in eos:
            eos.append(tok)
    bos = _as_id_list(cfg.get("bos_token_id"), "bos_token_id")
    return ModelConfig(
        vocab_size=_require(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_require(cfg, "intermediate_size"),
        num_layers=_require(cfg, "num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=typed(cfg.get("num_key_value_heads") or num_heads, "num_key_value_heads", int),
        head_dim=typed(head_dim, "head_dim", int),
        rms_norm_eps=typed(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps", float),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=tuple(eos),
        name=name,
        architecture=architecture,
        attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
    )


# =====================================================================================
# GGUF metadata
# =====================================================================================

_GGUF_ROPE_FREQS = "rope_freqs.weight"


def _gguf_rope_freq_factors(reader, head_dim: int) -> tuple[float, ...] | None:
    for t in reader.tensors:
        if t.name == _GGUF_ROPE_FREQS:
            if t.tensor_type.name not in ("F32", "F16"):
                raise ModelFormatError(f"{_GGUF_ROPE_FREQS} has type {t.tensor_type.name}; expected F32")
            values = np.asarray(t.data, dtype=np.float64).reshape(-1)
            if values.size != head_dim // 2:
                raise ModelFormatError(
                    f"{_GGUF_ROPE_FREQS} has {values.size} entries, expected head_dim // 2 = {head_dim // 2}"
                )
            return tuple(float(v) for v in values)
    return None


def _parse_gguf(reader) -> ModelConfig:
    meta = GGUFMeta(reader)
    arch = ModelConfig.architecture_of_gguf(reader)
    p = arch + "."  # hyper-parameter keys are prefixed by the architecture
    experts = meta.get(p + "expert_count", int, 0)
    if experts > 0:
        raise UnsupportedModelError(f"{p}expert_count={experts}; mixture-of-experts models are not supported")

    hidden = meta.require(p + "embedding_length", int)
    num_heads = meta.require(p + "attention.head_count", int)
    num_kv_heads = meta.get(p + "attention.head_count_kv", int, num_heads)
    rope_dims = meta.get(p + "rope.dimension_count", int)
    # head_dim as llama.cpp derives it: key_length, else hidden / heads
    head_dim = meta.get(p + "attention.key_length", int)
    if head_dim is None:
        if num_heads > 0 and hidden % num_heads == 0:
            head_dim = hidden // num_heads
        elif rope_dims is not None:
            head_dim = rope_dims
        else:
            raise ModelFormatError(f"{p}embedding_length={hidden} is not divisible by "
                                   f"{p}attention.head_count={num_heads} and no key_length is given")
    value_dim = meta.get(p + "attention.value_length", int, head_dim)
    if value_dim != head_dim:
        raise UnsupportedModelError(f"{p}attention.value_length={value_dim} differs from key_length={head_dim}")
    if rope_dims is not None and rope_dims != head_dim:
        raise UnsupportedModelError(
            f"{p}rope.dimension_count={rope_dims} differs from head_dim={head_dim} (partial RoPE)"
        )

    # Rope scaling: llama.cpp writes "llama3" as a rope_freqs tensor; the
    # keyed kinds (linear, yarn, longrope) are ones we do not implement.
    scaling_type = meta.get(p + "rope.scaling.type", str, "none")
    if scaling_type != "none":
        raise UnsupportedModelError(f"{p}rope.scaling.type={scaling_type!r}; not supported")
    for key in (p + "rope.scaling.factor", p + "rope.scale_linear"):
        factor = meta.get(key, float)
        if factor is not None and factor not in (0.0, 1.0):  # 0 and 1 both mean "no scaling"
            raise UnsupportedModelError(f"{key}={factor!r}; linear RoPE scaling is not supported")

    vocab = meta.array_len("tokenizer.ggml.tokens") or meta.get(p + "vocab_size", int)
    if vocab is None:
        embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if embd is None:
            raise ModelFormatError("GGUF has no tokenizer.ggml.tokens, llama.vocab_size or token_embd.weight")
        vocab = int(embd.shape[-1])  # GGUF dims are reversed: [hidden, vocab]

    eos: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        tok = meta.get(key, int)
        if tok is not None and tok not in eos:
            eos.append(tok)
    names = {t.name for t in reader.tensors}
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=meta.require(p + "feed_forward_length", int),
        num_layers=meta.require(p + "block_count", int),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=meta.require(p + "attention.layer_norm_rms_epsilon", float),
        rope_theta=meta.get(p + "rope.freq_base", float, 10000.0),  # llama.cpp's default
        rope_scaling=None,
        max_position_embeddings=meta.require(p + "context_length", int),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id", int),
        eos_token_ids=tuple(eos),
        name=meta.get("general.name", str, ""),
        rope_freq_factors=_gguf_rope_freq_factors(reader, head_dim),
        architecture=arch,
        # GGUF states biases by carrying them (as llama.cpp reads them): layer 0 tells
        attention_bias="blk.0.attn_q.bias" in names,
        mlp_bias="blk.0.ffn_gate.bias" in names,
    )


# =====================================================================================
# The runtime configuration
# =====================================================================================

# The KV cache storage types by option name. NOTE: these name the C++ core's
# KV types (ops.KV_DTYPES, exported by the extension); this module may not
# import the core, so tests/test_contract.py ties the two lists together.
KV_CACHE_DTYPES = ("f32", "f16", "bf16", "int8")
# matmul kernels: "fast" = packed weights with int8 activations (W*A8), "a16" =
# packed weights with float activations (W*A16), "reference" = weights as
# loaded, dequantized in fp32 inside the matmul
KERNELS = ("fast", "a16", "reference")
SPECULATIVE = ("ngram", "suffix")  # proposers (engine/speculative.py)
# what float checkpoints' matrices become at load by default (RuntimeConfig.float_scheme)
FLOAT_CHECKPOINT_SCHEME = "int8_g32"
DEFAULT_MAX_MODEL_LEN = 4096  # KV memory grows with it; models may allow more
MAX_ACT_OUTLIERS = 64  # channels per matmul input kept in float (RuntimeConfig.act_outliers)
# 12: KL vs float activations 3.4e-3 -> 9.5e-4 on SmolLM2 (6 WikiText-2 windows; 8: 1.17e-3, 16: 1.03e-3,
# 24: 8.1e-4), prefill 0.91x, decode unchanged within noise (benchmarks/default_path.py, docs/quantization.md)
DEFAULT_ACT_OUTLIERS = 12
DEFAULT_KV_CACHE_TOKENS = 8192  # default pool: at least this many tokens (or one full context)


_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20, "mb": 10**6,
          "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40, "tb": 10**12}


def parse_bytes(v) -> int:
    """A size: an int, or "4GiB" / "512 MiB" / "2GB" / "1.5g" (K, M, G, T and
    KiB.. are binary, KB.. decimal). ValueError on anything else or <= 0."""
    import re

    if isinstance(v, bool):
        raise ValueError("a size in bytes, e.g. 4GiB")
    if isinstance(v, int):
        n = v
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(v))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{v!r} is not a size: a byte count or e.g. 4GiB, 512MiB, 2GB")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError("must be positive")
    return n


def _fmt_bytes(n: int) -> str:
    for unit, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= f:
            return f"{n / f:.2f} {unit}"
    return f"{n} B"


def _option(default, help: str, **meta):
    """A RuntimeConfig field: its default and the help the CLI shows, once."""
    return field(default=default, metadata={"help": help, **meta})


@dataclass(frozen=True)
class RuntimeConfig:
    """Every engine and runtime option with its default, once.

    ``LLM(path, **options)`` builds one; the runner and the engine read it;
    the CLI's flags (cli.py, add_runtime_args) are made from these fields, so
    an option cannot exist in one place and not the other. Frozen: a changed
    option is a new config (``dataclasses.replace``).
    """

    max_model_len: int | None = _option(
        None, "context served: prompt + output tokens (default: min(the model's, 4096))")
    n_threads: int | None = _option(
        None, "compute threads (default: the usable cores: physical cores in the affinity mask, capped by the "
        "cgroup's CPU quota; more are lowered to that, with a warning)", flags=("--threads", "-t"))
    oversubscribe: bool = _option(False, "keep an n_threads above the usable cores instead of lowering it")
    isa: str | None = _option(
        None, "force a kernel tier: scalar | avx2 | avx512 | amx (default: the best this CPU has)")
    kernels: str = _option(
        "fast", "fast (packed weights, int8 activations) | a16 (packed, float activations) | reference "
        "(weights as loaded, dequantized in fp32)", choices=KERNELS)
    quantize: str | None = _option(
        None, "RTN-quantize the weights at load to this scheme, e.g. int4_asym_g32 (packed kernels only); "
        "'none': float checkpoints keep float weights (default: their float matrices become "
        f"{FLOAT_CHECKPOINT_SCHEME}, llama.cpp's Q8_0 layout; GGUF and saved models keep theirs)")
    kv_dtype: str = _option(
        "f16", "KV cache storage: f16 (KL 4e-7 vs f32 on WikiText-2, llama.cpp's default too) | f32 | bf16 | "
        "int8 (a scale per token and head)", choices=KV_CACHE_DTYPES)
    kv_cache_tokens: int | None = _option(
        None, "KV pool size in tokens (default: max(max_model_len, 8192); or size it by kv_cache_memory)")
    kv_cache_memory: str | None = _option(
        None, "KV pool size in bytes, e.g. 4GiB, 512MiB, 2GB or a byte count: the pool holds as many "
        "blocks as fit (must hold one max_model_len context)")
    weight_cache: str | None = _option(
        None, "a folder for GGUF weights in the kernels' layout: the first load of a .gguf writes them there "
        "(a saved llamajet model, as big as the file), later loads map them without repacking (default: off)")
    act_outliers: int = _option(
        DEFAULT_ACT_OUTLIERS, "W*A8 (kernels='fast'): the k input channels of largest magnitude of each quantized matmul "
        "input (found by a short calibration pass at load) are kept out of the int8 activations and "
        "added back as a float product (0: off)")
    block_size: int = _option(16, "token slots per KV block")
    enable_prefix_caching: bool = _option(True, "reuse the K/V of equal prompt prefixes across requests")
    # The block manager hands out blocks least-recently-freed first (so cached
    # prefixes live longest), which walks the whole pool anyway; committing
    # lazily only moves that cost into steps as page faults (measured: 3.4 of
    # 23 ms per batch-16 decode step of SmolLM2-135M).
    kv_prefault: bool = _option(True, "commit the KV pool's memory at start, so no step takes page faults")
    fuse: bool = _option(True, "run the fusion passes (QKV + RoPE, gate/up + SwiGLU, residual epilogues, "
                               "add + RMSNorm with int8 on write, final norm in the LM head)")
    max_num_seqs: int = _option(64, "sequences computed together in one step")
    max_tokens_per_step: int = _option(256, "token budget of a step (prefill chunks + decode tokens)")
    speculative: str | None = _option(
        None, "speculative decoding: ngram (propose what followed the last tokens' earlier occurrence in the "
        "prompt or output) or suffix (the most frequent continuation of the longest matching context in the "
        "prompt, the output and recent requests' outputs), verified in one step; the output is the same "
        "tokens, greedy or seeded; draft:PATH (a smaller model with the same vocabulary proposes greedily) or "
        "layers:N (the model's own first N layers do) (default: off)")
    num_speculative_tokens: int = _option(
        8, "speculative decoding: most tokens proposed per step for a sequence (adapts to its acceptance)")
    speculative_cost_model: bool = _option(
        True, "speculative decoding: verify only the proposed tokens that a step-cost model (step times measured "
        "at start, then as observed) and each sequence's recent acceptance say raise the tokens per second; "
        "off: verify every proposal")

    def __post_init__(self) -> None:
        def bad(name: str, why: str):
            raise RequestError(f"{name}={getattr(self, name)!r}: {why}")

        for name in ("max_model_len", "n_threads", "kv_cache_tokens"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                bad(name, "must be a positive integer or None")
        v = self.act_outliers
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_ACT_OUTLIERS:
            bad("act_outliers", f"must be an integer in 0..{MAX_ACT_OUTLIERS}")
        sp = self.speculative
        if not (sp is None or sp in SPECULATIVE or (isinstance(sp, str) and (
                (sp.startswith("draft:") and len(sp) > 6) or (sp.startswith("layers:") and sp[7:].isdigit())))):
            bad("speculative", f"use one of {', '.join(SPECULATIVE)}, draft:PATH, layers:N or None")
        for name in ("block_size", "max_num_seqs", "max_tokens_per_step", "num_speculative_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                bad(name, "must be a positive integer")
        for name in ("enable_prefix_caching", "kv_prefault", "fuse", "oversubscribe", "speculative_cost_model"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be True or False")
        if self.max_model_len is not None and self.max_model_len < 2:
            bad("max_model_len", "must be >= 2 (a prompt token and a new one)")
        if self.kernels not in KERNELS:
            bad("kernels", f"use one of {', '.join(KERNELS)}")
        if self.kv_dtype not in KV_CACHE_DTYPES:
            bad("kv_dtype", f"use one of {', '.join(KV_CACHE_DTYPES)}")
        if self.quantize not in (None, "none") and self.kernels == "reference":
            bad("quantize", "a quantization scheme needs the packed kernels (kernels='fast' or 'a16')")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            bad("kv_cache_tokens", f"must hold at least one block ({self.block_size} tokens)")
        if self.kv_cache_memory is not None:
            try:
                object.__setattr__(self, "kv_cache_memory", str(parse_bytes(self.kv_cache_memory)))
            except ValueError as e:
                bad("kv_cache_memory", str(e))
            if self.kv_cache_tokens is not None:
                bad("kv_cache_memory", "give kv_cache_tokens or kv_cache_memory, not both")
        for name in ("isa", "quantize", "weight_cache"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                bad(name, "must be a name or None")

    def with_options(self, **options) -> "RuntimeConfig":
        """This config with `options` changed; an unknown name is an error
        naming it (and the closest option)."""
        known = {f.name for f in dataclasses.fields(self)}
        for name in options:
            if name not in known:
                import difflib

                close = difflib.get_close_matches(name, known, n=1)
                raise RequestError(f"unknown option {name!r}" + (f"; did you mean {close[0]!r}?" if close else
                                                                  f"; options: {', '.join(sorted(known))}"))
        return dataclasses.replace(self, **options)

    # --- derived -----------------------------------------------------------------

    @property
    def repack(self) -> bool:
        """Weights go to the packed kernels' layout (kernels fast or a16)."""
        return self.kernels != "reference"

    @property
    def float_scheme(self) -> str | None:
        """What float matrices (an HF checkpoint's) become at load when no
        scheme is given: int8 per 32 (the Q8_0 layout), so a bf16 folder runs
        on the packed kernels (prefill 31 -> ~300 tok/s at 1B) at llama.cpp's
        Q8_0 cost (KL: docs, README). None: kept float (quantize='none', or
        the reference kernels)."""
        if self.quantize is not None or not self.repack:
            return None
        return FLOAT_CHECKPOINT_SCHEME

    @property
    def load_scheme(self) -> str | None:
        """The scheme every quantizable weight is RTN'd to (quantize=...), or None."""
        return None if self.quantize in (None, "none") else self.quantize

    @property
    def act_int8(self) -> bool:
        """Packed matmuls take int8 activations (W*A8)."""
        return self.kernels == "fast"

    def for_model(self, model: ModelConfig) -> "RuntimeConfig":
        """This config with max_model_len resolved for `model` (and checked against its limit)."""
        limit = model.max_position_embeddings
        n = self.max_model_len if self.max_model_len is not None else min(limit, DEFAULT_MAX_MODEL_LEN)
        if not 2 <= n <= limit:
            raise RequestError(f"max_model_len={n} must be in 2..{limit} for this model")
        return dataclasses.replace(self, max_model_len=n)

    def _resolved_len(self) -> int:
        if self.max_model_len is None:
            raise ValueError("max_model_len is not resolved yet (RuntimeConfig.for_model)")
        return self.max_model_len

    @property
    def step_tokens(self) -> int:
        """The step token budget, never above the context."""
        return min(self.max_tokens_per_step, self._resolved_len())

    @property
    def step_seqs(self) -> int:
        """Sequences per step: never more than the step's tokens."""
        return min(self.max_num_seqs, self.step_tokens)

    def kv_blocks(self, bytes_per_token: int) -> int:
        """KV pool blocks for a model whose K and V of one token (every layer)
        take `bytes_per_token`: kv_cache_tokens, or as many as kv_cache_memory
        holds (at least one full context), or the default."""
        if self.kv_cache_memory is not None:
            blocks = int(self.kv_cache_memory) // (bytes_per_token * self.block_size)
            need = -(-self._resolved_len() // self.block_size)
            if blocks < need:
                raise RequestError(
                    f"kv_cache_memory={_fmt_bytes(int(self.kv_cache_memory))} holds {blocks * self.block_size} "
                    f"tokens ({bytes_per_token} bytes each), less than one context of max_model_len="
                    f"{self._resolved_len()}: give at least {_fmt_bytes(need * self.block_size * bytes_per_token)} "
                    "or a smaller max_model_len")
            return blocks
        tokens = self.kv_cache_tokens or max(self._resolved_len(), DEFAULT_KV_CACHE_TOKENS)
        return -(-tokens // self.block_size)
