"""A Llama-3 model stored as a Q4_K_M-style mix of GGUF K-quants, end to end
against HF transformers holding the same (gguf-dequantized) weights.

gguf-py cannot write K-quants, so the blocks come from a small encoder here
(plain RTN into each format's fields, not llama.cpp's search): any valid
encoding will do, since the reference is what gguf.quants decodes from the
bytes. llama.cpp's own quantizer output is measured in benchmarks
(benchmarks/kquant_quality.py), where llama-cpp-python is installed.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as Q  # noqa: E402
from test_loaders import heads_of, hf_to_canonical, interleave, write_gguf  # noqa: E402

from llamajet.config import ModelConfig, RuntimeConfig  # noqa: E402
from llamajet.engine.block_manager import BlockManager  # noqa: E402
from llamajet.engine.runner import ModelRunner  # noqa: E402
from llamajet.loaders import load_model  # noqa: E402

from test_model_vs_hf import _step  # noqa: E402

torch.set_num_threads(2)


def _f16b(x):
    return np.asarray(x, np.float16).view(np.uint8).reshape(*np.shape(x), 2)


def encode_q4_k(w: np.ndarray, five: bool = False) -> np.ndarray:
    """[n, k] floats -> Q4_K (or Q5_K) blocks [n, k / 256 * 144 (176)]."""
    n, k = w.shape
    levels = 31 if five else 15
    x = w.reshape(n, k // 256, 8, 32).astype(np.float32)
    mn_v = np.maximum(-x.min(-1), 0)                       # w = d sc q - dmin mn
    sc_v = (x.max(-1) + mn_v) / levels
    D = (sc_v.max(-1) / 63).astype(np.float16)
    DM = (mn_v.max(-1) / 63).astype(np.float16)
    Df, DMf = D.astype(np.float32)[..., None], DM.astype(np.float32)[..., None]
    sc = np.clip(np.rint(np.divide(sc_v, Df, out=np.zeros_like(sc_v), where=Df > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(np.divide(mn_v, DMf, out=np.zeros_like(mn_v), where=DMf > 0)), 0, 63).astype(np.uint8)
    d, dm = Df * sc, DMf * mn
    q = np.clip(np.rint(np.divide(x + dm[..., None], d[..., None], out=np.zeros_like(x),
                                  where=d[..., None] > 0)), 0, levels).astype(np.uint8)
    scales = np.zeros((n, k // 256, 12), np.uint8)  # inverse of gguf's Q4_K.get_scale_min
    scales[..., 0:4] = (sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6)
    scales[..., 4:8] = (mn[..., :4] & 0x3F) | ((mn[..., 4:] >> 4) << 6)
    scales[..., 8:12] = (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)
    ql = q.reshape(n, k // 256, 4, 2, 32) & 0x0F
    qs = (ql[..., 0, :] | (ql[..., 1, :] << 4)).reshape(n, k // 256, 128)
    parts = [_f16b(D), _f16b(DM), scales]
    if five:
        hi = (q.reshape(n, k // 256, 8, 32) >> 4).astype(np.uint8)
        parts.append((hi << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=-2).astype(np.uint8))
    parts.append(qs)
    return np.concatenate(parts, axis=-1).reshape(n, -1)


def encode_q6_k(w: np.ndarray) -> np.ndarray:
    """[n, k] floats -> Q6_K blocks [n, k / 256 * 210]."""
    n, k = w.shape
    x = w.reshape(n, k // 256, 16, 16).astype(np.float32)
    s = np.abs(x).max(-1) / 31
    D = (s.max(-1) / 127).astype(np.float16)
    Df = D.astype(np.float32)[..., None]
    sc = np.clip(np.rint(np.divide(s, Df, out=np.zeros_like(s), where=Df > 0)), -128, 127).astype(np.int8)
    d = (Df * sc)[..., None]
    q = (np.clip(np.rint(np.divide(x, d, out=np.zeros_like(x), where=d != 0)), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(n, k // 256, 2, 4, 32)                   # half h, quarter s: element 128 h + 32 s + l
    low = q & 0x0F
    ql = (low[:, :, :, 0:2] | (low[:, :, :, 2:4] << 4)).reshape(n, k // 256, 128)
    qh = ((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(axis=-2).astype(np.uint8)
    return np.concatenate([ql, qh.reshape(n, k // 256, 64), sc.view(np.uint8), _f16b(D)], axis=-1).reshape(n, -1)


ENCODE = {Q.Q4_K: encode_q4_k, Q.Q5_K: lambda w: encode_q4_k(w, five=True), Q.Q6_K: encode_q6_k}


@pytest.mark.parametrize("qt", list(ENCODE), ids=lambda q: q.name)
def test_encoder_makes_blocks_gguf_decodes_close_to_the_input(qt):
    w = np.random.default_rng(0).normal(size=(8, 512)).astype(np.float32) * 0.05
    deq = gguf.quants.dequantize(ENCODE[qt](w), qt).reshape(w.shape)
    step = {Q.Q4_K: 1 / 15, Q.Q5_K: 1 / 31, Q.Q6_K: 1 / 31}[qt] * 2  # of each sub-block's range, generously
    assert np.abs(deq - w).max() <= step * np.abs(w).max()


# Q4_K_M as llama.cpp mixes it: Q4_K, with attn_v / ffn_down in Q6_K on some
# layers (here layer 0) and the output matrix Q6_K; Q5_K and Q5_0 on the
# other layer's attn_v / ffn_down so every twin runs in one model.
MIX = {"token_embd": Q.Q4_K, "output": Q.Q6_K, "output_norm": Q.F32,
       "blk.0.attn_v": Q.Q6_K, "blk.0.ffn_down": Q.Q6_K, "blk.1.attn_v": Q.Q5_K, "blk.1.ffn_down": Q.Q5_0}


@pytest.fixture(scope="module")
def kquant_model(tmp_path_factory):
    """(GGUF path, HF model with the gguf-dequantized weights)."""
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    folder = tmp_path_factory.mktemp("kquant")
    hf.save_pretrained(folder, safe_serialization=True)
    config = ModelConfig.from_hf(folder)
    tensors, deq = {}, {}
    for hf_name, t in hf.state_dict().items():
        name = hf_to_canonical(hf_name)
        w = t.detach().numpy().astype(np.float32)
        if w.ndim == 1:
            tensors[name] = (w, Q.F32)
            deq[hf_name] = w
            continue
        qt = MIX.get(name, MIX.get(name.split(".", 1)[-1], Q.Q4_K))
        rows = interleave(w, heads_of(name, config)) if name.endswith(("attn_q", "attn_k")) else w
        blocks = ENCODE[qt](rows) if qt in ENCODE else gguf.quants.quantize(rows, qt)
        tensors[name] = (blocks, qt)
        back = gguf.quants.dequantize(blocks, qt).reshape(rows.shape)
        if name.endswith(("attn_q", "attn_k")):
            n, k = back.shape
            h = heads_of(name, config)
            back = back.reshape(h, n // h // 2, 2, k).swapaxes(1, 2).reshape(n, k)
        deq[hf_name] = back
    path = folder / "mix.gguf"
    write_gguf(path, config, tensors)
    hf.load_state_dict({k: torch.from_numpy(v) for k, v in deq.items()})
    return path, hf


def _logits(path, kernels, ids, **options):
    runner = ModelRunner(load_model(path), RuntimeConfig(max_model_len=256, max_tokens_per_step=64, kv_dtype="f32",
                                                         kv_cache_tokens=256, kv_prefault=False, kernels=kernels,
                                                         **options))
    kinds = {w.dtype for w in runner.weights.values()}
    bm = BlockManager(runner.num_blocks, runner.block_size)
    table: list[int] = []
    got = [_step(runner, bm, table, ids[:24], 0, all_rows=True)]
    for t in range(24, len(ids)):
        got.append(_step(runner, bm, table, [ids[t]], t, all_rows=False))
    return np.concatenate(got).astype(np.float64), kinds


def test_kquant_mix_matches_transformers(kquant_model):
    path, hf = kquant_model
    ids = np.random.default_rng(1).integers(0, 512, size=32).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].double().numpy()
    # float activations on the packed twins: the same weights in fp32 on both
    # sides, only the summation order differs (as the fp32 test: <= 1e-4)
    a16, kinds = _logits(path, "a16", ids)
    assert np.abs(a16 - ref).max() / np.abs(ref).max() <= 1e-4
    assert {"pk_q4k", "pk_q5k", "pk_q6k", "pk_i5s"} <= kinds, kinds
    # the fast path: int8 activations (one scale per 256 for the K-quants, as
    # llama.cpp's Q8_K; per 32 for Q5_0) add noise, not error: KL against the
    # reference distribution (as the SmolLM2 test)
    fast, _ = _logits(path, "fast", ids)
    la, lb = ref - ref.max(-1, keepdims=True), fast - fast.max(-1, keepdims=True)
    pa = la - np.log(np.exp(la).sum(-1, keepdims=True))
    pb = lb - np.log(np.exp(lb).sum(-1, keepdims=True))
    kl = (np.exp(pa) * (pa - pb)).sum(-1)
    assert kl.mean() < 0.02 and kl.max() < 0.2, (kl.mean(), kl.max())
    assert (fast.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
    ref_path, _ = _logits(path, "reference", ids)  # weights dequantized to fp32 at load
    assert np.abs(ref_path - ref).max() / np.abs(ref).max() <= 1e-4


def test_kquant_inputs_quantized_once_equal_each_matmul_quantizing_its_own(kquant_model):
    """The K-quants' int8 inputs (Q8_ACTK: one scale per 256) made by the fused
    producers (add_rmsnorm's quantize-on-write, the quantize op before
    ffn_down) and by each matmul's own input stage (fuse=False) are the same
    codes, so the logits are the same bits; act_outliers=0 keeps the graphs
    comparable (the outlier channels ride on the fused producers only)."""
    path, _ = kquant_model
    ids = np.random.default_rng(2).integers(0, 512, size=32).tolist()
    fused, _ = _logits(path, "fast", ids, act_outliers=0)
    plain, _ = _logits(path, "fast", ids, act_outliers=0, fuse=False)
    np.testing.assert_array_equal(fused, plain)
