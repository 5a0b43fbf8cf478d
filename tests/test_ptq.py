"""AWQ, SmoothQuant, bias correction and the per-layer report, with known
answers: searches that include "do nothing" are never worse than doing
nothing, a smoothing folded into the model leaves the float model's outputs
unchanged, a bias correction cancels the mean output shift on its data, and
every method's saved folder runs exactly the model its calibration pass
measured."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llamajet.formats.packed import rtn_dequant
from llamajet.formats.schemes import get_scheme
from llamajet.quant.awq import ALPHAS, awq_scales, clip_search
from llamajet.quant.calibrate import Inputs, output_error
from llamajet.quant.smoothquant import smooth_scales, w8a8_error


def _outlier_layer(n=64, k=256, t=4096, seed=0):
    """Inputs with a few channels 30x the others (what LLM activations look like) and small weights."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(t, k)).astype(np.float32)
    x[:, rng.choice(k, 6, replace=False)] *= 30.0
    w = (rng.normal(size=(n, k)) * 0.05).astype(np.float32)
    return w, x


@pytest.mark.parametrize("name", ["int4_sym_g128", "int4_asym_g64", "int8_pc"])
def test_awq_search_is_never_worse_than_no_scaling(name):
    scheme = get_scheme(name)
    w, x = _outlier_layer()
    inputs = Inputs(x)
    s, alpha, tried = awq_scales([w], inputs, scheme)
    assert tried[0][0] == 0.0  # α = 0 (s = 1) is one of the candidates
    assert alpha == min(tried, key=lambda t: t[1])[0] and len(tried) <= 13  # the coarse grid and 2 neighbours
    _, alpha_full, tried_full = awq_scales([w], inputs, scheme, coarse=False)
    assert len(tried_full) == len(ALPHAS)
    # the coarse search lands on the full grid's α or a neighbour of it, never on a worse error than
    # the coarse grid's best point (measured on this layer: the same α)
    assert abs(alpha - alpha_full) <= ALPHAS[1] + 1e-12
    assert min(e for _, e in tried) <= min(e for a, e in tried_full if round(a * 20) % 2 == 0)
    unscaled = output_error(w.astype(np.float64) - rtn_dequant(w, scheme), inputs.gram)
    np.testing.assert_allclose(tried[0][1], unscaled, rtol=1e-4)  # float32 traces in the search
    chosen = output_error(w - rtn_dequant((w * s).astype(np.float32), scheme) / s, inputs.gram)
    assert chosen <= unscaled * (1 + 1e-4)
    if scheme.bits == 4:  # measured on this layer: the output error drops to 0.5-0.7x at α ≈ 0.5
        assert alpha > 0 and chosen < 0.9 * unscaled, (alpha, chosen / unscaled)


@pytest.mark.parametrize("name", ["int4_sym_g128", "int4_asym_g64"])
def test_duo_scaling_is_searched_beside_plain_scaling_and_never_worse(name):
    """AWQ.smooth searches s = x^α and AutoAWQ's duo family s = x^α / w^(1-α) (w: weight_magnitude) and
    keeps whichever reaches the lower output error: never worse than the plain search (hence than s = 1)."""
    from llamajet.quant.awq import AWQ, weight_magnitude

    scheme = get_scheme(name)
    w, x = _outlier_layer()
    w[:, :8] *= 6.0  # a few channels with large weights: the duo statistic differs from x alone
    inputs = Inputs(x)
    wm = weight_magnitude(w, scheme)
    g = scheme.group_for(w.shape[1])
    grp = np.abs(w).reshape(len(w), -1, g).max(-1, keepdims=True)
    np.testing.assert_allclose(wm, (np.abs(w).reshape(len(w), -1, g) / grp).reshape(len(w), -1).mean(0), rtol=1e-6)
    _, _, plain = awq_scales([w], inputs, scheme)
    _, _, duo = awq_scales([w], inputs, scheme, duo=True)
    m = AWQ(scheme, {}, duo=True)
    s = m.smooth(["w"], [w], inputs)
    best = min(e for _, e in plain + duo)
    chosen = output_error(w - rtn_dequant((w * s).astype(np.float32), scheme) / s, inputs.gram)
    np.testing.assert_allclose(chosen, best, rtol=1e-3)  # float32 traces in the search, float64 here
    assert m.duo_chosen["w"] == (min(e for _, e in duo) < min(e for _, e in plain))


