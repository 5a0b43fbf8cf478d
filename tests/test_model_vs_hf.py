"""End-to-end logits and greedy ids against HF transformers' LlamaForCausalLM.

The reference is transformers (torch, fp32, eager attention). llamajet runs
the same weights from the same files through its own loaders, graph,
executor and kernels.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from llamajet.config import RuntimeConfig  # noqa: E402
from llamajet.engine.block_manager import BlockManager  # noqa: E402
from llamajet.engine.runner import ModelRunner, StepBatch  # noqa: E402
from llamajet.loaders import load_model  # noqa: E402

torch.set_num_threads(2)
# the runner alone (no engine): 64-token steps, fp32 KV, a 256-token pool committed lazily
# quantize="none": the checkpoints' float weights as they are (the default makes them int8_g32)
RUNNER = RuntimeConfig(max_model_len=256, max_tokens_per_step=64, kv_dtype="f32", kv_cache_tokens=256, quantize="none",
                       kv_prefault=False)


def _step(runner: ModelRunner, bm: BlockManager, table: list[int], ids: list[int], start: int,
          all_rows: bool) -> np.ndarray:
    """Runs one step of one sequence through the runner; returns logits rows."""
    n = len(ids)
    bm.ensure(table, start + n)
    pos = np.arange(start, start + n, dtype=np.int32)
    slots = np.array([bm.slot(table, int(p)) for p in pos], dtype=np.int32)
    bt = np.zeros((1, runner.max_blocks), dtype=np.int32)
    bt[0, : len(table)] = table
    rows = np.arange(n, dtype=np.int32) if all_rows else np.array([n - 1], dtype=np.int32)
    return runner.execute(StepBatch(np.array(ids, np.int32), pos, slots, np.zeros(n, np.int32), bt,
                                    rows)).copy()


@pytest.fixture(scope="module")
def random_llama3(tmp_path_factory):
    """A random-weight Llama-3 model: 2 layers, GQA 4:1, head_dim 64, llama3 rope scaling."""
    cfg = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=512, intermediate_size=1000, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("random_llama3")
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def test_random_llama3_prefill_and_decode_match_transformers(random_llama3):
    path, hf = random_llama3
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 1024, size=50).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].double().numpy()  # [50, vocab]
    runner = ModelRunner(load_model(path), RUNNER)
    bm = BlockManager(runner.num_blocks, runner.block_size)
    table: list[int] = []
    got = [_step(runner, bm, table, ids[:40], 0, all_rows=True)]          # 40-token prefill
    for t in range(40, 50):                                                 # 10 decode steps
        got.append(_step(runner, bm, table, [ids[t]], t, all_rows=False))
    got = np.concatenate(got)
    # fp32 end to end on both sides; only the summation order differs, so the
    # error is a few fp32 ulps per op times the depth: expect <= 1e-4 of the
    # logits' scale (measured here: 1e-6).
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err <= 1e-4, err
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def stories_reference(stories_hf):
    model = transformers.AutoModelForCausalLM.from_pretrained(stories_hf, torch_dtype=torch.float32).eval()
    prompt = [1, 403, 407, 261, 378]  # "Once upon a time" with BOS (data README)
    return prompt, _hf_greedy(model, prompt, 60)


@pytest.mark.parametrize("which", ["hf", "gguf"])
def test_stories260k_greedy_ids_equal_transformers(which, stories_reference, stories_hf, stories_gguf):
    from llamajet import LLM, SamplingParams

    prompt, ref_ids = stories_reference
    llm = LLM(stories_hf if which == "hf" else stories_gguf)
    assert llm.tokenizer.encode("Once upon a time") == prompt
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == ref_ids
    assert out.text.startswith(", there was a little girl named Lily.")


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_gguf):
    pytest.importorskip("accelerate")  # transformers needs it to load a GGUF
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, torch_dtype=torch.float32).eval()
    return model


def test_smollm2_q4_1_logits_and_greedy_match_transformers(smollm2_gguf, smollm2_reference):
    from llamajet import LLM, SamplingParams

    # fp32 KV: the bound below is fp32 rounding (the default fp16 KV adds its own, measured in test_kv_precision)
    llm = LLM(smollm2_gguf, max_model_len=512, kernels="reference", kv_dtype="f32")
    text = ("The quick brown fox jumps over the lazy dog. In 1969, Apollo 11 landed on the Moon, "
            "and the world watched as Neil Armstrong stepped")
    ids = llm.tokenizer.encode(text)[:32]
    assert len(ids) == 32
    with torch.no_grad():
        ref = smollm2_reference(torch.tensor([ids])).logits[0].double().numpy()
    got = llm.logits(ids).astype(np.float64)
    # Same dequantized fp32 weights (transformers dequantizes the GGUF; we
    # dequantize each block in the kernel, d*q+m in fp32 both ways); only the
    # fp32 summation order differs, over 30 layers. Measured here: 2.4e-6 of
    # the logits' scale (avx512). 1e-4 leaves room for the other tiers' sum
    # orders and still catches any real error (a wrong block, scale or RoPE
    # order moves logits by whole units).
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err <= 1e-4, err
    # Top-1 may only differ where the reference's top two are a near-tie.
    top2 = np.sort(ref, axis=-1)[:, -2:]
    differ = got.argmax(-1) != ref.argmax(-1)
    assert np.all(top2[differ, 1] - top2[differ, 0] < 1e-3 * np.abs(ref).max())
    ref_ids = _hf_greedy(smollm2_reference, ids, 32)
    out = llm.generate([ids], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == ref_ids


def test_smollm2_fast_path_follows_the_reference_path(smollm2_gguf):
    """The fast path (Q4_1 repacked losslessly, int8 activations per group of
    32, integer dot products) against the reference path (same weights
    dequantized in fp32): greedy ids over 64 tokens are equal, or the first
    divergence sits at a near-tie of the reference logits."""
    from llamajet import LLM, SamplingParams

    ref = LLM(smollm2_gguf, max_model_len=512, kernels="reference")
    fast = LLM(smollm2_gguf, max_model_len=512, kernels="fast")
    ids = ref.chat_ids([{"role": "user", "content": "Write a short story about a robot learning to paint."}])
    p = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    a = ref.generate([ids], p)[0].token_ids
    b = fast.generate([ids], p)[0].token_ids
    if a != b:
        i = next(i for i in range(min(len(a), len(b))) if a[i] != b[i])
        lg = ref.logits(ids + a[:i])[-1]
        top2 = np.sort(lg)[-2:]
        # a near-tie: the two best reference logits within 2% of the logit scale
        assert top2[1] - top2[0] < 0.02 * np.abs(lg).max(), (i, top2)
    # Quality of the whole distribution over the prompt: int8 activations add
    # ~0.4% relative noise per matmul input (127 levels per group); measured
    # KL 0.005 nats mean. 0.02 mean / 0.2 max flags a broken scale or layout
    # (those give KL of whole nats) while allowing the quantization noise.
    la, lb = ref.logits(ids).astype(np.float64), fast.logits(ids).astype(np.float64)
    la -= la.max(-1, keepdims=True)
    lb -= lb.max(-1, keepdims=True)
    pa = la - np.log(np.exp(la).sum(-1, keepdims=True))
    pb = lb - np.log(np.exp(lb).sum(-1, keepdims=True))
    kl = (np.exp(pa) * (pa - pb)).sum(-1)
    assert kl.mean() < 0.02 and kl.max() < 0.2, (kl.mean(), kl.max())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoints_match_transformers(random_llama3, tmp_path, dtype):
    """bf16 / f16 safetensors (weights and norms in that dtype) run as stored:
    matmuls convert each weight exactly to fp32, norms are widened at load.
    The reference is transformers on the same file upcast to fp32, so the
    two compute on identical values: the fp32 tolerance of the test above."""
    _, hf = random_llama3
    path = tmp_path / dtype
    hf.to(getattr(torch, dtype)).save_pretrained(path, safe_serialization=True)
    hf.to(torch.float32)
    ref_model = transformers.LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ids = np.random.default_rng(2).integers(0, 1024, size=24).tolist()
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0].double().numpy()
    lm = load_model(path)
    assert lm.weights["blk.0.attn_q"].dtype == {"bfloat16": "bf16", "float16": "f16"}[dtype]
    runner = ModelRunner(lm, RUNNER)
    bm = BlockManager(runner.num_blocks, runner.block_size)
    got = _step(runner, bm, [], ids, 0, all_rows=True)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err <= 1e-4, err


@pytest.fixture(scope="module")
def random_llama_biased(tmp_path_factory, stories_hf):
    """A random Llama with every bias transformers allows (attention_bias: q,
    k, v, o; mlp_bias: gate, up, down), 2 layers, GQA 2:1, tile-aligned shapes
    so every fusion pass applies (QKV with its stacked, permuted biases; gate/up
    with interleaved ones; residual epilogues after a bias)."""
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
        attention_bias=True, mlp_bias=True, tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # transformers initializes biases to zero: make them matter
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    path = tmp_path_factory.mktemp("random_llama_biased")
    model.save_pretrained(path, safe_serialization=True)
    import shutil

    for f in ("tokenizer.json", "tokenizer_config.json"):  # a 512-token vocabulary, as the model's
        shutil.copy(stories_hf / f, path / f)
    return path, model


@pytest.mark.parametrize("fuse", [False, True])
def test_llama_with_biases_matches_transformers(random_llama_biased, fuse):
    from llamajet import LLM, SamplingParams

    path, hf = random_llama_biased
    ids = np.random.default_rng(4).integers(0, 512, size=40).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].double().numpy()
    lm = load_model(path)
    assert {w.kind.value for n, w in lm.weights.items() if n.endswith(".bias")} == {"bias"}
    assert len([n for n in lm.weights if n.endswith(".bias")]) == 2 * 7
    llm = LLM(path, max_model_len=256, fuse=fuse, kv_dtype="f32", quantize="none")
    if fuse:  # the biases ride through each fused epilogue
        log = llm.engine.runner.fusion_log
        assert any(l.startswith("qkv:") for l in log) and any(l.startswith("gate_up:") for l in log)
        assert "blk.0.attn_qkv.bias" in llm.engine.runner.graph.weights
    got = llm.logits(ids).astype(np.float64)
    # fp32 end to end; the fused q/k rows are permuted to interleaved RoPE
    # order (q.k sums in another order): fp32 ulps times the depth, as above.
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err <= 1e-4, err
    out = llm.generate([ids[:8]], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == _hf_greedy(hf, ids[:8], 16)
