"""GPTQ against round-to-nearest, on a layer with correlated calibration inputs
(known answer: GPTQ minimizes ||W X^T - Ŵ X^T||, so it must beat RTN there),
and its packed output against its own dequantized values."""

from __future__ import annotations

import numpy as np
import pytest

from llamajet.formats.packed import dequantize, quantize_rtn
from llamajet.formats.schemes import get_scheme
from llamajet.quant.calibrate import Method
from llamajet.quant.gptq import gptq_quantize, pack_gptq


def _layer(n=48, k=320, t=2048, seed=0):
    rng = np.random.default_rng(seed)
    mix = rng.normal(size=(k, k)) / np.sqrt(k)          # correlated input channels ...
    scale = np.exp(rng.normal(size=k))                  # ... of very different magnitudes
    x = (rng.normal(size=(t, k)) @ mix) * scale
    w = rng.normal(size=(n, k)) * 0.05
    return w, x


@pytest.mark.parametrize("name", ["int4_sym_g128", "int4_asym_g128", "int4_asym_g32", "int8_pc"])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_on_the_layer_output(name, act_order):
    scheme = get_scheme(name)
    w, x = _layer()
    h = 2 * x.T @ x
    q, codes, d, m = gptq_quantize(w, h, scheme, act_order=act_order)
    rtn = dequantize(quantize_rtn("w", w.astype(np.float32), scheme))
    err_gptq = np.linalg.norm(x @ (w - q).T)
    err_rtn = np.linalg.norm(x @ (w - rtn).T)
    assert err_gptq < err_rtn, (err_gptq, err_rtn)  # measured: 0.76-0.80x of RTN, 0.48-0.51x with act_order
    # every value lies on the scheme's grid: packing and dequantizing gives it back exactly
    pw = pack_gptq("w", scheme, w.shape, codes, d, m)
    np.testing.assert_array_equal(dequantize(pw), q.astype(np.float32).astype(np.float64))


def test_gptq_with_an_identity_hessian_is_rtn():
    """With H = I no column informs another: GPTQ's rounding is RTN's (same scales, same codes)."""
    scheme = get_scheme("int4_sym_g32")
    w = np.random.default_rng(3).normal(size=(32, 96)).astype(np.float32)
    q, _, _, _ = gptq_quantize(w, np.eye(96), scheme, damp=0.0)
    np.testing.assert_array_equal(q, dequantize(quantize_rtn("w", w, scheme)))


def test_dead_inputs_get_zero_weight():
    """An input channel that is always 0 has no Hessian: its weights are set to 0 (any value would do;
    0 keeps the group's scale for the live ones) and the factorization stays finite."""
    scheme = get_scheme("int4_sym_g32")
    w, x = _layer(k=64, t=512)
    x[:, 5] = 0.0
    q, _, _, _ = gptq_quantize(w, 2 * x.T @ x, scheme)
    assert np.isfinite(q).all() and np.all(q[:, 5] == 0.0)


@pytest.mark.parametrize("k", [7, 256, 600, 1100])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_inverse_cholesky_factor_is_numpys(k, dtype):
    """GPTQ's U (U^T U = H^-1, upper) made from one Cholesky of the reversed H and a blocked triangular
    inverse equals numpy's float64 Cholesky of numpy's inverse, on an ill-conditioned H (input scales
    over 3 decades, condition ~1.5e3 after the damping) whose size is not a multiple of the 256-row
    inverse blocks or the 512-column Cholesky blocks (float32 runs the blocked Cholesky; 1100 is three
    blocks of it)."""
    from llamajet.quant.gptq import inverse_cholesky_upper

    rng = np.random.default_rng(11)
    x = rng.normal(size=(3 * k, k)) * np.logspace(-1.5, 1.5, k)
    h = 2 * x.T @ x
    h[np.diag_indices(k)] += 0.01 * np.mean(np.diag(h))
    u = inverse_cholesky_upper(h.astype(dtype))
    assert u.dtype == dtype and np.array_equal(u, np.triu(u))
    u = u.astype(np.float64)
    ref = np.linalg.cholesky(np.linalg.inv(h)).T
    # A factorization's error is about (condition ~1.5e3) x (unit roundoff): float64 1e-13, float32
    # 1e-4 of the largest entry (measured: float64 ~1e-16, float32 4e-8 .. 1.0e-7).
    tol = 1e-9 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(u, ref, rtol=0, atol=tol * np.abs(ref).max())
    np.testing.assert_allclose(u.T @ u @ h, np.eye(k), rtol=0, atol=1e-8 if dtype == np.float64 else 1e-4)


@pytest.fixture(scope="module")
def sampled_text(stories_hf, tmp_path_factory):
    """Stories sampled from the float model: calibration (16) and held-out evaluation (8) text."""
    from llamajet import LLM, SamplingParams

    f = LLM(stories_hf, quantize="none", kernels="reference", max_model_len=256, kv_dtype="f32")
    outs = f.generate(["Once upon a time"] * 24, SamplingParams(max_tokens=250, temperature=1.0, seed=1))
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text("\n".join(o.text for o in outs[:16]))
    evals = [e for e in (f.tokenizer.encode(o.text)[:256] for o in outs[16:]) if len(e) > 64]
    return f, path, evals