@pytest.mark.parametrize("name,k", [("int4_sym_g128", 256), ("int4_asym_g128", 200), ("int8_g32", 200)])
def test_clip_search_is_rtn_without_shrinking_and_never_worse_with_it(name, k):
    scheme = get_scheme(name)
    w, x = _outlier_layer(k=k)
    g = Inputs(x).gram
    *_, q = clip_search(w, g, scheme, clips=[1.0])
    np.testing.assert_array_equal(q, rtn_dequant(w, scheme))  # padding of a partial group as the packing's
    *_, q2 = clip_search(w, g, scheme)
    gs = scheme.group_for(k)
    for i in range(0, k, gs):  # per row and group, on that group's share of the output error
        sl = slice(i, min(i + gs, k))
        e1 = np.einsum("nk,nk->n", (w[:, sl] - q[:, sl]) @ g[sl, sl], w[:, sl] - q[:, sl])
        e2 = np.einsum("nk,nk->n", (w[:, sl] - q2[:, sl]) @ g[sl, sl], w[:, sl] - q2[:, sl])
        assert np.all(e2 <= e1 * (1 + 1e-5))


@pytest.mark.parametrize("k,g", [(256, 128), (200, 64), (96, 32)])
def test_gram_blocks_are_the_diagonal_blocks_of_2xtx(k, g):
    """Inputs.gram_blocks against numpy float64 2 XᵀX: computed alone, sliced from an existing Gram, and
    for divided inputs (x / s, whose Gram is G / s sᵀ); a partial last group is zero-padded."""
    _, x = _outlier_layer(k=k, t=2048)
    s = np.random.default_rng(3).uniform(0.5, 2.0, k)
    for inputs, xr in ((Inputs(x), x.astype(np.float64)), (Inputs(x).divided(s), x / s)):
        ref = 2.0 * xr.T @ xr
        alone = inputs.gram_blocks(g)  # before the Gram exists: computed block by block
        assert inputs._gram is None  # gram_blocks did not make the whole Gram
        sliced = inputs.gram_blocks(g) if inputs.gram is not None else None  # now sliced from the Gram
        for blocks in (alone, sliced):
            assert blocks.shape == (-(-k // g), g, g)
            for i in range(blocks.shape[0]):
                c = slice(i * g, min((i + 1) * g, k))
                n = c.stop - c.start
                # float32 products of 2,048 rows: relative error ~1e-6 of the block's scale
                np.testing.assert_allclose(blocks[i, :n, :n], ref[c, c], rtol=1e-4, atol=1e-5 * np.abs(ref).max())
                assert not blocks[i, n:].any() and not blocks[i, :, n:].any()
    w, _ = _outlier_layer(k=k, t=8)
    inputs, scheme = Inputs(x), get_scheme(f"int4_sym_g{g}")
    # the clipping search reads only these blocks: the same result from them as from the whole Gram
    whole = clip_search(w, inputs.gram, scheme)
    for a, b in zip(clip_search(w, inputs.gram_blocks(g), scheme), whole):
        np.testing.assert_array_equal(a, b)


def test_smoothquant_keeps_the_float_product_and_lowers_the_w8a8_error():
    w, x = _outlier_layer()
    scheme = get_scheme("int8_pc")
    s = smooth_scales([w], Inputs(x), 0.5)
    # before quantization the product is the same (up to float32 rounding of the scaled operands)
    np.testing.assert_allclose((x / s) @ (w * s).T, x @ w.T, rtol=1e-4, atol=1e-4 * np.abs(x @ w.T).max())
    plain, smoothed = w8a8_error(w, x, scheme), w8a8_error((w * s).astype(np.float32), (x / s).astype(np.float32), scheme)
    assert smoothed < 0.5 * plain, (smoothed, plain)  # measured: 0.06x; per-token rounding hurt by 30x channels


def test_bias_correction_cancels_the_mean_output_shift():
    """b = (W - Ŵ) E[x]: on the calibration inputs, mean(x Wᵀ) - mean(x Ŵᵀ + b) = 0."""
    w, x = _outlier_layer()
    from llamajet.quant.bias_correction import corrected_bias

    wq = rtn_dequant(w, get_scheme("int4_sym_g128"))
    b = corrected_bias(None, w, wq, Inputs(x).mean).astype(np.float64)
    shift = (x.astype(np.float64) @ w.T - x @ wq.T).mean(0)
    assert np.abs(shift).max() > 1e-3  # there is a shift to cancel (the outlier channels' mean is not 0)
    np.testing.assert_allclose(shift - b, 0.0, atol=1e-6 * np.abs(x @ w.T).max())  # b is float32


class _Recorder:
    """Wraps a method and keeps each group's inputs and results (to check what sequential folds)."""

    def __init__(self, inner):
        self.inner, self.smooths, self.seen = inner, inner.smooths, {}

    def smooth(self, names, ws, inputs):
        return self.inner.smooth(names, ws, inputs)

    def quantize(self, names, ws, inputs):
        deq, packed = self.inner.quantize(names, ws, inputs)
        for n, w, q in zip(names, ws, deq):
            self.seen[n] = (np.asarray(w, np.float64), np.asarray(q, np.float64), inputs)
        return deq, packed


@pytest.fixture(scope="module")
def stories(stories_hf):
    from llamajet import LLM
    from llamajet.loaders import load_model
    from llamajet.quant.calibrate import calibration_windows

    tok = LLM(stories_hf, max_model_len=128).tokenizer
    text = " ".join(["Once upon a time there was a little girl named Lily. She loved to play outside in the sun.",
                     "One day, a big dog came to the park and barked at the birds. Tom was scared and ran home."] * 40)
    return load_model(stories_hf), calibration_windows(tok, text, 6, 96)


def test_smoothing_folded_into_the_model_leaves_its_outputs_unchanged(stories):
    """SmoothQuant's scales folded into the RMSNorms and up's rows, nothing quantized: the last layer's
    hidden states equal the unsmoothed forward's (float32 rounding only)."""
    from llamajet.quant import calibrate
    from llamajet.quant.smoothquant import SmoothQuant

    class SmoothOnly(SmoothQuant):
        def quantize(self, names, ws, inputs):
            return ws, {}

    model, windows = stories
    plain, smoothed = [], []
    calibrate.sequential(model, windows, SmoothOnly(get_scheme("int8_pc"), model.weights, alphas=()), hidden=plain)
    m = SmoothOnly(get_scheme("int8_pc"), model.weights, alphas=(0.5,))
    m.smooth = lambda names, ws, inputs: smooth_scales(ws, inputs, 0.5)  # always smooth, whatever the error
    res = calibrate.sequential(model, windows, m, hidden=smoothed)
    assert len(res.cols) == 7 * model.config.num_layers - model.config.num_layers  # all but attn_output
    assert any(np.ptp(s) > 1.0 for s in res.cols.values())  # the scales are far from 1
    np.testing.assert_allclose(smoothed[0], plain[0], atol=1e-4 * np.abs(plain[0]).max())


def test_bias_correction_in_the_model_cancels_each_matrix_shift(stories):
    from llamajet.quant import calibrate
    from llamajet.quant.rtn import RTN

    model, windows = stories
    rec = _Recorder(RTN(get_scheme("int4_sym_g32"), model.weights))
    res = calibrate.sequential(model, windows, rec, bias_correction=True)
    assert len([n for n in res.floats if n.endswith(".bias")]) == 7 * model.config.num_layers
    for name, (w, q, inputs) in rec.seen.items():
        shift = (inputs.x.astype(np.float64) @ (w - q).T).mean(0)  # E[Wx] - E[Ŵx] on its inputs
        np.testing.assert_allclose(res.floats[name + ".bias"], shift, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("method,scheme,bc", [("rtn", "int4_sym_g32", True), ("gptq", "int4_asym_g32", True),
                                               ("awq", "int4_sym_g32", False), ("awq-gptq", "int4_sym_g32", False),
                                               ("smoothquant", "int8_pc", False)])
def test_each_methods_saved_model_runs_what_its_calibration_measured(stories_hf, stories, tmp_path, method, scheme, bc):
    """The saved folder (embedding kept float, so the only difference is the decoder) gives, with the
    reference kernels, the logits of the calibration pass's own forward over the quantized matrices,
    folded norms and bias corrections."""
    from llamajet import LLM
    from llamajet.quant import calibrate
    from llamajet.quant.quantize import _method, quantize_model

    model, windows = stories
    calib = tmp_path / "calib.txt"
    from llamajet import LLM as _L
    calib.write_text(_L(stories_hf, max_model_len=128).tokenizer.decode([t for w in windows for t in w[1:]]))
    quantize_model(stories_hf, tmp_path / "q", scheme, method=method, calib=calib, calib_seqs=6, calib_len=96,
                   embed_scheme="keep", bias_correction=bc)
    hidden: list = []
    wins = calibrate.calibration_windows(_L(stories_hf, max_model_len=128).tokenizer, calib.read_text(), 6, 96)
    # act-order on, as quantize_model's default
    calibrate.sequential(model, wins, _method(method, get_scheme(scheme), model, True, True), hidden=hidden,
                         bias_correction=bc)
    w = model.weights
    h = calibrate._rmsnorm(hidden[0][0], w["output_norm"].to_f32(), model.config.rms_norm_eps)
    want = h @ (w["output"] if "output" in w else w["token_embd"]).to_f32().T
    got = LLM(tmp_path / "q", kernels="reference", max_model_len=128, kv_dtype="f32").logits(wins[0])
    np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max())  # fp32, two summation orders
    meta = json.loads((tmp_path / "q" / "llamajet.json").read_text())
    assert meta["config"]["attention_bias"] is bc and meta["config"]["mlp_bias"] is bc
    assert ("smoothing" in meta) is (method in ("awq", "awq-gptq", "smoothquant"))


def test_quantize_and_eval_reports(stories_hf, stories, tmp_path, capsys):
    """--report: one record per decoder matrix, GPTQ's output SQNR above RTN's (what GPTQ minimizes),
    plots written; eval's report gives a scheme's weight SQNR as computed here from RTN."""
    from llamajet.cli import main
    from llamajet.loaders import load_model
    from llamajet.quant.quantize import quantize_model

    model, windows = stories
    calib = tmp_path / "calib.txt"
    from llamajet import LLM
    tok = LLM(stories_hf, max_model_len=128).tokenizer
    calib.write_text(tok.decode([t for w in windows for t in w[1:]]))
    quantize_model(stories_hf, tmp_path / "g", "int4_sym_g32", method="gptq", calib=calib, calib_seqs=6,
                   calib_len=96, act_order=True, report=tmp_path / "rep")
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    layers = rep["layers"]
    assert len(layers) == 7 * model.config.num_layers
    gain = np.median([r["output_sqnr_db"] - r["rtn_output_sqnr_db"] for r in layers])
    assert gain > 0.5, gain  # measured: +2 to +3 dB
    for png in ("output_sqnr.png", "weight_sqnr.png"):
        assert (tmp_path / "rep" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "rep" / "report.md").read_text()
    worst = min(layers, key=lambda r: r["output_sqnr_db"])["name"]
    assert worst in md.split("## Every matrix")[0]  # the most sensitive matrix is named first

    assert main(["eval", "-m", str(stories_hf), "--text", str(calib), "--ctx", "96", "--windows", "2",
                 "--scheme", "int4_sym_g32", "--saved", str(tmp_path / "g"), "--report", str(tmp_path / "er")]) == 0
    er = json.loads((tmp_path / "er" / "report.json").read_text())
    row = next(r for r in er["layers"]["int4_sym_g32"] if r["name"] == "blk.1.ffn_down")
    wd = load_model(stories_hf).weights["blk.1.ffn_down"].to_f32().astype(np.float32)
    dw = wd.astype(np.float64) - rtn_dequant(wd, get_scheme("int4_sym_g32"))
    np.testing.assert_allclose(row["weight_sqnr_db"], 10 * np.log10((wd.astype(np.float64) ** 2).sum() / (dw ** 2).sum()),
                               rtol=1e-9)
    assert set(er["layers"]) == {"default", "int4_sym_g32", "g"}
