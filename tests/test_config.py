"""ModelConfig: parsing HF config.json and GGUF metadata, refusing what we
cannot honour, and RoPE inverse frequencies checked against HF transformers."""

import copy
import dataclasses
import json
import math

import numpy as np
import pytest

import gguf  # noqa: E402

from llamajet.config import ModelConfig, RopeScaling  # noqa: E402
from llamajet.errors import ModelFormatError, UnsupportedModelError  # noqa: E402

from conftest import SHARED_DATA as DATA, STORIES_GGUF, STORIES_HF  # noqa: E402  (one place for the data paths)

needs_stories = pytest.mark.skipif(not STORIES_HF.is_dir() or not STORIES_GGUF.is_file(),
                                   reason=f"shared test data not found under {DATA}")

_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
          "attention_bias": False, "mlp_bias": False}
_LLAMA3_8K = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192, "rope_type": "llama3"}

# Published config.json values of real checkpoints (transformers-4 form: rope_scaling + rope_theta).
REAL_CONFIGS = {
    "llama-3.0-8b": {**_LLAMA, "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": None,
                     "max_position_embeddings": 8192, "tie_word_embeddings": False,
                     "bos_token_id": 128000, "eos_token_id": 128001},
    "llama-3.1-8b-instruct": {**_LLAMA, "vocab_size": 128256, "hidden_size": 4096,
                              "intermediate_size": 14336, "num_hidden_layers": 32,
                              "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
                              "rope_theta": 500000.0, "rope_scaling": _LLAMA3_8K,
                              "max_position_embeddings": 131072, "tie_word_embeddings": False,
                              "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]},
    "llama-3.2-1b": {**_LLAMA, "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
                     "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                     "rope_scaling": {**_LLAMA3_8K, "factor": 32.0}, "max_position_embeddings": 131072,
                     "tie_word_embeddings": True, "bos_token_id": 128000, "eos_token_id": 128001},
    "tinyllama-1.1b": {**_LLAMA, "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
                       "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
                       "rms_norm_eps": 1e-5, "rope_scaling": None, "max_position_embeddings": 2048,
                       "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2},
    "smollm2-135m": {**_LLAMA, "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                     "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                     "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "rope_scaling": None,
                     "max_position_embeddings": 8192, "tie_word_embeddings": True,
                     "bos_token_id": 1, "eos_token_id": 2},
}
TINY = {**_LLAMA, "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2}


# --- HF parsing -----------------------------------------------------------------------

@needs_stories
def test_stories_hf_config():
    c = ModelConfig.from_hf(STORIES_HF)
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (512, 64, 172, 5)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.kv_group) == (8, 4, 8, 2)
    assert (c.rms_norm_eps, c.rope_theta, c.rope_scaling) == (1e-5, 10000.0, None)
    assert (c.max_position_embeddings, c.tie_word_embeddings) == (512, True)
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))
    # folder, file and dict give the same config (the name comes from the folder only)
    by_file = ModelConfig.from_hf(STORIES_HF / "config.json")
    by_dict = ModelConfig.from_hf(json.loads((STORIES_HF / "config.json").read_text()))
    assert dataclasses.replace(c, name="") == by_file == by_dict


def test_real_configs_parse():
    c = ModelConfig.from_hf(REAL_CONFIGS["llama-3.1-8b-instruct"])
    assert c.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    assert (c.head_dim, c.q_size, c.kv_size, c.eos_token_ids) == (128, 4096, 1024, (128001, 128008, 128009))
    c = ModelConfig.from_hf(REAL_CONFIGS["llama-3.2-1b"])
    assert (c.head_dim, c.tie_word_embeddings, c.rope_scaling.factor) == (64, True, 32.0)
    c = ModelConfig.from_hf(REAL_CONFIGS["tinyllama-1.1b"])
    assert (c.rope_theta, c.rope_scaling, c.num_kv_heads) == (10000.0, None, 4)  # theta: LlamaConfig default
    c = ModelConfig.from_hf(REAL_CONFIGS["smollm2-135m"])
    assert (c.head_dim, c.num_heads, c.num_kv_heads, c.rope_theta) == (64, 9, 3, 100000.0)


