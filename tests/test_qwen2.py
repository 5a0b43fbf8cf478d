"""Qwen2 / Qwen2.5 end to end: a random-weight ``Qwen2ForCausalLM`` from
transformers (the reference for logits and greedy ids), saved as an HF folder
with the real Qwen2.5 tokenizer, and converted to GGUF by llama.cpp's own
convert_hf_to_gguf.py (a converter we did not write), f32 and q8_0.

Shapes are tile-aligned so every fusion pass applies: the QKV pass stacks
Qwen2's q/k/v biases and permutes the q/k rows (and biases) from rotate-half
to interleaved RoPE order, as llama.cpp does not for qwen2.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import convert_to_gguf  # noqa: E402
from llamajet import LLM, SamplingParams  # noqa: E402
from llamajet.loaders import load_model  # noqa: E402

torch.set_num_threads(2)
VOCAB = 151936  # Qwen2.5's embedding rows (the tokenizer has 151,669 ids)


def _qwen2(tmp_path_factory, tokenizer_dir, name: str, tied: bool):
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=tied, use_sliding_window=False, initializer_range=0.1, bos_token_id=151643,
        eos_token_id=151645, attn_implementation="eager")
    torch.manual_seed(7 if tied else 8)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # transformers initializes biases to zero: make them matter
        for pname, p in model.named_parameters():
            if pname.endswith(".bias"):
                p.normal_(0.0, 0.5)
    folder = tmp_path_factory.mktemp(name)
    model.save_pretrained(folder, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        shutil.copy(tokenizer_dir / f, folder / f)
    return folder, model


@pytest.fixture(scope="module")
def qwen_tied(tmp_path_factory, qwen25_tokenizer_dir):
    """Tied embeddings, as Qwen2.5-0.5B; with its GGUFs."""
    folder, model = _qwen2(tmp_path_factory, qwen25_tokenizer_dir, "qwen2_tied", tied=True)
    ggufs = {t: convert_to_gguf(folder, folder.parent / f"{folder.name}-{t}.gguf", t) for t in ("f32", "q8_0")}
    return folder, model, ggufs


@pytest.fixture(scope="module")
def qwen_untied(tmp_path_factory, qwen25_tokenizer_dir):
    return _qwen2(tmp_path_factory, qwen25_tokenizer_dir, "qwen2_untied", tied=False)


def _ids(llm: LLM) -> list[int]:
    return llm.chat_ids([{"role": "user", "content": "Name three colors, then count to five: 1, 2,"}])


def _reference(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def _greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def _check_fp32(llm: LLM, model, fused: bool):
    ids = _ids(llm)
    assert len(ids) > 20
    got = llm.logits(ids).astype(np.float64)
    ref = _reference(model, ids)
    # fp32 on both sides; the fused q/k rows sum q.k in another order (the
    # rotate-half -> interleaved permutation): fp32 ulps times the depth, as
    # the Llama tests (measured here: ~1e-6 of the logits' scale).
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err <= 1e-4, err
    if fused:
        log = llm.engine.runner.fusion_log
        assert any(line.startswith("qkv:") for line in log) and any(line.startswith("gate_up:") for line in log)
        assert "blk.0.attn_qkv.bias" in llm.engine.runner.graph.weights  # the stacked q/k/v biases
    out = llm.generate([ids], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == _greedy(model, ids, 16)


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_qwen2_hf_folder_matches_transformers(qwen_tied, qwen_untied, fuse):
    for folder, model in (qwen_tied[:2], qwen_untied):
        m = load_model(folder)
        assert m.config.architecture == "qwen2"
        assert "output" in m.weights or m.config.tie_word_embeddings
        assert {n for n in m.weights if n.endswith(".bias")} == {f"blk.{i}.attn_{p}.bias" for i in range(2)
                                                                 for p in "qkv"}
        _check_fp32(LLM(folder, max_model_len=256, kv_dtype="f32", fuse=fuse, quantize="none"), model, fuse)


def test_qwen2_gguf_from_llama_cpp_converter_matches_transformers(qwen_tied):
    folder, model, ggufs = qwen_tied
    m = load_model(ggufs["f32"])
    assert m.config.architecture == "qwen2" and m.config.tie_word_embeddings
    # llama.cpp runs qwen2 with NEOX RoPE: its converter keeps HF's row order
    assert not m.weights["blk.0.attn_q"].rope_interleaved and not m.weights["blk.0.attn_q.bias"].rope_interleaved
    np.testing.assert_array_equal(m.weights["blk.1.attn_k.bias"].data,
                                  model.model.layers[1].self_attn.k_proj.bias.detach().numpy())
    hf_cfg = load_model(folder).config
    import dataclasses

    assert dataclasses.replace(m.config, name=hf_cfg.name, max_position_embeddings=hf_cfg.max_position_embeddings,
                               attention_bias=hf_cfg.attention_bias) == hf_cfg
    llm = LLM(ggufs["f32"], max_model_len=256, kv_dtype="f32", quantize="none")
    assert llm.tokenizer.encode("Hello, 123 world") == LLM(folder, max_model_len=256).tokenizer.encode(
        "Hello, 123 world")
    _check_fp32(llm, model, fused=True)


def test_qwen2_q8_0_gguf_fast_path(qwen_tied):
    """The converter's q8_0 GGUF on the fast path: q8_0 repacked losslessly
    into int8 tiles, int8 activations (W8A8), every pass fused. Reference:
    transformers on the same file (it dequantizes the q8_0 blocks) and our own
    fp32 reference kernels on the same weights."""
    pytest.importorskip("accelerate")  # transformers needs it to load a GGUF
    folder, _, ggufs = qwen_tied
    path = ggufs["q8_0"]
    assert load_model(path).weights["blk.0.attn_q"].dtype == "q8_0"
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  torch_dtype=torch.float32).eval()
    fast = LLM(path, max_model_len=256)  # the defaults: fast kernels, fused, fp16 KV
    slow = LLM(path, max_model_len=256, kernels="reference", kv_dtype="f32")
    assert fast.engine.runner.weights["blk.0.attn_qkv"].dtype == "pk_i8"
    ids = _ids(fast)
    ref = _reference(ref_model, ids)
    got_ref = slow.logits(ids).astype(np.float64)
    err = np.abs(got_ref - ref).max() / np.abs(ref).max()
    assert err <= 1e-4, err  # same dequantized values, fp32 sums
    got = fast.logits(ids).astype(np.float64)
    # int8 activations in groups of 32 (127 levels) plus fp16 K/V: ~0.5% of
    # each matmul input's scale, through 2 layers and the LM head. 3% of the
    # logits' scale is well above that and well below a wrong layout, scale,
    # bias or RoPE order (those move logits by their whole scale).
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err <= 3e-2, err
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_qwen2_refusals_name_the_field(qwen_untied, tmp_path):
    folder, _ = qwen_untied
    bad = tmp_path / "sliding"
    shutil.copytree(folder, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(use_sliding_window=True, sliding_window=64)
    (bad / "config.json").write_text(json.dumps(cfg))
    from llamajet.errors import ModelFormatError, UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        LLM(bad)
    cfg.update(use_sliding_window=False, model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=r"'qwen3' is not supported; supported: llama, qwen2"):
        LLM(bad)
    import safetensors.numpy

    tensors = safetensors.numpy.load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.v_proj.bias"]
    nob = tmp_path / "nobias"
    shutil.copytree(folder, nob)
    safetensors.numpy.save_file(tensors, nob / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelFormatError, match=r"missing tensor 'model\.layers\.1\.self_attn\.v_proj\.bias'"):
        load_model(nob)


def test_qwen2_speculative_greedy_is_bit_identical(qwen_untied):
    """Speculative decoding on Qwen2 (its q/k/v biases, untied head, 151,936-row vocabulary): greedy
    output with n-gram proposals verified (every one: no cost model) is plain decoding's, token for
    token, with proposals verified along the way; the defaults (int8_g32 weights, W8A8 rows)."""
    folder, _ = qwen_untied
    plain = LLM(folder, max_model_len=256)
    spec = LLM(folder, max_model_len=256, speculative="ngram", speculative_cost_model=False)
    ids = plain.tokenizer.encode("one two three four one two three four one two three four one two")
    p = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    a, b = plain.generate([ids], p)[0], spec.generate([ids], p)[0]
    assert b.token_ids == a.token_ids and len(a.token_ids) == 48
    assert spec.engine.stats.spec_draft_tokens > 0
