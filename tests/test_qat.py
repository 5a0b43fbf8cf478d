"""QAT (quant/qat.py): fake quantization is llamajet's RTN bit for bit with a
straight-through gradient, the torch forward is the engine's, and training
on stories260K lowers the held-out KL of the RTN-packed model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llamajet.formats.packed import dequantize, quantize_rtn
from llamajet.formats.schemes import get_scheme
from llamajet.quant.qat import LINEARS, TorchModel, fake_quant, kl_div, qat_train


def _rtn(w: np.ndarray, scheme) -> np.ndarray:
    return dequantize(quantize_rtn("w", np.asarray(w, np.float32), scheme))


@pytest.mark.parametrize("name", ["int4_sym_g128", "int4_asym_g128", "int4_sym_g32", "int8_g32", "int8_pc"])
def test_fake_quant_is_rtn_bit_for_bit(name):
    """Heavy-tailed rows; K = 200 and 172 are no multiple of the group (the packing pads the
    row with its last value), 96 is one for g32 only."""
    scheme = get_scheme(name)
    rng = np.random.default_rng(1)
    for shape in [(40, 200), (33, 172), (17, 96)]:
        w = (rng.standard_t(3, size=shape) * 0.02).astype(np.float32)
        q = fake_quant(torch.from_numpy(w), scheme)
        assert q.dtype == torch.float32
        np.testing.assert_array_equal(q.numpy().astype(np.float64), _rtn(w, scheme))


@pytest.mark.parametrize("name", ["int4_sym_g128", "int4_asym_g128", "int8_g32"])
def test_fake_quant_is_rtn_on_real_matrices(smollm2_gguf, name):
    from llamajet.loaders import load_model

    scheme = get_scheme(name)
    W = load_model(smollm2_gguf).weights
    for n in ("blk.0.attn_k", "blk.3.ffn_down"):  # K = 576 (4.5 groups of 128) and 1536
        w = W[n].to_f32().astype(np.float32)
        np.testing.assert_array_equal(fake_quant(torch.from_numpy(w), scheme).numpy().astype(np.float64),
                                      _rtn(w, scheme))


def _grad(w: np.ndarray, scheme, g: np.ndarray) -> np.ndarray:
    wt = torch.tensor(w, requires_grad=True)
    (fake_quant(wt, scheme) * torch.from_numpy(g)).sum().backward()
    return wt.grad.numpy()


def test_ste_passes_the_gradient_except_where_the_code_is_clipped():
    """int4 sym: the largest-magnitude value x* maps to code -8 (d = x*/-8), so the range is
    [-8d, 7d] on the side opposite x*: there rint(x/d) = 8 clips to code 7 (x/d >= 7.5), and only
    there is the gradient 0. The scale is no function of w for the gradient (detached): x*'s own
    gradient passes too."""
    scheme = get_scheme("int4_sym_g32")
    rng = np.random.default_rng(2)
    w = rng.uniform(-0.5, 0.5, size=(2, 32)).astype(np.float32)
    w[0, 3] = 1.0     # x*: d = -0.125
    w[0, 7] = -0.99   # -0.99 / d = 7.92 -> rint 8 -> code 16, clipped to 15
    w[0, 9] = -0.93   # 7.44 -> 7: inside
    w[1, 0] = -2.0    # x* negative: d = 0.25, the range is [-2.0, 1.75]
    w[1, 5] = 1.9     # 7.6 -> 8: clipped
    g = rng.normal(size=w.shape).astype(np.float32)
    clipped = np.zeros(w.shape, bool)
    clipped[0, 7] = clipped[1, 5] = True
    np.testing.assert_array_equal(_grad(w, scheme, g), np.where(clipped, 0.0, g))

    # int8 and asym int4 on ordinary groups: [-amax, amax] and [min, max] hold every value
    for name in ("int8_g32", "int4_asym_g32"):
        np.testing.assert_array_equal(_grad(w, get_scheme(name), g), g)


def test_ste_asym_clips_what_the_fp16_min_leaves_below():
    """asym int4 clips only through the fp16 rounding of the min m: a group at 10 + [0, 0.01] has
    m = fp16(10.005) = 10.0078125 above its true min (step d = 0.01/15), so the values below
    m - d/2 get rint((x - m)/d) < 0, clipped to code 0: no gradient there, the rest passes."""
    scheme = get_scheme("int4_asym_g32")
    w = (np.float32(10.005) + np.linspace(0, 0.01, 32, dtype=np.float32))[None, :]
    d = np.float32(np.float16(np.float32(w.max() - w.min()) / np.float32(15)))
    m = np.float32(np.float16(w.min()))
    assert m == np.float32(10.0078125)
    clipped = w < m - d / 2
    assert 0 < clipped.sum() < 32 and clipped[0, 0] and not clipped[0, -1]
    g = np.random.default_rng(3).normal(size=w.shape).astype(np.float32)
    np.testing.assert_array_equal(_grad(w, scheme, g), np.where(clipped, 0.0, g))


@pytest.mark.parametrize("source", ["stories_hf", "stories_gguf"])
def test_torch_forward_equals_the_engines_logits(source, request):
    """TorchModel over the float weights (no fake quantization) gives the reference kernels' logits:
    HF pair order (stories260K-hf) and GGUF's interleaved order (stories260K-f32.gguf)."""
    from llamajet import LLM
    from llamajet.loaders import load_model

    path = request.getfixturevalue(source)
    llm = LLM(path, quantize="none", kernels="reference", max_model_len=128, kv_dtype="f32")
    model = load_model(path)
    ids = llm.tokenizer.encode("Once upon a time, there was a little girl named Lily. She liked to play. " * 3)
    ids = ids[:80]
    tm = TorchModel(model, len(ids))
    assert set(tm.interleaved.values()) == {source == "stories_gguf"}
    with torch.no_grad():
        got = tm.logits(tm.float, torch.tensor([ids]))[0].numpy()
    ref = llm.logits(ids)
    # fp32 torch vs the fp32 reference kernels (other summation orders): measured 1.3e-6 of the scale
    np.testing.assert_allclose(got, ref, atol=2e-5 * np.abs(ref).max())