def test_rope_parameters_form_equals_rope_scaling_form():
    # transformers 5 writes rope_parameters (theta inside); 4 wrote rope_scaling + rope_theta
    v4 = REAL_CONFIGS["llama-3.1-8b-instruct"]
    v5 = {k: v for k, v in v4.items() if k not in ("rope_scaling", "rope_theta")}
    v5["rope_parameters"] = {**_LLAMA3_8K, "rope_theta": 500000.0}
    assert ModelConfig.from_hf(v4) == ModelConfig.from_hf(v5)
    # "type" (older spelling) and "default" are accepted too
    old = {**v4, "rope_scaling": {**{k: v for k, v in _LLAMA3_8K.items() if k != "rope_type"}, "type": "llama3"}}
    assert ModelConfig.from_hf(old) == ModelConfig.from_hf(v4)
    default = {**TINY, "rope_parameters": {"rope_type": "default", "rope_theta": 1234.0}}
    assert ModelConfig.from_hf(default).rope_theta == 1234.0


def test_generation_config_eos_is_merged(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert ModelConfig.from_hf(tmp_path).eos_token_ids == (2, 7)


def test_architecture_and_bias_flags_are_recorded():
    """The config names the family (model_type, else the class name); which
    families run is the model registry's answer (the loaders ask it)."""
    from llamajet.model import registry

    assert ModelConfig.from_hf({**TINY, "model_type": "qwen2"}).architecture == "qwen2"
    no_type = {k: v for k, v in TINY.items() if k != "model_type"}
    assert ModelConfig.from_hf({**no_type, "architectures": ["MistralForCausalLM"]}).architecture == "mistral"
    c = ModelConfig.from_hf({**TINY, "attention_bias": True, "mlp_bias": True})
    assert (c.architecture, c.attention_bias, c.mlp_bias) == ("llama", True, True)
    assert registry.get("qwen2").name == "qwen2"
    with pytest.raises(UnsupportedModelError, match=r"'mistral' is not supported; supported: llama, qwen2"):
        registry.get("mistral")


@pytest.mark.parametrize("change, field", [
    ({"architectures": ["LlamaForSequenceClassification"]}, "causal language models"),
    ({"use_sliding_window": True, "sliding_window": 4096}, "sliding-window"),
    ({"num_local_experts": 8}, "num_local_experts"),
    ({"hidden_act": "gelu"}, "gelu"),
    ({"num_key_value_heads": 3}, "num_kv_heads=3"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "yarn"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "linear"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "longrope"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"head_dim": 5, "hidden_size": 20}, "head_dim=5"),
    ({"quantization_config": {"quant_method": "gptq"}}, "gptq"),
])
def test_unsupported_hf_configs(change, field):
    with pytest.raises(UnsupportedModelError, match=field):
        ModelConfig.from_hf({**TINY, **change})


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "intermediate_size",
                                   "num_hidden_layers", "num_attention_heads"])
def test_missing_required_field(field):
    cfg = {k: v for k, v in TINY.items() if k != field}
    with pytest.raises(ModelFormatError, match=field):
        ModelConfig.from_hf(cfg)


@pytest.mark.parametrize("change, field", [
    ({"hidden_size": 0}, "hidden_size"),
    ({"vocab_size": -5}, "vocab_size"),
    ({"num_hidden_layers": 1.5}, "num_hidden_layers"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
    ({"rope_theta": -1.0}, "rope_theta"),
    ({"eos_token_id": 99}, "eos_token_ids"),
    ({"eos_token_id": "</s>"}, "eos_token_id"),
    ({"hidden_size": 18}, "head_dim"),  # 18 / 4 heads does not divide and no head_dim given
    ({"model_type": None, "architectures": None}, "model_type"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"rope_scaling": {**_LLAMA3_8K, "high_freq_factor": 1.0}}, "high_freq_factor"),
])
def test_malformed_hf_configs(change, field):
    with pytest.raises(ModelFormatError, match=field):
        ModelConfig.from_hf({**TINY, **change})