@pytest.mark.parametrize("name", ["int4_sym_g32", "int4_asym_g32"])
def test_gptq_model_beats_rtn_on_held_out_text_and_maps_as_saved(stories_hf, sampled_text, tmp_path, name,
                                                                 monkeypatch):
    """stories260K (a real float model), calibrated on 16 sampled stories, scored on 8 others: GPTQ's KL
    vs float is below RTN's (measured, act-order + scale search: KL -39% sym, -36% asym; PPL increase
    9.5% -> 5.1%, 9.9% -> 2.8%),
    and the saved folder maps as is (no quantizer runs at load)."""
    from llamajet import LLM
    from llamajet.eval.perplexity import evaluate
    from llamajet.formats import convert
    from llamajet.quant.quantize import quantize_model

    f, calib, evals = sampled_text
    quantize_model(stories_hf, tmp_path / "rtn", name)
    s = quantize_model(stories_hf, tmp_path / "gptq", name, method="gptq", calib=calib, calib_seqs=16,
                       calib_len=128, act_order=True)
    assert any(k.startswith("gptq") for k in s.counts)

    def refuse(*a, **k):
        raise AssertionError("a saved GPTQ model must not be quantized again at load")

    monkeypatch.setattr(convert.ops, "quantize_packed", refuse)
    opts = dict(kernels="a16", max_model_len=256, kv_dtype="f32")
    llms = {"float": f, "rtn": LLM(tmp_path / "rtn", **opts), "gptq": LLM(tmp_path / "gptq", **opts)}
    sc = evaluate(llms, evals, "float")
    assert sc["gptq"].kl < sc["rtn"].kl, (sc["gptq"].kl, sc["rtn"].kl)
    assert sc["gptq"].ppl < sc["rtn"].ppl


def test_gptq_calibration_file_errors(stories_hf, tmp_path):
    from llamajet.errors import LlamajetError
    from llamajet.quant.quantize import quantize_model

    # (no --calib at all is the self-written calibration: tests/test_quantize_defaults.py)
    with pytest.raises(LlamajetError, match="--calib .*no such file"):
        quantize_model(stories_hf, tmp_path / "x", "int4_sym_g32", method="gptq", calib=tmp_path / "missing.txt")
    with pytest.raises(LlamajetError, match="unknown method"):
        quantize_model(stories_hf, tmp_path / "x", "int4_sym_g32", method="awq2")
    assert not (tmp_path / "x").exists()  # refused before anything was written


class Identity(Method):
    """A method that quantizes nothing: the calibration forward stays the float model's."""

    def quantize(self, names, ws, inputs):
        return ws, {}


def test_calibration_forward_equals_the_engines_logits(smollm2_gguf):
    """The numpy forward GPTQ calibrates with (quant/calibrate.py) gives the reference kernels' logits."""
    from llamajet import LLM
    from llamajet.loaders import load_model
    from llamajet.quant import calibrate

    llm = LLM(smollm2_gguf, kernels="reference", max_model_len=128, kv_dtype="f32")
    model = load_model(smollm2_gguf)
    ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6)[:48]
    hidden: list = []
    calibrate.sequential(model, [ids], Identity(), hidden=hidden)
    w = model.weights
    h = calibrate._rmsnorm(hidden[0][0], w["output_norm"].to_f32(), model.config.rms_norm_eps)
    head = (w["output"] if "output" in w else w["token_embd"]).to_f32()
    ref = llm.logits(ids)
    # float32 numpy vs the reference kernels (fp32, another summation order): ~1e-5 of the logits' scale
    np.testing.assert_allclose(h @ head.T, ref, atol=2e-5 * np.abs(ref).max())


@pytest.mark.parametrize("name", ["int4_sym_g128", "int4_asym_g32", "int8_pc"])
def test_scale_search_is_never_worse_than_the_rtn_rule(name):
    """The search tries the plain rule (factor 1) first and keeps a row's shrunk range only when its
    rounding error is lower: per row, never worse."""
    from llamajet.quant.gptq import group_params, round_to

    scheme = get_scheme(name)
    x = np.random.default_rng(5).standard_t(3, size=(40, scheme.group_for(128)))
    err = {}
    for search in (False, True):
        d, m = group_params(x, scheme, search)
        _, q = round_to(x, d[:, None], None if m is None else m[:, None], scheme)
        err[search] = ((x - q) ** 2).sum(axis=1)
    assert np.all(err[True] <= err[False])
    if scheme.bits == 4:  # 16 levels: clipping the heavy tail pays (at 8 bits here it never does)
        assert err[True].sum() < err[False].sum()


@pytest.mark.parametrize("name", ["int4_sym_g128", "int4_asym_g32"])
def test_weighted_scale_search_minimises_the_weighted_error(name):
    """With column weights h (GPTQ's diag H), each row keeps the factor of least sum_j h_j (x_j - q_j)^2:
    never worse than the plain rule, nor than the unweighted search's choice, in that error; and the
    weights matter (columns of large h are rounded finer than the unweighted choice leaves them)."""
    from llamajet.quant.gptq import group_params, round_to

    scheme = get_scheme(name)
    rng = np.random.default_rng(6)
    g = scheme.group_for(128)
    x = rng.standard_t(3, size=(40, g))
    h = np.where(rng.random(g) < 0.1, 50.0, 1.0) * rng.uniform(0.5, 1.5, g)  # a few salient input channels
    err = {}
    for key, (search, w) in {"rule": (False, None), "plain": (True, None), "weighted": (True, h)}.items():
        d, m = group_params(x, scheme, search, w)
        _, q = round_to(x, d[:, None], None if m is None else m[:, None], scheme)
        err[key] = ((x - q) ** 2) @ h
    assert np.all(err["weighted"] <= err["rule"]) and np.all(err["weighted"] <= err["plain"])
    assert err["weighted"].sum() < err["plain"].sum()