@pytest.fixture(scope="module")
def stories_windows(stories_hf):
    """Windows of 128 tokens of text sampled from stories260K: 24 to train on, 8 held out."""
    from llamajet import LLM, SamplingParams
    from llamajet.loaders import load_model

    llm = LLM(stories_hf, quantize="none", max_model_len=128, kv_dtype="f32")
    outs = llm.generate(["Once upon a time"] * 32,
                        SamplingParams(max_tokens=124, temperature=1.0, seed=7, ignore_eos=True))
    windows = [(o.prompt_token_ids + o.token_ids)[:128] for o in outs]
    assert all(len(w) == 128 for w in windows)
    return load_model(stories_hf), windows[:24], windows[24:]


def test_qat_lowers_held_out_kl_and_exports_weights_rtn_reproduces(stories_windows):
    """30 steps on 24 sampled windows, scored on 8 others: the KL vs float of RTN of the trained
    weights is below RTN of the original ones; the exported weights' RTN values are the ones the
    student used (fake_quant), so the packed model's logits are the student's."""
    model, train, held_out = stories_windows
    scheme, embed = get_scheme("int4_sym_g32"), get_scheme("int8_g32")
    # one thread: the model is tiny, and a 2-thread OpenMP pool on a busy 2-core machine spins (18x slower)
    res = qat_train(model, train, scheme, steps=30, lr=2e-3, batch=4, embed_scheme=embed, seed=0, threads=1)
    assert res.steps == len(res.losses) == 30 and np.isfinite(res.losses).all()
    tm = TorchModel(model, 128)

    def packed(trained: dict) -> dict:  # the model `llamajet quantize` would write, dequantized
        w = dict(tm.float)
        w.update({n: torch.from_numpy(a) for n, a in trained.items()})
        for n in list(w):
            s = scheme if n.rsplit(".", 1)[-1] in LINEARS else embed if n in ("token_embd", "output") else None
            if s is not None:
                w[n] = torch.from_numpy(_rtn(w[n].numpy(), s).astype(np.float32))
        return w

    ids = torch.tensor(held_out)
    with torch.no_grad():
        ref = tm.logits(tm.float, ids)
        before = float(kl_div(ref, tm.logits(packed({}), ids)))
        after_w = packed(res.weights)
        after = float(kl_div(ref, tm.logits(after_w, ids)))
        student = dict(after_w)
        student.update({n: fake_quant(torch.from_numpy(a), scheme) if n.rsplit(".", 1)[-1] in LINEARS
                        else torch.from_numpy(a) for n, a in res.weights.items()})
        student_logits = tm.logits(student, ids)
    assert after < 0.5 * before, (before, after)  # measured: 0.120 -> 0.028
    for n in res.weights:
        torch.testing.assert_close(student[n], after_w[n], rtol=0, atol=0)
    torch.testing.assert_close(student_logits, tm.logits(after_w, ids), rtol=0, atol=0)


def test_quantize_method_qat_saves_rtn_of_the_trained_weights(stories_hf, stories_windows, tmp_path, monkeypatch):
    """`llamajet quantize --method qat`: the saved folder holds RTN of the weights QAT trained (the same
    training run again: seeded, same threads) and the trained norms, and maps as is."""
    from llamajet import LLM
    from llamajet.formats import convert
    from llamajet.loaders import load_model
    from llamajet.quant.calibrate import calibration_windows
    from llamajet.quant.quantize import quantize_model

    model, train, _ = stories_windows
    tok = LLM(stories_hf, max_model_len=128).tokenizer
    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(tok.decode(w[1:]) for w in train))
    s = quantize_model(stories_hf, tmp_path / "q", "int4_sym_g32", method="qat", calib=calib, calib_seqs=8,
                       calib_len=64, qat_steps=3, qat_lr=2e-3, qat_len=64, embed_scheme="int8_g32")
    assert any(k.startswith("qat") for k in s.counts)
    windows = calibration_windows(tok, calib.read_text(), 8, 64)
    res = qat_train(model, windows, get_scheme("int4_sym_g32"), steps=3, lr=2e-3, seq_len=64,
                    embed_scheme=get_scheme("int8_g32"))
    saved = load_model(tmp_path / "q").weights
    cfg = model.config
    for name, trained in res.weights.items():
        got = dequantize(saved[name]) if saved[name].packed else saved[name].to_f32()
        want = _rtn(trained, get_scheme("int4_sym_g32")) if saved[name].packed else trained
        if saved[name].rope_interleaved and not model.weights[name].rope_interleaved:
            # q / k saved in the fused [q; k; v] (formats/saved.py): rows in interleaved RoPE order
            heads = cfg.num_heads if name.endswith("attn_q") else cfg.num_kv_heads
            hd = cfg.head_dim
            want = want[np.arange(heads * hd).reshape(heads, 2, hd // 2).transpose(0, 2, 1).reshape(-1)]
        np.testing.assert_array_equal(got, want)
    assert any(not np.array_equal(res.weights[n], model.weights[n].to_f32()) for n in res.weights)

    def refuse(*a, **k):
        raise AssertionError("a saved QAT model must not be quantized again at load")

    monkeypatch.setattr(convert.ops, "quantize_packed", refuse)
    assert LLM(tmp_path / "q", max_model_len=128).logits(windows[0]).shape[0] == 64
