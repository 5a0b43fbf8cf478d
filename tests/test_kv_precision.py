"""KV cache precision: fp32, fp16, bf16 and int8 (per token-head scale).

Kernel level, every ISA and 1/2 threads:
* kv_write stores exactly what an independent conversion gives: numpy's
  float16 cast (IEEE round to nearest even, subnormals, overflow to inf),
  torch's bfloat16 cast (round to nearest even), and for int8 the rule
  scale = max|x| / 127, q = rint(x * (127 / max|x|)) in fp32 — bit exact,
  since each is one correctly rounded fp32 operation per value.
* attention over such pools equals the float64 reference run on the
  *dequantized* K/V within the fp32 attention bound of test_kernels.py: the
  kernel reads stored values exactly (fp16/bf16 -> fp32 is exact; an int8
  code times its scale is folded into the dot product's final multiply, one
  more rounding, which the bound's +2 already counts).

Model level (stories260K, fp32 weights, so the KV cache is the only thing
that changes): the KL divergence of next-token distributions on WikiText-2
against the fp32 cache must stay within bounds that follow from each format's
precision, and in the order of that precision.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from llamajet import LLM, RequestError, SamplingParams, ops
from llamajet.graph.lower import KVLayout
from llamajet.ops import OPS, ROWS_TOKENS, Executor, ref

ISAS = ops.supported_isas()
THREADS = (1, 2)
KV_TYPES = ("f32", "f16", "bf16", "int8")


def rng(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def i32(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int32)


# ------------------------------------------------------------------ numpy twins of the storage formats


def bf16_bits(x: np.ndarray) -> np.ndarray:
    torch = pytest.importorskip("torch")
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(
        np.uint16)


def encode(dtype: str, x: np.ndarray, kvh: int) -> np.ndarray:
    """Rows [n, kvh*hd] fp32 -> stored rows uint8 [n, row_bytes]."""
    x = np.ascontiguousarray(x, np.float32)
    n = x.shape[0]
    if dtype == "f32":
        return x.view(np.uint8).reshape(n, -1)
    if dtype == "f16":
        return x.astype(np.float16).view(np.uint8).reshape(n, -1)
    if dtype == "bf16":
        return bf16_bits(x).view(np.uint8).reshape(n, -1)
    h = x.reshape(n, kvh, -1)
    amax = np.abs(h).max(-1, keepdims=True)
    scale = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(h * inv), -127, 127).astype(np.int8)
    rec = np.concatenate([scale.view(np.uint8).reshape(n, kvh, 4), q.view(np.uint8)], axis=-1)
    return rec.reshape(n, -1)


def decode(dtype: str, rows: np.ndarray, kvh: int, hd: int) -> np.ndarray:
    """Stored rows -> the fp32 values attention reads."""
    n = rows.shape[0]
    rows = np.ascontiguousarray(rows)
    if dtype == "f32":
        return rows.view(np.float32).reshape(n, -1)
    if dtype == "f16":
        return rows.view(np.float16).astype(np.float32).reshape(n, -1)
    if dtype == "bf16":
        return (rows.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(n, -1)
    rec = rows.reshape(n, kvh, hd + 4)
    scale = np.ascontiguousarray(rec[..., :4]).view(np.float32)
    q = np.ascontiguousarray(rec[..., 4:]).view(np.int8).astype(np.float32)
    return (scale * q).reshape(n, -1)


# K pools stored as K^T blocks (csrc/kernels/attention.inc), by element type
KT_TYPES = {"f32": np.float32, "f16": np.uint16}


class KVProg:
    """An executor whose K/V pools hold `nslots` rows of KV type `dtype`."""

    def __init__(self, isa, nth, dtype, kvh, hd, *, T, S=1, B=1, bs=16, nslots=16, scratch=0):
        self.ex = Executor(isa=isa, n_threads=nth, max_tokens=T, max_out=T, max_seqs=S, max_blocks=B,
                           kv_slots=nslots, block_size=bs, max_pos=B * bs, scratch_floats=scratch)
        self.dtype, self.kvh, self.hd = dtype, kvh, hd
        self.rb = KVLayout.row_bytes_of(dtype, kvh, hd)
        self.nslots = nslots

    def buf(self, data=None, nbytes=None, fill=0xA5):
        if data is not None:
            raw = np.ascontiguousarray(data).view(np.uint8).ravel()
            nbytes = raw.size
        bid = self.ex.alloc_buffer(nbytes)
        v = self.ex.buffer(bid)
        v[:] = raw if data is not None else fill
        return bid

    def pool(self, fill=0xA5):
        return self.buf(nbytes=self.nslots * self.rb, fill=fill)

    def rows(self, bid):
        return self.ex.buffer(bid).copy().reshape(self.nslots, self.rb)

    def act(self, bid, cols, dtype="f32"):
        return ops.Ref.in_buffer(bid, 0, ops.dtype(dtype), ROWS_TOKENS, cols)

    def pools(self, kp, vp):
        """The k_pool / v_pool fields: [nslots, kv_dim] of the KV type, group = head_dim."""
        code = ops.KV_DTYPES[self.dtype]
        return {f: ops.Ref.in_buffer(b, 0, code, self.nslots, self.kvh * self.hd, self.hd)
                for f, b in (("k_pool", kp), ("v_pool", vp))}

    def add(self, op, **fields):
        p = OPS[op]()
        for k, v in fields.items():
            setattr(p, k, v)
        self.ex.add(p)


# ------------------------------------------------------------------ kv_write


def special_values(g, n, kvd):
    """Gaussian rows at several scales, plus rows of fp16 edge cases."""
    x = (g.standard_normal((n, kvd)) * np.exp(g.uniform(-12, 12, (n, 1)))).astype(np.float32)
    edge = np.array([65504, 65519.99, 65520, 1e6, -7e4, 6.1e-5, 6.0e-5, 3e-8, 2.98e-8, 1e-9, 0.0, -0.0,
                     np.inf, -np.inf, np.nan, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 3.0e38], np.float32)
    m = min(x.size, edge.size)
    x.ravel()[:m] = edge[:m]
    if n > 2:
        x[-1] = 0.0  # all-zero heads: int8 scale 0
    return x


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("nth", THREADS)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", KV_TYPES)
def test_kv_write_stores_the_exact_conversion(dtype, isa, nth):
    g = rng("kvw", dtype, isa, nth)
    for T, kvh, hd in ((83, 3, 64), (7, 2, 6), (1, 1, 8)):
        kvd = kvh * hd
        k = special_values(g, T, kvd)
        v = special_values(g, T, kvd)[::-1].copy()
        if dtype == "int8":  # inf/NaN have no int8 code: finite rows only
            k, v = np.nan_to_num(k, posinf=7.0, neginf=-7.0), np.nan_to_num(v, posinf=7.0, neginf=-7.0)
        nslots = 8 * 16
        slots = g.permutation(nslots)[:T]
        p = KVProg(isa, nth, dtype, kvh, hd, T=T, B=8, nslots=nslots)
        kb, vb = p.buf(k), p.buf(v)
        kp, vp = p.pool(), p.pool()
        p.add("kv_write", k=p.act(kb, kvd), v=p.act(vb, kvd), kv_heads=kvh, head_dim=hd, **p.pools(kp, vp))
        z = np.zeros(T, np.int32)
        p.ex.run(i32(z), i32(z), i32(slots), i32(z), i32(np.zeros((1, 1))), i32([]))
        for pool, src in ((kp, k), (vp, v)):
            got = p.rows(pool)
            if dtype in KT_TYPES and pool == kp:  # fp32 / fp16 K pools are stored as K^T blocks of 16 slots
                got = ref.k_pool_rows(got.view(KT_TYPES[dtype]), kvh, hd, 16).view(np.uint8)
            elif dtype == "int8" and pool == kp:  # so are int8 ones, each head's scales after its codes
                got = ref.k_pool_rows_i8(got, kvh, hd, 16)
            want = encode(dtype, src, kvh)
            if dtype in ("f16", "bf16"):  # NaN: any NaN code will do (torch keeps the sign, we do not)
                nan = np.isnan(src)
                assert np.isnan(decode(dtype, got[slots], kvh, hd)[nan]).all()
                g16, w16 = got[slots].view(np.uint16), want.view(np.uint16)
                np.testing.assert_array_equal(g16[~nan], w16[~nan], err_msg=f"{dtype} T={T} hd={hd}")
            else:
                np.testing.assert_array_equal(got[slots], want, err_msg=f"{dtype} T={T} hd={hd}")
            rest = np.ones(nslots, bool)
            rest[slots] = False
            assert (got[rest] == 0xA5).all()  # no other slot touched


def test_int8_kv_error_is_at_most_half_a_step():
    g = rng("int8-step")
    x = (g.standard_normal((50, 4 * 64)) * 3).astype(np.float32)
    back = decode("int8", encode("int8", x, 4), 4, 64)
    step = np.abs(x.reshape(50, 4, 64)).max(-1, keepdims=True) / 127
    # half a step, plus fp32 rounding of x*inv and of scale*q (a few ulps of |x|)
    assert (np.abs(back - x).reshape(50, 4, 64) <= step / 2 * (1 + 1e-6) + 4e-7 * np.abs(x).reshape(50, 4, 64)).all()


# ------------------------------------------------------------------ attention


@pytest.mark.parametrize("nth", THREADS)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", KV_TYPES)
@pytest.mark.parametrize("H,KVH,hd", ((6, 2, 64), (4, 1, 6), (8, 4, 8)), ids=("gqa3-hd64", "mqa-hd6", "gqa2-hd8"))
@pytest.mark.parametrize("bs", (16, 5))
def test_attention_over_every_kv_type(dtype, isa, nth, H, KVH, hd, bs):
    """Several sequences, shuffled block tables, a prefill chunk beside decode
    rows; the step's own K/V written by kv_write in the pool's format. Block
    size 16: fp32 / fp16 K^T blocks read in place; 5: converted copies."""
    from test_kernels import attention_ref_bound, assert_close, shuffled_block_tables

    g = rng("attn-kv", dtype, isa, nth, H, KVH, hd, bs)
    max_blocks = -(-96 // bs)
    nblocks = 4 * max_blocks
    nslots = bs * nblocks
    kvd = KVH * hd
    scale = 1.0 / np.sqrt(hd)
    steps = [np.arange(21, 53), np.array([70]), np.array([0]), np.array([95])]
    S = len(steps)
    bt, slot = shuffled_block_tables(g, steps, bs, nblocks, max_blocks)

    # scratch: ample for any attention kernel's tiles (the executor checks the real need)
    p = KVProg(isa, nth, dtype, KVH, hd, T=40, S=S, B=max_blocks, bs=bs, nslots=nslots, scratch=1 << 14)
    kpool = np.full((nslots, p.rb), 0xFF, np.uint8)  # 0xFF: NaN in every float format, a wild int8 scale
    vpool = kpool.copy()
    kseq, vseq = [], []
    for s, pos in enumerate(steps):
        L = pos[-1] + 1
        k = (g.standard_normal((L, kvd)) * 1.5).astype(np.float32)
        v = g.standard_normal((L, kvd)).astype(np.float32)
        kenc, venc = encode(dtype, k, KVH), encode(dtype, v, KVH)
        kseq.append(decode(dtype, kenc, KVH, hd))  # what the kernel will read
        vseq.append(decode(dtype, venc, KVH, hd))
        for q in range(pos[0]):  # cached prefix
            kpool[slot(s, q)], vpool[slot(s, q)] = kenc[q], venc[q]
    order = [(1, 70)] + [(0, int(q)) for q in steps[0]] + [(2, 0), (3, 95)]
    T = len(order)
    seq_of = np.array([s for s, _ in order])
    positions = np.array([q for _, q in order])
    slots = np.array([slot(s, q) for s, q in order])
    q = g.standard_normal((T, H * hd)).astype(np.float32)
    # The step's own K/V go in as fp32 rows and kv_write stores them: feed the
    # decoded values, which every format stores back unchanged
    # (test_decoded_values_encode_to_themselves), so kseq/vseq stay exact.
    kin = np.zeros((40, kvd), np.float32)
    vin = np.zeros((40, kvd), np.float32)
    for r, (s, pos_) in enumerate(order):
        kin[r], vin[r] = kseq[s][pos_], vseq[s][pos_]
    qb, kb, vb = p.buf(np.concatenate([q, np.zeros((40 - T, H * hd), np.float32)])), p.buf(kin), p.buf(vin)
    if dtype in KT_TYPES:  # fp32 / fp16 K pools are stored as K^T blocks
        kpool = ref.k_pool_from_rows(kpool.view(KT_TYPES[dtype]), KVH, hd, bs).view(np.uint8)
    elif dtype == "int8":  # int8: K^T codes, then the block's scales, per head
        kpool = ref.k_pool_from_rows_i8(kpool, KVH, hd, bs)
    kp, vp = p.buf(kpool), p.buf(vpool)
    out = p.buf(nbytes=40 * H * hd * 4, fill=0xFF)
    p.add("kv_write", k=p.act(kb, kvd), v=p.act(vb, kvd), kv_heads=KVH, head_dim=hd, **p.pools(kp, vp))
    p.add("attention", q=p.act(qb, H * hd), out=p.act(out, H * hd), heads=H, kv_heads=KVH, head_dim=hd, scale=scale,
          **p.pools(kp, vp))
    p.ex.run(i32(np.zeros(T)), i32(positions), i32(slots), i32(seq_of), i32(bt), i32([]))
    got = p.ex.buffer(out).view(np.float32)[: T * H * hd].reshape(T, H * hd)
    for s in range(S):
        rows = np.flatnonzero(seq_of == s)
        want, atol = attention_ref_bound(q[rows], kseq[s], vseq[s], positions[rows], H, KVH, hd, scale)
        assert_close(got[rows], want, atol, f"{dtype} attention seq {s} H={H} KVH={KVH} hd={hd}")


def test_decoded_values_encode_to_themselves():
    """What the attention test relies on: re-storing a stored value is exact."""
    g = rng("idem")
    x = (g.standard_normal((20, 2 * 8)) * 5).astype(np.float32)
    for dtype in KV_TYPES:
        once = encode(dtype, x, 2)
        np.testing.assert_array_equal(encode(dtype, decode(dtype, once, 2, 8), 2), once, err_msg=dtype)


def test_int8_k_pool_layout_helpers_invert_each_other():
    """ref.k_pool_rows_i8 undoes ref.k_pool_from_rows_i8 (the kv_write test
    checks the kernel's writes through the first, the attention test its reads
    through the second), and a head's codes land as its [hd][bs] K^T tile."""
    g = rng("i8-layout")
    kvh, hd, bs, n = 3, 8, 4, 12
    rows = encode("int8", (g.standard_normal((n, kvh * hd)) * 2).astype(np.float32), kvh)
    pool = ref.k_pool_from_rows_i8(rows, kvh, hd, bs)
    np.testing.assert_array_equal(ref.k_pool_rows_i8(pool, kvh, hd, bs), rows)
    rec = rows.reshape(n, kvh, hd + 4)
    b, h, j, d = 2, 1, 3, 5  # slot 11: block 2, offset 3
    region = pool.reshape(-1)[(b * kvh + h) * bs * (hd + 4):][: bs * (hd + 4)]
    assert region[d * bs + j] == rec[b * bs + j, h, 4 + d]
    np.testing.assert_array_equal(region[hd * bs + 4 * j: hd * bs + 4 * j + 4], rec[b * bs + j, h, :4])