def test_from_hf_bad_paths(tmp_path):
    with pytest.raises(ModelFormatError, match="no such file"):
        ModelConfig.from_hf(tmp_path)  # folder without config.json
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelFormatError, match="not valid JSON"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelFormatError, match="JSON object"):
        ModelConfig.from_hf(tmp_path)


# --- RoPE against transformers -------------------------------------------------------------

def _transformers_inv_freq(cfg_dict: dict) -> np.ndarray:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    # only inv_freq is built here: no weights are allocated, so 8B shapes are free.
    # deepcopy: LlamaConfig writes rope_theta into the rope dict it is handed
    return LlamaRotaryEmbedding(LlamaConfig(**copy.deepcopy(cfg_dict))).inv_freq.double().numpy()


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_rope_inv_freq_matches_transformers_float32(name):
    ours = ModelConfig.from_hf(REAL_CONFIGS[name]).rope_inv_freq()
    assert ours.dtype == np.float64 and ours.shape == (ModelConfig.from_hf(REAL_CONFIGS[name]).head_dim // 2,)
    # transformers computes in float32: the exponent 2i/d is rounded (rel 6e-8) and
    # theta**x multiplies that error by x*ln(theta) <= ln(5e5) ~ 13, i.e. <= 8e-7;
    # pow and the llama3 divisions add a few float32 ulps (1.2e-7 each). 2e-6 covers it.
    np.testing.assert_allclose(ours, _transformers_inv_freq(REAL_CONFIGS[name]), rtol=2e-6, atol=0)


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_rope_inv_freq_matches_transformers_float64(name, monkeypatch):
    import torch

    # Run transformers' own code in float64 (its `dtype=torch.float` becomes
    # float64): then both sides evaluate the same formula in the same precision
    # and differ only by operation-order rounding, a few ulps (~1e-15). 1e-12 leaves
    # three orders of margin yet catches any wrong constant or branch (>= 1e-8).
    monkeypatch.setattr(torch, "float", torch.float64)
    theirs = _transformers_inv_freq(REAL_CONFIGS[name])
    monkeypatch.undo()
    np.testing.assert_allclose(ModelConfig.from_hf(REAL_CONFIGS[name]).rope_inv_freq(), theirs, rtol=1e-12, atol=0)


def test_llama3_scaling_bands():
    # head_dim 16, theta 1e4: wavelengths 6.3, 19.9, 62.8, 199, ... against bands
    # [orig/high, orig/low] = [16, 64]: one pair unchanged, two smoothed, five / factor
    c = ModelConfig.from_hf({**TINY, "hidden_size": 64, "rope_theta": 1e4, "rope_scaling": {**_LLAMA3_8K,
                             "original_max_position_embeddings": 64}})
    base = 1.0 / 1e4 ** (np.arange(0, 16, 2) / 16)  # the unscaled formula, same rounding
    ratio = base / c.rope_inv_freq()
    assert ratio[0] == 1.0 and np.all(ratio[3:] == 8.0)  # exact: x / 8 is exact in binary
    assert np.all((ratio[1:3] > 1.0) & (ratio[1:3] < 8.0))


# --- GGUF metadata ------------------------------------------------------------------------

_GGUF_META = {
    "llama.context_length": 64, "llama.embedding_length": 16, "llama.block_count": 1,
    "llama.feed_forward_length": 24, "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
    "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.rope.freq_base": 10000.0, "llama.vocab_size": 32,
}


def _gguf_config(tmp_path, arch="llama", change=None, drop=(), tensors=None) -> ModelConfig:
    """Write a metadata-only GGUF (plus ``tensors``) and parse its config."""
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(path, arch)
    for key, value in {**_GGUF_META, **(change or {})}.items():
        if key in drop:
            continue
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    for name, array in (tensors or {}).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ModelConfig.from_gguf(gguf.GGUFReader(path))


@needs_stories
def test_stories_gguf_config_equals_hf():
    hf = ModelConfig.from_hf(STORIES_HF)
    gg = ModelConfig.from_gguf(gguf.GGUFReader(STORIES_GGUF))
    # equal field by field but the informational name; eps 1e-5 survives its float32 storage
    assert dataclasses.replace(gg, name=hf.name) == hf
    assert gg.name == "stories260K"


def test_gguf_metadata_parse(tmp_path):
    c = _gguf_config(tmp_path, change={"tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
                                       "tokenizer.ggml.eot_token_id": 3, "general.name": "tiny"})
    assert (c.vocab_size, c.hidden_size, c.head_dim, c.num_kv_heads) == (32, 16, 4, 2)
    assert (c.rms_norm_eps, c.rope_theta, c.tie_word_embeddings) == (1e-5, 10000.0, True)  # no output tensor
    assert (c.bos_token_id, c.eos_token_ids, c.name) == (1, (2, 3), "tiny")


def test_gguf_rope_freqs_tensor_gives_llama3_frequencies(tmp_path):
    # llama.cpp's convert stores llama3 scaling as divisors of inv_freq (its loop, in float64)
    rs = RopeScaling(8.0, 1.0, 4.0, 64)
    factors = []
    for freq in 1e4 ** (-np.arange(0, 16, 2) / 16):  # head_dim 16: pairs in all three bands
        wavelen = 2 * math.pi / freq
        if wavelen < 64 / rs.high_freq_factor:
            factors.append(1.0)
        elif wavelen > 64 / rs.low_freq_factor:
            factors.append(rs.factor)
        else:
            smooth = (64 / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
            factors.append(1 / ((1 - smooth) / rs.factor + smooth))
    c = _gguf_config(tmp_path, change={"llama.embedding_length": 64, "llama.rope.dimension_count": 16},
                     tensors={"rope_freqs.weight": np.array(factors, dtype=np.float32)})
    assert c.rope_scaling is None and len(c.rope_freq_factors) == 8
    hf = ModelConfig.from_hf({**TINY, "hidden_size": 64, "rope_theta": 1e4, "max_position_embeddings": 64,
                              "rope_scaling": {**_LLAMA3_8K, "original_max_position_embeddings": 64}})
    # factors are stored as float32: half an ulp, 6e-8 relative; the rest is float64
    np.testing.assert_allclose(c.rope_inv_freq(), hf.rope_inv_freq(), rtol=1.2e-7, atol=0)


@pytest.mark.parametrize("arch, change, err, field", [
    ("llama", {"llama.expert_count": 8}, UnsupportedModelError, "expert_count"),
    ("llama", {"llama.rope.scaling.type": "yarn"}, UnsupportedModelError, "yarn"),
    ("llama", {"llama.rope.scaling.factor": 4.0}, UnsupportedModelError, "scaling.factor"),
    ("llama", {"llama.rope.dimension_count": 2}, UnsupportedModelError, "partial RoPE"),
    ("llama", {"llama.attention.head_count_kv": 3}, UnsupportedModelError, "num_kv_heads=3"),
    ("llama", {"llama.rope.freq_base": "big"}, ModelFormatError, "freq_base"),
])
def test_gguf_unsupported_or_malformed(tmp_path, arch, change, err, field):
    with pytest.raises(err, match=field):
        _gguf_config(tmp_path, arch=arch, change=change)


@pytest.mark.parametrize("key", ["llama.block_count", "llama.embedding_length", "llama.context_length",
                                 "llama.attention.layer_norm_rms_epsilon"])
def test_gguf_missing_required_key(tmp_path, key):
    with pytest.raises(ModelFormatError, match=key):
        _gguf_config(tmp_path, drop=(key,))
