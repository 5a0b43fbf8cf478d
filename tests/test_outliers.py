"""Outlier channels of the W*A8 inputs (RuntimeConfig.act_outliers): the quantizers hold the
listed channels as 0 and write their values beside the codes, the matmul adds those columns'
float product; against numpy (formats/packed.py's twins, float64), on every ISA tier; the
rules at the boundary; and at model level, batch invariance and the effect on the logits."""

from __future__ import annotations

import numpy as np
import pytest

from llamajet import ops
from llamajet.formats.packed import matmul_a8_reference, quantize_activations, quantize_rtn
from llamajet.graph.passes.outliers import tile_columns

ISAS = ops.supported_isas()


def _exe(isa, nth, T):
    return ops.Executor(isa=isa, n_threads=nth, max_tokens=T, max_out=T, max_seqs=1, max_blocks=1,
                        kv_slots=16, block_size=16, max_pos=1, scratch_floats=1 << 16)


def _run(ex):
    z = np.zeros(ex.max_tokens, np.int32)
    ex.run(z, z, z, z, np.zeros((1, 1), np.int32), np.zeros(0, np.int32))


def _qact(ex, qb, M, K, G):
    kpad = -(-K // G) * G
    ng = kpad // G
    raw = ex.buffer(qb)
    qoff = -(-M * kpad // 64) * 64
    return (raw[:M * kpad].view(np.int8).reshape(M, kpad).copy(),
            raw[qoff:qoff + 4 * M * ng].view(np.float32).reshape(M, ng).copy(),
            raw[qoff + 4 * M * ng:qoff + 8 * M * ng].view(np.int32).reshape(M, ng).copy())


def _inputs(M, K, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(M, K)).astype(np.float32)
    ch = np.sort(rng.choice(K, size=5, replace=False)).astype(np.int32)
    x[:, ch] *= np.float32(40.0)  # the outliers the list is for
    return x, ch


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("nth", [1, 2])
@pytest.mark.parametrize("scheme,K", [("int4_asym_g32", 576), ("int4_sym_g32", 96), ("int8_g32", 200)])
def test_norm_quantize_and_matmul_with_outlier_channels(isa, nth, scheme, K):
    """add_rmsnorm (quantize on write, ocols) -> matmul (prequant, ow, xo) against numpy:
    qout's codes, scales and sums are the numpy twin's of the normalized rows with the listed
    channels set to 0, bit for bit; xo holds those channels' values exactly; the matmul's result
    is the int8 path's (float64 reference) plus W[:, ch] (in fp16, as stored) times xo, to fp32
    accumulation error. M = 7: a GEMM block, the 4-row block and single rows; N = 40: a padded
    last tile."""
    M, N, G = 7, 40, 32
    x, ch = _inputs(M, K, K + nth)
    k = len(ch)
    rng = np.random.default_rng(3)
    nw = rng.uniform(0.5, 1.5, size=K).astype(np.float32)
    pw = quantize_rtn("w", rng.normal(size=(N, K)).astype(np.float32), scheme)
    wdeq = pw.to_f32()
    ow = tile_columns(wdeq[:, ch])
    kpad = -(-K // G) * G
    ex = _exe(isa, nth, M)
    xb, hb, qb = ex.alloc_buffer(4 * M * K), ex.alloc_buffer(4 * M * K), ex.alloc_buffer(ops.tensor_bytes("q8_act", M, K, G))
    xob, ob = ex.alloc_buffer(4 * M * k), ex.alloc_buffer(4 * M * N)
    ex.buffer(xb).view(np.float32)[:] = x.ravel()
    ex.buffer(ob).view(np.float32)[:] = np.nan
    xo = ops.Ref.in_buffer(xob, 0, ops.DType.F32, ops.ROWS_TOKENS, k)
    p = ops.OPS["add_rmsnorm"]()
    p.x = ops.Ref.in_buffer(xb, 0, ops.DType.F32, ops.ROWS_TOKENS, K)
    p.w = ops.Ref.from_array(nw, ops.DType.F32, 1, K)
    p.out = ops.Ref.in_buffer(hb, 0, ops.DType.F32, ops.ROWS_TOKENS, K)
    p.qout = ops.Ref.in_buffer(qb, 0, ops.DType.Q8_ACT, ops.ROWS_TOKENS, K, G)
    p.ocols = ops.Ref.from_array(ch, ops.DType.I32, 1, k)
    p.xo = xo
    p.eps = 1e-5
    ex.add(p)
    m = ops.OPS["matmul"]()
    m.qin = ops.Ref.in_buffer(qb, 0, ops.DType.Q8_ACT, ops.ROWS_TOKENS, K, G)
    m.prologue = ops.Prologue.PREQUANT
    m.w = ops.Ref.from_array(pw.data, ops.dtype(pw.dtype), N, K, pw.group)
    m.ow = ops.Ref.from_array(ow, ops.DType.F16, ow.shape[0], ops.TILE)
    m.xo = xo
    m.out = ops.Ref.in_buffer(ob, 0, ops.DType.F32, ops.ROWS_TOKENS, N)
    ex.add(m)
    _run(ex)
    h = ex.buffer(hb).view(np.float32).reshape(M, K).copy()  # out: the whole normalized rows
    h0 = h.copy()
    h0[:, ch] = 0.0
    q, dx, sq = _qact(ex, qb, M, K, G)
    wq, wdx, wsq = quantize_activations(h0, G, kpad)
    np.testing.assert_array_equal(q, wq)
    np.testing.assert_array_equal(dx.view(np.uint32), wdx.view(np.uint32))
    np.testing.assert_array_equal(sq, wsq)
    np.testing.assert_array_equal(ex.buffer(xob).view(np.float32).reshape(M, k), h[:, ch])
    out = ex.buffer(ob).view(np.float32).reshape(M, N)
    ref = matmul_a8_reference(h0, pw) + h[:, ch].astype(np.float64) @ \
        wdeq[:, ch].astype(np.float16).astype(np.float64).T
    # fp32 sums of ~K/G group products and k outlier products, each rounded once: a few ulps of the
    # terms' magnitudes
    scale = np.abs(matmul_a8_reference(np.abs(h0), pw)).max() + np.abs(h[:, ch]).sum(1).max() * np.abs(wdeq).max()
    np.testing.assert_allclose(out, ref, rtol=0, atol=scale * 64 * 2.0**-24)
    # and the product they stand for: the float matmul over the same (fp16-column) weights
    assert np.abs(out - h.astype(np.float64) @ wdeq.astype(np.float64).T).max() < \
        np.abs(matmul_a8_reference(h, pw) - h.astype(np.float64) @ wdeq.astype(np.float64).T).max()


@pytest.mark.parametrize("isa", ISAS)
def test_quantize_op_with_outlier_channels_split_over_threads(isa):
    """The quantize op splits each row's groups between threads: every listed channel lies in one
    thread's groups, which writes its value; same bits as numpy on 1-3 threads."""
    M, K, G = 5, 1536, 32
    x, ch = _inputs(M, K, 7)
    ch = np.concatenate([ch, [0, K - 1]]).astype(np.int32)
    ch.sort()
    x0 = x.copy()
    x0[:, ch] = 0.0
    wq, wdx, wsq = quantize_activations(x0, G, K)
    for nth in (1, 2, 3):
        ex = _exe(isa, nth, M)
        xb, qb = ex.alloc_buffer(4 * M * K), ex.alloc_buffer(ops.tensor_bytes("q8_act", M, K, G))
        xob = ex.alloc_buffer(4 * M * len(ch))
        ex.buffer(xb).view(np.float32)[:] = x.ravel()
        ex.buffer(xob).view(np.float32)[:] = np.nan
        p = ops.OPS["quantize"]()
        p.x = ops.Ref.in_buffer(xb, 0, ops.DType.F32, ops.ROWS_TOKENS, K)
        p.out = ops.Ref.in_buffer(qb, 0, ops.DType.Q8_ACT, ops.ROWS_TOKENS, K, G)
        p.ocols = ops.Ref.from_array(ch, ops.DType.I32, 1, len(ch))
        p.xo = ops.Ref.in_buffer(xob, 0, ops.DType.F32, ops.ROWS_TOKENS, len(ch))
        ex.add(p)
        _run(ex)
        q, dx, sq = _qact(ex, qb, M, K, G)
        np.testing.assert_array_equal(q, wq)
        np.testing.assert_array_equal(dx.view(np.uint32), wdx.view(np.uint32))
        np.testing.assert_array_equal(sq, wsq)
        np.testing.assert_array_equal(ex.buffer(xob).view(np.float32).reshape(M, len(ch)), x[:, ch])


def test_outlier_operands_are_checked_at_the_boundary():
    M, K, G = 2, 64, 32
    ex = _exe("ref", 1, M)
    xb, qb = ex.alloc_buffer(4 * M * K), ex.alloc_buffer(ops.tensor_bytes("q8_act", M, K, G))
    xob = ex.alloc_buffer(4 * M * 4)

    def quant(cols, xo_cols=None):
        p = ops.OPS["quantize"]()
        p.x = ops.Ref.in_buffer(xb, 0, ops.DType.F32, ops.ROWS_TOKENS, K)
        p.out = ops.Ref.in_buffer(qb, 0, ops.DType.Q8_ACT, ops.ROWS_TOKENS, K, G)
        c = np.asarray(cols, np.int32)
        p.ocols = ops.Ref.from_array(c, ops.DType.I32, 1, len(c))
        p.xo = ops.Ref.in_buffer(xob, 0, ops.DType.F32, ops.ROWS_TOKENS, xo_cols or len(c))
        return p

    for cols, why in (([3, 1], "ascending"), ([1, 1], "ascending"), ([2, 64], "ascending"), ([-1, 2], "ascending")):
        with pytest.raises(ValueError, match=why):
            ex.add(quant(cols))
    with pytest.raises(ValueError, match="xo"):
        ex.add(quant([1, 2], xo_cols=3))
    p = quant([1, 2])
    p.xo = ops.Ref()
    with pytest.raises(ValueError, match="together"):
        ex.add(p)
    # the matmul side: ow needs xo, the prequant prologue, and one [k][16] block per tile
    pw = quantize_rtn("w", np.ones((16, K), np.float32), "int4_sym_g32")
    ow = np.zeros((2 * 16, 16), np.float16)

    def mm(**kw):
        m = ops.OPS["matmul"]()
        m.w = ops.Ref.from_array(pw.data, ops.dtype(pw.dtype), 16, K, pw.group)
        m.out = ops.Ref.in_buffer(xb, 0, ops.DType.F32, ops.ROWS_TOKENS, 16)
        m.qin = ops.Ref.in_buffer(qb, 0, ops.DType.Q8_ACT, ops.ROWS_TOKENS, K, G)
        m.prologue = ops.Prologue.PREQUANT
        m.ow = ops.Ref.from_array(ow, ops.DType.F16, 2, 16)
        m.xo = ops.Ref.in_buffer(xob, 0, ops.DType.F32, ops.ROWS_TOKENS, 2)
        for k, v in kw.items():
            setattr(m, k, v)
        return m

    ex.add(mm())  # consistent: accepted
    with pytest.raises(ValueError, match="ow is"):
        ex.add(mm(ow=ops.Ref.from_array(ow, ops.DType.F16, 3, 16)))
    with pytest.raises(ValueError, match="together"):
        ex.add(mm(xo=ops.Ref()))
    with pytest.raises(ValueError, match="prequant"):
        ex.add(mm(qin=ops.Ref(), prologue=ops.Prologue.NONE, x=ops.Ref.in_buffer(xb, 0, ops.DType.F32, ops.ROWS_TOKENS, K)))


# ---------------------------------------------------------------- the default model

from pathlib import Path  # noqa: E402

from chat_prompts import PROMPTS  # noqa: E402

from llamajet import LLM, SamplingParams  # noqa: E402
from llamajet.config import DEFAULT_ACT_OUTLIERS  # noqa: E402
from llamajet.engine.sampling import log_softmax  # noqa: E402

WIKITEXT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "corpora" / "wikitext-2-raw-test.txt"


@pytest.fixture(scope="module")
def three(smollm2_gguf):
    kw = dict(max_model_len=640, n_threads=2)
    return {"float": LLM(smollm2_gguf, kernels="reference", **kw), "a16": LLM(smollm2_gguf, kernels="a16", **kw),
            "k0": LLM(smollm2_gguf, act_outliers=0, **kw), "default": LLM(smollm2_gguf, **kw)}


def test_default_has_outlier_channels_on_every_rewritable_input(three):
    """Every norm output, every down-projection input and the head's input (91 on SmolLM2's 30
    layers): DEFAULT_ACT_OUTLIERS channels each; the attention output (quantized inside attention)
    has none."""
    log = [l for l in three["default"].engine.runner.fusion_log if l.startswith("outliers:")]
    cfg = three["default"].config
    assert len(log) == 3 * cfg.num_layers + 1
    assert all(f": {DEFAULT_ACT_OUTLIERS} channels" in l for l in log)
    assert not any("attn_output" in l for l in log)
    assert not [l for l in three["k0"].engine.runner.fusion_log if l.startswith("outliers:")]


def test_outlier_channels_bring_the_default_path_closer_to_float(three):
    """KL of the next-token distributions vs the float weights-and-activations (the reference
    kernels, checked against HF in test_model_vs_hf) on 511 WikiText-2 positions: the outlier
    channels remove most of the int8 activations' error (measured 3.1e-3 -> 9.0e-4 here, and
    3.4e-3 -> 9.5e-4 over 6 windows, benchmarks/default_path.py): at least half of it, and under
    1.5e-3 (the 1.1e-3 target is met on 20 windows in the benchmark; one window scatters more).
    The float-activation kernels are the floor: their KL is rounding only (2e-7)."""
    if not WIKITEXT.is_file():
        pytest.skip("WikiText-2 not present (../shared/data)")
    ids = three["float"].tokenizer.encode(WIKITEXT.read_text(encoding="utf-8")[:4000])[:512]
    ref = log_softmax(three["float"].logits(ids).astype(np.float64))
    kl = {n: float((np.exp(ref) * (ref - log_softmax(three[n].logits(ids).astype(np.float64)))).sum(-1).mean())
          for n in ("a16", "k0", "default")}
    assert kl["default"] < 0.5 * kl["k0"], kl
    assert kl["default"] < 1.5e-3 and kl["a16"] < 1e-5, kl


def test_batch_invariance_with_outlier_channels(three):
    """A sequence's greedy ids are the same alone and in a batch (the channels are per weight,
    the float product per row), and a prefill's logits rows equal one-token decode steps'."""
    llm = three["default"]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [llm.chat_ids([{"role": "user", "content": p}]) for p in PROMPTS[:6]]
    alone = [llm.generate([p], sp)[0].token_ids for p in prompts]
    together = [o.token_ids for o in llm.generate(prompts, sp)]
    assert alone == together
    ids = prompts[0]
    full = llm.logits(ids)
    llm.engine.blocks.reset_cache()
    r = llm.engine.runner
    from llamajet.engine.runner import StepBatch
    bt = np.arange(r.max_blocks, dtype=np.int32)[None]
    for i in range(len(ids)):
        p = np.array([i], np.int32)
        row = r.execute(StepBatch(np.array([ids[i]], np.int32), p, p.copy(), np.zeros(1, np.int32), bt,
                                  np.zeros(1, np.int32)))[0]
        np.testing.assert_array_equal(row, full[i])
    llm.engine.blocks.reset_cache()  # the steps above wrote blocks the block manager did not hand out


def test_chat_replies_match_the_float_activation_path(three):
    """The issue's bar: on 20 varied chat prompts, greedy replies equal the float-activation
    path's (kernels='a16', the same weights) for 32 tokens in at least 15 (measured 16; without
    outlier channels 9)."""
    sp = SamplingParams(max_tokens=32, temperature=0)
    out = {}
    for n in ("a16", "default"):
        ids = [three[n].chat_ids([{"role": "user", "content": p}]) for p in PROMPTS]
        out[n] = [o.token_ids for o in three[n].generate(ids, sp)]
    same = sum(a == b for a, b in zip(out["a16"], out["default"]))
    assert same >= 15, same


def test_weight_columns_from_the_kernels_are_the_weights_values(three):
    """kernel_columns (a float-activation matmul with one-hot rows, what the load uses) gives
    W[:, cols] bit for bit as the weights' float copy does, on every packed matrix the default
    graph runs (stacked q/k/v, tile-interleaved gate/up, down, the tied head)."""
    from llamajet.engine.outliers import kernel_columns
    from llamajet.graph.passes.outliers import weight_columns

    cols = kernel_columns(ops.resolve_isa(None), 2)
    seen = 0
    for w in three["default"].engine.runner.graph.weights.values():
        if w.packed:
            c = np.array([0, 7, w.shape[1] // 2, w.shape[1] - 1])
            np.testing.assert_array_equal(cols(w, c), weight_columns(w, c))
            seen += 1
    assert seen >= 3 * three["default"].config.num_layers + 1


# ---------------------------------------------------------------- the probe's memo (engine/outliers.py)

def _channels(llm) -> dict:
    """The outlier channels and tiled columns a load wired in, by weight name."""
    return {n: np.asarray(w.data) for n, w in llm.engine.runner.graph.weights.items()
            if n.endswith((".ocols", ".ow"))}


def test_a_second_load_takes_the_probes_maxima_from_the_memo(three, smollm2_gguf, monkeypatch):
    """A load that probes the same graph (the same weights, bit for bit) with the same ids again gets
    the maxima of the first probe instead of running it: the channels and columns, and so every
    logit, equal those of a load that probed (the memo emptied first), and those of the module's
    default load (which may itself have come from an earlier module's probe)."""
    from llamajet.engine import outliers

    monkeypatch.setattr(outliers, "_MEMO", type(outliers._MEMO)())
    kw = dict(max_model_len=640, n_threads=2)
    runs = outliers.PROBES_RUN[0]
    probed = LLM(smollm2_gguf, **kw)
    assert outliers.PROBES_RUN[0] == runs + 1
    again = LLM(smollm2_gguf, **kw)
    assert outliers.PROBES_RUN[0] == runs + 1
    want = _channels(probed)
    assert len(want) > 3 * probed.config.num_layers  # an ocols per input, an ow per reader
    for other in (again, three["default"]):
        got = _channels(other)
        assert got.keys() == want.keys()
        for n in want:
            np.testing.assert_array_equal(got[n], want[n])
    ids = probed.tokenizer.encode("The memo must not change a single logit.")
    np.testing.assert_array_equal(again.logits(ids), probed.logits(ids))


def test_the_memo_misses_on_any_changed_input(stories_hf, monkeypatch):
    """The memo's key holds the probe graph, every weight's bytes, the ids and the executor's
    settings: a graph with one weight byte changed, or other ids, is probed again."""
    import dataclasses

    from llamajet.config import RuntimeConfig
    from llamajet.engine import outliers, runner
    from llamajet.loaders import load_model

    seen = {}

    def spy(graph, ids, **kw):
        seen.update(graph=graph, ids=ids, kw=kw)
        return real(graph, ids, **kw)

    real = outliers.input_absmax
    monkeypatch.setattr(outliers, "_MEMO", type(outliers._MEMO)())
    monkeypatch.setattr(runner.find_outliers, "input_absmax", spy)
    model = load_model(stories_hf)
    runner.compile_graph(model, RuntimeConfig(max_model_len=64).for_model(model.config))
    g, ids, kw = seen["graph"], seen["ids"], seen["kw"]
    first = real(g, ids, **kw)
    assert first and outliers.PROBES_RUN[0] > 0
    runs = outliers.PROBES_RUN[0]
    hit = real(g, ids, **kw)
    assert outliers.PROBES_RUN[0] == runs
    assert hit.keys() == first.keys() and all(np.array_equal(hit[n], first[n]) for n in first)
    real(g, ids[:-1], **kw)  # other ids
    assert outliers.PROBES_RUN[0] == runs + 1
    name = next(n for n in g.weights if n.endswith(".attn_qkv"))  # read by the probe (the LM head is not)
    w = g.weights[name]
    data = w.data.copy()
    data.reshape(-1).view(np.uint8)[len(data.reshape(-1).view(np.uint8)) // 2] ^= 1
    g.weights[name] = dataclasses.replace(w, data=data)
    real(g, ids, **kw)
    assert outliers.PROBES_RUN[0] == runs + 2


def test_the_probe_reads_no_table_row_past_its_tokens(stories_hf, monkeypatch):
    """Why the memo's key holds only the first T rows of the RoPE tables and not max_pos (the
    context): the maxima are bit-equal when the same model is probed with tables of 64 and of 512
    positions (stories260K's limit), each probe run (the memo emptied in between); with the memo kept, another context is
    a hit; and ids longer than max_pos still reach the step, which refuses them."""
    from llamajet.config import RuntimeConfig
    from llamajet.engine import outliers, runner
    from llamajet.loaders import load_model

    seen = []
    real = outliers.input_absmax

    def spy(graph, ids, **kw):
        out = real(graph, ids, **kw)
        seen.append((graph, ids, kw, out))
        return out

    monkeypatch.setattr(runner.find_outliers, "input_absmax", spy)
    model = load_model(stories_hf)

    def load(ctx):
        runner.compile_graph(model, RuntimeConfig(max_model_len=ctx).for_model(model.config),
                             probe_ids=list(range(3, 67)))
        return seen[-1]

    runs = outliers.PROBES_RUN[0]
    for ctx in (64, 512):
        monkeypatch.setattr(outliers, "_MEMO", type(outliers._MEMO)())
        load(ctx)
    assert outliers.PROBES_RUN[0] == runs + 2
    (g64, ids, kw64, a), (_, _, kw512, b) = seen
    assert (kw64["max_pos"], kw512["max_pos"]) == (64, 512) and a and a.keys() == b.keys()
    for n in a:
        np.testing.assert_array_equal(a[n], b[n])
    c = load(256)[3]  # the memo holds the 512-position probe's maxima
    assert outliers.PROBES_RUN[0] == runs + 2
    assert c.keys() == a.keys() and all(np.array_equal(c[n], a[n]) for n in a)
    with pytest.raises(ValueError, match="position"):
        real(g64, list(range(3, 80)), **kw64)  # 77 positions, max_pos 64