def test_bad_kv_configs_are_refused():
    p = KVProg(ISAS[0], 1, "int8", 2, 8, T=4, B=1, nslots=16, scratch=16)
    k, kp = p.buf(np.zeros((4, 16), np.float32)), p.pool()
    with pytest.raises(ValueError, match="kv_heads"):  # the head count is part of the pool's shape
        p.add("kv_write", k=p.act(k, 16), v=p.act(k, 16), kv_heads=0, head_dim=8, **p.pools(kp, kp))
    q4 = {f: ops.Ref.in_buffer(kp, 0, ops.DType.Q4_0, 16, 32, 8) for f in ("k_pool", "v_pool")}
    with pytest.raises(ValueError, match="KV storage type"):
        p.add("kv_write", k=p.act(k, 16), v=p.act(k, 16), kv_heads=2, head_dim=8, **q4)

    from llamajet.config import RuntimeConfig

    with pytest.raises(RequestError, match="kv_dtype"):
        RuntimeConfig(max_model_len=64, kv_dtype="int4")


# ------------------------------------------------------------------ model level


@pytest.fixture(scope="module")
def stories_scores(stories_hf):
    from conftest import SHARED_DATA
    from llamajet.eval.perplexity import corpus_windows, evaluate

    llms = {d: LLM(stories_hf, max_model_len=256, kv_dtype=d, kv_cache_tokens=256, quantize="none") for d in KV_TYPES}
    text = (SHARED_DATA / "corpora" / "wikitext-2-raw-test.txt").read_text(encoding="utf-8")[:20_000]
    windows = corpus_windows(llms["f32"].tokenizer, text, 256, 3)
    return llms, evaluate(llms, windows, "f32")


def test_kv_precision_quality_on_wikitext(stories_scores):
    """KL(p_f32 || p_kv) per scored token, stories260K on 3 x 256 WikiText-2 tokens.

    Measured: f16 3.7e-6, bf16 2.3e-4, int8 6.8e-3. Bounds, ~10x above:
    a relative perturbation r of K and V moves logits by O(r) and KL by O(r^2);
    r is 2^-12 for fp16 (11-bit significand, round to nearest), 2^-9 for
    bf16, and up to 1/254 of a head's largest value for int8 (worse for the
    small values of a head). So fp16 must be ~64x better than bf16, and int8
    the worst."""
    _, sc = stories_scores
    kl = {d: s.kl for d, s in sc.items()}
    assert kl["f32"] == 0.0
    assert kl["f16"] < 4e-5 and kl["bf16"] < 3e-3 and kl["int8"] < 7e-2, kl
    assert kl["f16"] < kl["bf16"] < kl["int8"], kl
    ppl = {d: s.ppl for d, s in sc.items()}
    assert abs(ppl["f16"] / ppl["f32"] - 1) < 1e-3 and abs(ppl["int8"] / ppl["f32"] - 1) < 3e-2, ppl


def test_kv_memory_per_token(stories_scores):
    llms, _ = stories_scores
    per_tok = {d: llm.engine.runner.kv_bytes_per_block // 16 for d, llm in llms.items()}
    # stories260K: 5 layers x (K, V) x 4 KV heads x head_dim 8
    assert per_tok == {"f32": 5 * 2 * 32 * 4, "f16": 5 * 2 * 32 * 2, "bf16": 5 * 2 * 32 * 2,
                       "int8": 5 * 2 * 4 * (8 + 4)}


def test_generation_with_reduced_kv_precision(stories_scores):
    """Batched generation works in every format; with fp16 the greedy text is
    the fp32 one (its KL is ~1e-6: no near-tie flips in 40 tokens)."""
    llms, _ = stories_scores
    p = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = ["Once upon a time", "The cat sat", "Lily and Tom"]
    ref = llms["f32"].generate(prompts, p)
    for d in ("f16", "bf16", "int8"):
        out = llms[d].generate(prompts, p)
        assert all(len(o.token_ids) == 40 for o in out)
        if d == "f16":
            assert [o.token_ids for o in out] == [r.token_ids for r in ref]
