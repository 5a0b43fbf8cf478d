"""Every C++ kernel on every ISA tier this CPU runs, against the float64 numpy
reference (``llamajet.ops.ref``), plus the executor's boundary checks.

Each test builds a small executor holding one op (two for kv_write +
attention, the decode pattern), writes seeded random inputs into executor
buffers, runs one step and compares with ``ref``. Sizes are ragged on
purpose: row counts 1/7/83/769 and K not a multiple of the vector width
(8 lanes avx2, 16 avx512) for float weights, so every vector tail runs.
Output buffers are pre-filled with NaN, so a row a kernel forgot to write, or
wrote outside its share, shows up.

Tolerances (u = 2**-24, the fp32 unit roundoff; every bound below carries a
safety factor of 2 over the derivation written next to it):

* embed, kv_write, gather: pure copies / exact conversions -> bit exact.
  (fp16 -> fp32, bf16 -> fp32 are exact; a q8_0/q4_0 weight d*q needs at most
  11+8 significant bits, exact in fp32; q4_1's d*q + m rounds once, so it
  equals the float64 value rounded to fp32.)
* add: one IEEE addition per element -> bit exact vs numpy fp32 a + b.
* matmul: a length-K fp32 dot product, any summation order (sequential on
  the ref tier, W-lane FMA partial sums on avx2/avx512) is within
  K*u*sum_k |x_k w_k| of the exact value; +1 rounding of the product and +1
  for q4_1's dequantization rounding ->
  atol = 2 * (K + 2) * u * (|x| @ |W|^T), elementwise.
* rmsnorm: sum of squares (positive terms) has relative error (n+1)u; /n,
  +eps, sqrt (halves it), 1/., *x, *w add ~5u ->
  rtol = 2 * ((n + 3)/2 + 4) * u  relative to |ref| elementwise.
* rope: y = x0*c - x1*s, two products and one subtraction ->
  atol = 2 * 2u * (|x0 c| + |x1 s|) elementwise (tables are the same fp32
  values for kernel and reference).
* swiglu: expf (< 1 ulp in glibc; allow 2), 1 + e, divide, multiply ->
  rtol = 2 * 6u, plus atol 1e-37*|up| for g << 0 where fp32 exp(-g) overflows
  to inf and the kernel returns -0 (the exact value is < 1e-37).
* attention: each score has error ds <= (hd + 2) u scale sum|q k| (dot + the
  scale multiply); the common max shift cancels in the normalisation; the
  subtraction s - max and expf add (|s - max| + 2)u relative to each weight;
  a relative perturbation E of the weights moves the output by at most
  2 E sum_j p_j |v_j|; accumulating n_ctx weighted values and their sum with
  a final 1/sum scale adds (2 n_ctx + 4) u of the same quantity ->
  atol = 2 * (2 E + (2 n_ctx + 4) u) * (p @ |V|) per (token, head).

Thread counts 1 and 2 are both run; the work split must not change results
beyond these tolerances (today it is bit-identical: no kernel splits a
reduction across threads).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zlib

import gguf
import gguf.quants
import numpy as np
import pytest

from llamajet import ops
from llamajet.errors import LlamajetError
from llamajet.ops import OPS, ROWS_OUT, ROWS_TOKENS, Executor, ref
from llamajet.ops.dispatch import ISA_ORDER

U = 2.0**-24
ISAS = ops.supported_isas()
# Random fp16/bf16 bit patterns include signalling NaNs; numpy warns when it casts them.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
THREADS = (1, 2)
FLOAT_TYPES = ("f32", "f16", "bf16")
QUANT_TYPES = ("q8_0", "q4_0", "q4_1")
GGML = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
        "q4_1": gguf.GGMLQuantizationType.Q4_1, "f16": gguf.GGMLQuantizationType.F16,
        "bf16": gguf.GGMLQuantizationType.BF16}


def rng(*key) -> np.random.Generator:
    """A generator seeded from the test's parameters (stable across runs)."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def i32(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int32)


# ------------------------------------------------------------------ helpers


class Prog:
    """A small executor: named fp32 buffers (each exactly the size asked for)
    and a Program of ops over them, each op its params struct with the
    fields given by name (tensor operands as Refs)."""

    def __init__(self, isa, nth, *, T, O=None, S=1, B=1, kv_slots=16, bs=16, P=1, scratch=0):
        self.ex = Executor(isa=isa, n_threads=nth, max_tokens=T, max_out=T if O is None else O,
                           max_seqs=S, max_blocks=B, kv_slots=kv_slots, block_size=bs, max_pos=P,
                           scratch_floats=scratch)
        assert self.ex.isa == isa
        self.ids: dict[str, int] = {}
        self.keep: list[np.ndarray] = []  # arrays the Program reads (a Ref holds a raw pointer)

    def buf(self, name, data=None, n=None, fill=np.nan) -> int:
        """Allocates buffer `name` holding fp32 `data` (or n floats of `fill`); its id."""
        data = None if data is None else np.ascontiguousarray(data, np.float32).ravel()
        n = data.size if data is not None else n
        bid = self.ex.alloc_buffer(4 * n)
        v = self.ex.buffer(bid).view(np.float32)
        v[:] = fill if data is None else data
        self.ids[name] = bid
        return bid

    def a(self, name, rows, cols, dtype="f32", group=0, offset=0):
        """A Ref to buffer `name` holding [rows, cols] of `dtype` at `offset` bytes."""
        return ops.Ref.in_buffer(self.ids[name], offset, ops.dtype(dtype), rows, cols, group)

    def w(self, array, dtype, rows, cols, group=0):
        """A Ref to external memory `array` (kept alive by the Prog)."""
        self.keep.append(array)
        return ops.Ref.from_array(array, ops.dtype(dtype), rows, cols, group)

    def get(self, name, shape=None) -> np.ndarray:
        a = self.ex.buffer(self.ids[name]).view(np.float32).copy()
        return a if shape is None else a.reshape(shape)

    def add(self, op, **fields):
        params = OPS[op]()
        for k, v in fields.items():
            setattr(params, k, v)
        self.ex.add(params)

    def run(self, n, tokens=None, positions=None, slots=None, seq=None, bt=None, out_rows=()):
        z = np.zeros(n, np.int32)
        self.ex.run(i32(z if tokens is None else tokens), i32(z if positions is None else positions),
                    i32(z if slots is None else slots), i32(z if seq is None else seq),
                    i32(np.zeros((1, 1)) if bt is None else bt), i32(out_rows))


def make_table(dtype, n, k, g, kind="gauss"):
    """Raw storage (uint8 [n, row_bytes]) of an [n, k] matrix of storage type `dtype`.
    kind="gauss": quantized from Gaussian values; kind="bits": random bit patterns
    (fp16/bf16: every code incl. subnormal, inf, NaN; quant: random blocks with
    finite scales of any magnitude incl. fp16 subnormals)."""
    if kind == "bits":
        if dtype in ("f16", "bf16"):
            return g.integers(0, 2**16, size=(n, k), dtype=np.uint16).view(np.uint8).reshape(n, -1)
        if dtype == "f32":
            return g.standard_normal((n, k)).astype(np.float32).view(np.uint8).reshape(n, -1)
        bb = {"q8_0": 34, "q4_0": 18, "q4_1": 20}[dtype]
        raw = g.integers(0, 256, size=(n * (k // 32), bb), dtype=np.uint8)
        nscale = 2 if dtype == "q4_1" else 1
        h = g.integers(0, 2**16, size=(raw.shape[0], nscale), dtype=np.uint16)
        h = np.where((h & 0x7C00) == 0x7C00, h & 0x83FF, h).astype(np.uint16)  # no inf/nan scales
        raw[:, : 2 * nscale] = h.view(np.uint8)
        return raw.reshape(n, -1)
    x = g.standard_normal((n, k)).astype(np.float32)
    if dtype == "f32":
        return x.view(np.uint8).reshape(n, -1)
    if dtype == "f16":
        return x.astype(np.float16).view(np.uint8).reshape(n, -1)
    if dtype == "bf16":  # top halves of the float32 bits
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n, -1)
    return np.ascontiguousarray(gguf.quants.quantize(x, GGML[dtype]))


def assert_bits_equal(got, want):
    """fp32 equality bit for bit, except that NaN need only stay NaN."""
    got = np.asarray(got, np.float32)
    want = np.asarray(want, np.float32)
    assert got.shape == want.shape
    gn, wn = np.isnan(got), np.isnan(want)
    assert np.array_equal(gn, wn), f"NaN mismatch at {np.argwhere(gn != wn)[:5].tolist()}"
    bad = (got.view(np.uint32) != want.view(np.uint32)) & ~gn
    assert not bad.any(), (f"{bad.sum()} elements differ, first at {np.argwhere(bad)[:3].tolist()}: "
                           f"{got[bad][:3]} vs {want[bad][:3]}")


def assert_close(got, want, atol, what=""):
    got = np.asarray(got, np.float64)
    err = np.abs(got - want)
    bad = ~(err <= atol)  # NaN counts as bad
    assert not bad.any(), (f"{what}: {bad.sum()}/{bad.size} beyond tolerance; worst at "
                           f"{np.unravel_index(np.nanargmax(np.where(bad, err / np.maximum(atol, 1e-300), 0)), err.shape)}"
                           f" got {got[bad][:3]} want {want[bad][:3]} atol {np.broadcast_to(atol, err.shape)[bad][:3]}")


# ------------------------------------------------------------------ ISA selection


def test_supported_isas_start_with_ref():
    assert ISAS[0] == "ref" and set(ISAS) <= set(ISA_ORDER)
    assert ISAS == [i for i in ISA_ORDER if i in ISAS]  # lowest first


def test_resolve_isa_env(monkeypatch):
    monkeypatch.delenv("LLAMAJET_ISA", raising=False)
    assert ops.resolve_isa() == ISAS[-1]
    for name, want in (("scalar", "ref"), ("ref", "ref"), ("avx2", "avx2"), ("avx512", "avx512"), ("amx", "amx"),
                       ("AVX2", "avx2")):
        monkeypatch.setenv("LLAMAJET_ISA", name)
        if want in ISAS:
            assert ops.resolve_isa() == want
        else:  # a tier this CPU lacks is an error, not a silent fallback
            with pytest.raises(LlamajetError):
                ops.resolve_isa()
    for bad in ("neon", "sse4", "avx", "avx512f", "native"):
        monkeypatch.setenv("LLAMAJET_ISA", bad)
        with pytest.raises(LlamajetError, match="unknown ISA"):
            ops.resolve_isa()
    monkeypatch.setenv("LLAMAJET_ISA", "neon")
    assert ops.resolve_isa("scalar") == "ref"  # an explicit request wins over the environment


def test_executor_refuses_unknown_isa():
    for bad in ("neon", "scalar", ""):
        with pytest.raises(ValueError):
            Prog(bad, 1, T=1)


# ------------------------------------------------------------------ storage formats


@pytest.mark.parametrize("dtype", ("f16", "bf16") + QUANT_TYPES)
def test_ref_dequantize_matches_gguf(dtype):
    """ref.dequantize (the spec the kernels are held to) against gguf's own
    dequantizer, bit for bit after rounding to fp32."""
    g = rng("deq", dtype)
    for kind in ("gauss", "bits"):
        for n, k in ((1, 32), (5, 96), (3, 608)):
            raw = make_table(dtype, n, k, g, kind)
            mine = ref.dequantize(raw, dtype, (n, k))
            theirs = gguf.quants.dequantize(raw, GGML[dtype])
            assert mine.dtype == np.float64
            assert_bits_equal(mine.astype(np.float32), np.asarray(theirs, np.float32).reshape(n, k))
            if dtype != "q4_1":  # d*q is exact in fp32 for these: no rounding at all
                ok = ~np.isnan(mine)
                assert np.array_equal(mine[ok], np.asarray(theirs, np.float64).reshape(n, k)[ok])


# ------------------------------------------------------------------ embed


@pytest.mark.parametrize("nth", THREADS)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", FLOAT_TYPES + QUANT_TYPES)
def test_embed(isa, nth, dtype):
    g = rng("embed", isa, nth, dtype)
    dims = (8, 72, 200) if dtype in FLOAT_TYPES else (32, 96, 608)
    V = 50
    for dim, kind, T in zip(dims, ("bits", "gauss", "bits"), (83, 7, 1)):
        table = make_table(dtype, V, dim, g, kind)
        want = ref.dequantize(table, dtype, (V, dim)).astype(np.float32)
        tokens = g.integers(0, V, size=T)
        tokens[0] = V - 1
        if T > 1:
            tokens[1] = 0
        p = Prog(isa, nth, T=T + 2)
        p.buf("out", n=(T + 2) * dim)
        p.add("embed", table=p.w(table, dtype, V, dim), out=p.a("out", ROWS_TOKENS, dim))
        p.run(T, tokens=tokens)
        got = p.get("out", (T + 2, dim))
        assert_bits_equal(got[:T], want[tokens])
        assert np.isnan(got[T:]).all()  # rows past this step's tokens untouched


# ------------------------------------------------------------------ rmsnorm


@pytest.mark.parametrize("nth", THREADS)
@pytest.mark.parametrize("isa", ISAS)
def test_rmsnorm(isa, nth):
    g = rng("rmsnorm", isa, nth)
    eps = 1e-5
    for T, n in ((1, 1000), (7, 72), (83, 8), (83, 200)):
        x = (g.standard_normal((T, n)) * g.uniform(0.01, 10, size=(T, 1))).astype(np.float32)
        w = g.standard_normal(n).astype(np.float32)
        p = Prog(isa, nth, T=T)
        p.buf("x", x), p.buf("out", n=T * n)
        p.add("rmsnorm", x=p.a("x", ROWS_TOKENS, n), w=p.w(w, "f32", 1, n), out=p.a("out", ROWS_TOKENS, n), eps=eps)
        p.run(T)
        want = ref.rmsnorm(x, w.astype(np.float64), eps)
        rtol = 2 * ((n + 3) / 2 + 4) * U
        assert_close(p.get("out", (T, n)), want, rtol * np.abs(want) + 1e-30, f"rmsnorm T={T} n={n}")
    # in place (x == out) and ROWS_OUT rows
    T, O, n = 7, 3, 72
    x = g.standard_normal((O, n)).astype(np.float32)
    w = g.standard_normal(n).astype(np.float32)
    p = Prog(isa, nth, T=T, O=O)
    p.buf("x", x)
    p.add("rmsnorm", x=p.a("x", ROWS_OUT, n), w=p.w(w, "f32", 1, n), out=p.a("x", ROWS_OUT, n), eps=eps)
    p.run(T, out_rows=[4, 0])
    want = ref.rmsnorm(x[:2], w.astype(np.float64), eps)
    got = p.get("x", (O, n))
    assert_close(got[:2], want, 2 * ((n + 3) / 2 + 4) * U * np.abs(want) + 1e-30, "rmsnorm in place")
    assert_bits_equal(got[2:], x[2:])


# ------------------------------------------------------------------ matmul


def matmul_case(isa, nth, dtype, M, N, K, g, rows_mode="tokens", bias=False):
    W = make_table(dtype, N, K, g)
    Wf = ref.dequantize(W, dtype, (N, K))
    if rows_mode == "tokens":
        T, O, rows, n_out, mrows = M, 1, ROWS_TOKENS, 0, M
    else:  # logits rows: only the first n_out of max_out rows are computed
        T, O, rows, n_out, mrows = M + 3, M, ROWS_OUT, max(M - 1, 1), M
    x = g.standard_normal((mrows, K)).astype(np.float32)
    b = (g.standard_normal(N) * 3).astype(np.float32) if bias else None
    p = Prog(isa, nth, T=T, O=O, scratch=K)
    p.buf("x", x), p.buf("out", n=mrows * N)
    p.add("matmul", x=p.a("x", rows, K), w=p.w(W, dtype, N, K), out=p.a("out", rows, N),
          **({"bias": p.w(b, "f32", 1, N)} if bias else {}))
    p.run(T, out_rows=g.integers(0, T, size=n_out))
    got = p.get("out", (mrows, N))
    m = M if rows_mode == "tokens" else n_out
    want = ref.matmul(x[:m], Wf, b)
    atol = 2 * (K + 2) * U * (np.abs(x[:m]).astype(np.float64) @ np.abs(Wf).T) + 1e-30
    if bias:  # one more addition: u * |result|
        atol = atol + 2 * U * np.abs(want)
    assert_close(got[:m], want, atol, f"matmul {dtype} M={m} N={N} K={K} rows={rows_mode}")
    assert np.isnan(got[m:]).all()


@pytest.mark.parametrize("nth", THREADS)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", FLOAT_TYPES + QUANT_TYPES)
def test_matmul(isa, nth, dtype):
    g = rng("matmul", isa, nth, dtype)
    if dtype in FLOAT_TYPES:  # K not a multiple of 8 / 16 where possible
        shapes = ((1, 37, 1000), (7, 64, 72), (83, 19, 200), (769, 5, 8), (769, 3, 1000), (2, 1, 13))
    else:
        shapes = ((1, 37, 608), (7, 64, 96), (83, 19, 32), (769, 5, 608))
    for i, (M, N, K) in enumerate(shapes):
        matmul_case(isa, nth, dtype, M, N, K, g, bias=i % 2 == 1)
    matmul_case(isa, nth, dtype, 7, 23, shapes[2][2], g, rows_mode="out", bias=True)
    matmul_case(isa, nth, dtype, 1, 40, shapes[0][2], g, rows_mode="out")


@pytest.mark.parametrize("isa", ISAS)
def test_matmul_threads_agree(isa):
    """The N split across threads (incl. more threads than rows of W) leaves
    every output within tolerance of the single-thread result."""
    M, N, K = 7, 3, 224
    g = rng("mm_threads", isa)
    W = make_table("q4_1", N, K, g)
    x = g.standard_normal((M, K)).astype(np.float32)
    res = []
    for nth in (1, 2, 5):
        p = Prog(isa, nth, T=M, scratch=K)
        p.buf("x", x), p.buf("out", n=M * N)
        p.add("matmul", x=p.a("x", ROWS_TOKENS, K), w=p.w(W, "q4_1", N, K), out=p.a("out", ROWS_TOKENS, N))
        p.run(M)
        res.append(p.get("out", (M, N)))
    Wf = ref.dequantize(W, "q4_1", (N, K))
    # two results each within the matmul bound of the exact value: within twice it of each other
    atol = 2 * 2 * (K + 2) * U * (np.abs(x).astype(np.float64) @ np.abs(Wf).T)
    for r in res[1:]:
        assert_close(r, res[0], atol, "threads")


# ------------------------------------------------------------------ rope


_TABLES: dict = {}


def rope_tables(hd, max_pos):
    if (hd, max_pos) not in _TABLES:
        inv_freq = 1.0 / (500000.0 ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
        c, s = ref.rope_tables(inv_freq, max_pos)
        _TABLES[(hd, max_pos)] = (np.ascontiguousarray(c, np.float32), np.ascontiguousarray(s, np.float32))
    return _TABLES[(hd, max_pos)]


@pytest.mark.parametrize("inplace", (False, True), ids=("outofplace", "inplace"))
@pytest.mark.parametrize("interleaved", (False, True), ids=("halves", "interleaved"))
@pytest.mark.parametrize("nth", THREADS)
@pytest.mark.parametrize("isa", ISAS)
def test_rope(isa, nth, interleaved, inplace):
    g = rng("rope", isa, nth, interleaved, inplace)
    for heads, hd, max_pos, T, pad in ((4, 64, 70000, 83, 0), (3, 8, 300, 7, 0), (2, 72, 2048, 1, 0),
                                       (3, 8, 300, 7, 5)):
        cos, sin = rope_tables(hd, max_pos)
        stride = heads * hd + pad  # pad > 0: rope over the leading part of wider rows
        x = g.standard_normal((T, stride)).astype(np.float32)
        pos = g.integers(0, max_pos, size=T)
        pos[: min(T, 4)] = [max_pos - 1, 0, 65536 % max_pos, 65535 % max_pos][: min(T, 4)]
        p = Prog(isa, nth, T=T, P=max_pos, B=1, bs=max_pos, kv_slots=max_pos)
        p.buf("x", x)
        out = "x" if inplace else (p.buf("out", n=T * stride) and "out")
        p.add("rope", x=p.a("x", ROWS_TOKENS, stride), out=p.a(out, ROWS_TOKENS, stride),
              cos=p.w(cos, "f32", *cos.shape), sin=p.w(sin, "f32", *sin.shape), heads=heads, head_dim=hd,
              interleaved=interleaved)
        p.run(T, positions=pos)
        got = p.get("x" if inplace else "out", (T, stride))
        c64, s64 = cos.astype(np.float64), sin.astype(np.float64)
        want = ref.rope(x[:, : heads * hd], pos, c64, s64, heads, hd, interleaved)
        # |x0 c| + |x1 s| for both outputs of each pair: a cos-only and a sin-only rotation of |x|
        ax, zero = np.abs(x[:, : heads * hd]), np.zeros_like(c64)
        mag = (ref.rope(ax, pos, np.abs(c64), zero, heads, hd, interleaved)
               + np.abs(ref.rope(ax, pos, zero, np.abs(s64), heads, hd, interleaved)))
        assert_close(got[:, : heads * hd], want, 2 * 2 * U * mag + 1e-30,
                     f"rope heads={heads} hd={hd} T={T} stride={stride}")
        # the tail of each row past heads*hd is not rope's: untouched
        if inplace:
            assert_bits_equal(got[:, heads * hd:], x[:, heads * hd:])
        else:
            assert np.isnan(got[:, heads * hd:]).all()


# ------------------------------------------------------------------ kv_write


@pytest.mark.parametrize("nth", THREADS)
@pytest.mark.parametrize("isa", ISAS)
def test_kv_write(isa, nth):
    g = rng("kv", isa, nth)
    bs, nblocks = 16, 24
    slots_n = bs * nblocks
    for T, kvd in ((83, 72), (1, 8), (7, 200)):
        k = g.standard_normal((T, kvd)).astype(np.float32)
        v = g.standard_normal((T, kvd)).astype(np.float32)
        slots = np.concatenate([[slots_n - 1], g.permutation(slots_n - 1)[: T - 1]])  # distinct, incl. last
        p = Prog(isa, nth, T=T, kv_slots=slots_n, bs=bs, B=nblocks, P=1)
        p.buf("k", k), p.buf("v", v)
        p.buf("kp", n=slots_n * kvd), p.buf("vp", n=slots_n * kvd)
        p.add("kv_write", k=p.a("k", ROWS_TOKENS, kvd), v=p.a("v", ROWS_TOKENS, kvd),
              k_pool=p.a("kp", slots_n, kvd, group=kvd), v_pool=p.a("vp", slots_n, kvd, group=kvd),
              kv_heads=1, head_dim=kvd)
        p.run(T, slots=slots)
        for name, src in (("kp", k), ("vp", v)):
            pool = p.get(name, (slots_n, kvd))
            if name == "kp":  # fp32 K pools are stored as K^T blocks (one head of kvd here)
                pool = ref.k_pool_rows(pool, 1, kvd, bs)
            assert_bits_equal(pool[slots], src)
            rest = np.ones(slots_n, bool)
            rest[slots] = False
            assert np.isnan(pool[rest]).all()


# ------------------------------------------------------------------ attention


def shuffled_block_tables(g, steps, bs, nblocks, max_blocks):
    """Block tables [len(steps), max_blocks] giving sequence s the blocks its
    last position steps[s][-1] needs, drawn without repeats from a shuffled
    pool of nblocks (unused entries: valid ids, never read), and slot(s, p):
    the KV slot of sequence s's position p."""
    perm = g.permutation(nblocks)
    bt = np.empty((len(steps), max_blocks), np.int32)
    used = 0
    for s, pos in enumerate(steps):
        need = pos[-1] // bs + 1
        bt[s, :need] = perm[used: used + need]
        used += need
        bt[s, need:] = g.integers(0, nblocks, size=max_blocks - need)
    assert used <= nblocks

    def slot(s, p):
        return bt[s, p // bs] * bs + p % bs

    return bt, slot


def attention_ref_bound(q, kseq, vseq, positions, H, KVH, hd, scale):
    """ref.attention for one sequence and the per-element error bound of the
    module docstring."""
    want = ref.attention(q, kseq, vseq, positions, H, KVH, hd, scale)
    T = len(positions)
    qq = np.asarray(q, np.float64).reshape(T, H, hd)
    kk = np.asarray(kseq, np.float64).reshape(-1, KVH, hd)
    vv = np.asarray(vseq, np.float64).reshape(-1, KVH, hd)
    bound = np.zeros((T, H, hd))
    grp = H // KVH
    for t, pos in enumerate(positions):
        n_ctx = pos + 1
        for h in range(H):
            kh, vh = kk[:n_ctx, h // grp], vv[:n_ctx, h // grp]
            s = kh @ qq[t, h] * scale
            ds = (hd + 2) * U * (np.abs(kh) @ np.abs(qq[t, h]) * scale).max()
            e = np.exp(s - s.max())
            pw = e / e.sum()
            E = ds + (s.max() - s.min() + 2) * U
            bound[t, h] = 2 * (2 * E + (2 * n_ctx + 4) * U) * (pw @ np.abs(vh))
    return want, bound.reshape(T, H * hd) + 1e-30


@pytest.mark.parametrize("nth", THREADS)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("H,KVH,hd", ((2, 2, 8), (6, 2, 64), (8, 2, 72), (4, 1, 16)),
                         ids=("mha-hd8", "gqa3-hd64", "gqa4-hd72", "mqa-hd16"))
@pytest.mark.parametrize("bs", (16, 5))
def test_attention(isa, nth, H, KVH, hd, bs):
    """Several sequences in one step: a prefill chunk of one (on top of a
    cached prefix) and decode rows of others, tokens of different sequences
    interleaved, each read through a shuffled, non-contiguous block table.
    The step's own K/V are written by a kv_write op first (the real decode
    program); the cached prefix is placed in the pools directly. Block size
    16 reads the fp32 K^T blocks in place; 5 (not a multiple of any vector
    width) goes through the padded copy."""
    g = rng("attn", isa, nth, H, KVH, hd, bs)
    max_blocks = -(-96 // bs)
    nblocks = 4 * max_blocks
    slots_n = bs * nblocks
    kvd = KVH * hd
    scale = 1.0 / np.sqrt(hd)
    # sequence -> positions computed this step (contexts end at the last one)
    steps = [np.arange(21, 53), np.array([70]), np.array([0]), np.array([16]), np.array([95])]
    S = len(steps)
    bt, slot = shuffled_block_tables(g, steps, bs, nblocks, max_blocks)

    kpool = np.full((slots_n, kvd), np.nan, np.float32)  # NaN: any stray read poisons the output
    vpool = np.full((slots_n, kvd), np.nan, np.float32)
    kseq, vseq = [], []
    for s, pos in enumerate(steps):
        L = pos[-1] + 1
        kseq.append((g.standard_normal((L, kvd)) * 1.5).astype(np.float32))
        vseq.append(g.standard_normal((L, kvd)).astype(np.float32))
        for p in range(pos[0]):  # cached prefix
            kpool[slot(s, p)], vpool[slot(s, p)] = kseq[s][p], vseq[s][p]
    # token order: a decode row, the prefill chunk, then the other decode rows
    order = [(1, 70)] + [(0, int(p)) for p in steps[0]] + [(2, 0), (4, 95), (3, 16)]
    T = len(order)
    seq_of = np.array([s for s, _ in order])
    positions = np.array([p for _, p in order])
    slots = np.array([slot(s, p) for s, p in order])
    q = g.standard_normal((T, H * hd)).astype(np.float32)
    knew = np.stack([kseq[s][p] for s, p in order])
    vnew = np.stack([vseq[s][p] for s, p in order])

    p = Prog(isa, nth, T=T, S=S, B=max_blocks, kv_slots=slots_n, bs=bs, P=max_blocks * bs,
             scratch=attention_scratch(H // KVH, hd, bs, max_blocks))
    p.buf("q", q), p.buf("k", knew), p.buf("v", vnew)
    p.buf("kp", ref.k_pool_from_rows(kpool, KVH, hd, bs)), p.buf("vp", vpool)
    p.buf("out", n=T * H * hd)
    pools = dict(k_pool=p.a("kp", slots_n, kvd, group=hd), v_pool=p.a("vp", slots_n, kvd, group=hd))
    p.add("kv_write", k=p.a("k", ROWS_TOKENS, kvd), v=p.a("v", ROWS_TOKENS, kvd), kv_heads=KVH, head_dim=hd, **pools)
    p.add("attention", q=p.a("q", ROWS_TOKENS, H * hd), out=p.a("out", ROWS_TOKENS, H * hd), heads=H, kv_heads=KVH,
          head_dim=hd, scale=scale, **pools)
    p.run(T, positions=positions, slots=slots, seq=seq_of, bt=bt)
    got = p.get("out", (T, H * hd))
    for s in range(S):
        rows = np.flatnonzero(seq_of == s)
        want, atol = attention_ref_bound(q[rows], kseq[s], vseq[s], positions[rows], H, KVH, hd, scale)
        assert_close(got[rows], want, atol, f"attention seq {s} H={H} KVH={KVH} hd={hd}")


# ------------------------------------------------------------------ swiglu, add, gather


@pytest.mark.parametrize("nth", THREADS)
@pytest.mark.parametrize("isa", ISAS)
def test_swiglu(isa, nth):
    g = rng("swiglu", isa, nth)
    for T, n in ((1, 1000), (7, 72), (769, 13)):
        gate = (g.standard_normal((T, n)) * 4).astype(np.float32)
        gate.ravel()[:8] = [-100, -88, -20, 0, 20, 88, 100, -1e-30][: min(8, gate.size)]
        up = g.standard_normal((T, n)).astype(np.float32)
        p = Prog(isa, nth, T=T)
        p.buf("g", gate), p.buf("u", up), p.buf("out", n=T * n)
        p.add("swiglu", gate=p.a("g", ROWS_TOKENS, n), up=p.a("u", ROWS_TOKENS, n), out=p.a("out", ROWS_TOKENS, n))
        p.run(T)
        want = ref.swiglu(gate, up.astype(np.float64))
        atol = 2 * 6 * U * np.abs(want) + 1e-37 * np.abs(up)
        assert_close(p.get("out", (T, n)), want, atol, f"swiglu T={T} n={n}")


@pytest.mark.parametrize("nth", THREADS)
@pytest.mark.parametrize("isa", ISAS)
def test_add(isa, nth):
    g = rng("add", isa, nth)
    for T, n, inplace in ((1, 1000, False), (7, 72, True), (769, 13, False), (83, 200, True)):
        a = g.standard_normal((T, n)).astype(np.float32)
        b = (g.standard_normal((T, n)) * 1e3).astype(np.float32)
        p = Prog(isa, nth, T=T)
        p.buf("a", a), p.buf("b", b)
        out = "a" if inplace else (p.buf("out", n=T * n) and "out")  # the residual add writes into x
        p.add("add", a=p.a("a", ROWS_TOKENS, n), b=p.a("b", ROWS_TOKENS, n), out=p.a(out, ROWS_TOKENS, n))
        p.run(T)
        got = p.get("a" if inplace else "out", (T, n))
        assert_bits_equal(got, a + b)  # one IEEE rounding: exact vs numpy fp32
        assert_close(got, ref.add(a, b.astype(np.float64)), U * np.abs(ref.add(a, b)) + 1e-30, "add")
    # ROWS_OUT rows: only n_out rows are summed
    T, O, n = 9, 4, 40
    a, b = g.standard_normal((O, n)).astype(np.float32), g.standard_normal((O, n)).astype(np.float32)
    p = Prog(isa, nth, T=T, O=O)
    p.buf("a", a), p.buf("b", b), p.buf("out", n=O * n)
    p.add("add", a=p.a("a", ROWS_OUT, n), b=p.a("b", ROWS_OUT, n), out=p.a("out", ROWS_OUT, n))
    p.run(T, out_rows=[8, 1, 3])
    got = p.get("out", (O, n))
    assert_bits_equal(got[:3], a[:3] + b[:3])
    assert np.isnan(got[3:]).all()


@pytest.mark.parametrize("nth", THREADS)
@pytest.mark.parametrize("isa", ISAS)
def test_gather(isa, nth):
    g = rng("gather", isa, nth)
    for T, O, n, n_out in ((83, 83, 200, 83), (83, 5, 72, 5), (7, 4, 8, 2), (1, 1, 13, 1), (7, 3, 8, 0)):
        x = g.standard_normal((T, n)).astype(np.float32)
        rows = g.integers(0, T, size=n_out)
        if n_out:
            rows[0] = T - 1
        p = Prog(isa, nth, T=T, O=O)
        p.buf("x", x), p.buf("out", n=O * n)
        p.add("gather", x=p.a("x", ROWS_TOKENS, n), out=p.a("out", ROWS_OUT, n))
        p.run(T, out_rows=rows)
        got = p.get("out", (O, n))
        assert_bits_equal(got[:n_out], ref.gather(x, rows))
        assert np.isnan(got[n_out:]).all()


@pytest.mark.parametrize("nth", THREADS)
@pytest.mark.parametrize("isa", ISAS)
def test_argmax(isa, nth):
    """Greedy ids against numpy's argmax itself: the first index on ties (in
    one chunk of 16 vectors, across chunks, in the tail), the first NaN if
    any, +inf, rows of -inf; lengths around the chunk of 16 vectors."""
    g = rng("argmax", isa, nth)
    for n in (1, 5, 16, 255, 256, 257, 1000, 49152 + 13):
        x = g.standard_normal((12, n)).astype(np.float32)
        k = g.integers(0, n, size=6)
        top = np.float32(x.max() + 1)
        x[1, k[0]] = x[1, k[1]] = top                       # a tie: the first of the two
        x[2, :] = 0.5                                       # all equal: index 0
        x[3, k[2]] = np.nan                                 # a NaN wins wherever it is
        x[4, k[3]] = np.inf
        x[4, k[4]] = np.nan if n > 1 else np.inf
        x[5, :] = -np.inf                                   # no finite value: index 0
        x[6, k[5]] = top
        x[6, -1] = top                                      # ties with the last (tail) element
        x[7, :] = -np.inf
        x[7, -1] = -1.0
        x[8, 0] = x[8, -1] = top                            # the first element and the last
        x[9, k[0]] = np.float32(1e30)
        x[9, -1] = np.float32(1e30)
        x[10, :] = -0.0
        x[10, k[1]] = 0.0                                   # -0.0 == 0.0: a tie, index 0
        p = Prog(isa, nth, T=12)
        p.buf("x", x), p.buf("out", n=12)
        p.add("argmax", x=p.a("x", ROWS_TOKENS, n), out=p.a("out", ROWS_TOKENS, 1, "i32"))
        p.run(12)
        got = p.get("out").view(np.int32)
        np.testing.assert_array_equal(got, np.argmax(x, axis=1), err_msg=f"n={n}")
    # ROWS_OUT: only the n_out rows
    p = Prog(isa, nth, T=9, O=4)
    x = g.standard_normal((4, 300)).astype(np.float32)
    p.buf("x", x), p.buf("out", n=4, fill=-7)
    p.add("argmax", x=p.a("x", ROWS_OUT, 300), out=p.a("out", ROWS_OUT, 1, "i32"))
    p.run(9, out_rows=[8, 1, 3])
    got = p.get("out")
    np.testing.assert_array_equal(got[:3].view(np.int32), np.argmax(x[:3], axis=1))
    assert got[3] == -7


@pytest.mark.parametrize("isa", ISAS)
def test_more_threads_than_work(isa):
    """One token, five threads: most threads get an empty share."""
    n = 3
    g = rng("tiny", isa)
    a, b = g.standard_normal((1, n)).astype(np.float32), g.standard_normal((1, n)).astype(np.float32)
    p = Prog(isa, 5, T=1)
    p.buf("a", a), p.buf("b", b), p.buf("o1", n=n), p.buf("o2", n=n)
    p.add("add", a=p.a("a", ROWS_TOKENS, n), b=p.a("b", ROWS_TOKENS, n), out=p.a("o1", ROWS_TOKENS, n))
    p.add("swiglu", gate=p.a("a", ROWS_TOKENS, n), up=p.a("b", ROWS_TOKENS, n), out=p.a("o2", ROWS_TOKENS, n))
    for _ in range(3):  # repeated runs reuse the pool
        p.run(1)
        assert_bits_equal(p.get("o1", (1, n)), a + b)
        want = ref.swiglu(a, b.astype(np.float64))
        assert_close(p.get("o2", (1, n)), want, 12 * U * np.abs(want) + 1e-37, "swiglu 5 threads")


# ------------------------------------------------------------------ boundary checks


ISA0 = ISAS[-1]


def test_embed_token_out_of_vocab():
    V, dim, T = 10, 8, 4
    table = make_table("f32", V, dim, rng("oov"))
    p = Prog(ISA0, 2, T=T)
    p.buf("out", n=T * dim)
    p.add("embed", table=p.w(table, "f32", V, dim), out=p.a("out", ROWS_TOKENS, dim))
    for bad in (V, V + 1000, -1, 2**31 - 1):
        with pytest.raises(ValueError, match="vocabulary"):
            p.run(2, tokens=[0, bad])
    p.run(2, tokens=[V - 1, 0])  # still usable after refusing bad input
    want = table.view(np.float32)
    assert_bits_equal(p.get("out", (T, dim))[:2], want[[V - 1, 0]])


def test_rope_position_out_of_range():
    hd, heads, P = 8, 2, 32
    cos, sin = rope_tables(hd, P)
    p = Prog(ISA0, 2, T=4, P=P, B=4, bs=16, kv_slots=16)
    p.buf("x", np.zeros((4, heads * hd)))
    p.add("rope", x=p.a("x", ROWS_TOKENS, heads * hd), out=p.a("x", ROWS_TOKENS, heads * hd),
          cos=p.w(cos, "f32", *cos.shape), sin=p.w(sin, "f32", *sin.shape), heads=heads, head_dim=hd, interleaved=True)
    bt = np.zeros((1, 4))  # block tables reach 64 positions: max_pos is the binding limit
    for bad in (P, P + 1, -1, 2**31 - 1):
        with pytest.raises(ValueError, match="position"):
            p.run(2, positions=[0, bad], bt=bt)
    p.run(2, positions=[P - 1, 0], bt=bt)


def test_rope_tables_too_small():
    hd, heads, P = 8, 2, 32
    cos, sin = rope_tables(hd, P - 1)
    p = Prog(ISA0, 1, T=4, P=P, B=4, bs=16, kv_slots=16)
    p.buf("x", np.zeros((4, heads * hd)))
    with pytest.raises(ValueError, match="too small"):
        p.add("rope", x=p.a("x", ROWS_TOKENS, heads * hd), out=p.a("x", ROWS_TOKENS, heads * hd),
              cos=p.w(cos, "f32", *cos.shape), sin=p.w(sin, "f32", *sin.shape), heads=heads, head_dim=hd)


def attention_scratch(group, hd, bs, max_blocks):
    """A per-thread scratch hint for attention ops (the executor grows scratch
    to what each op needs when it is added anyway): K^T / V tiles of one block and
    the output rows of a 16-token run."""
    return 2 * bs * hd + 16 * group * (hd + 2) + 4 * bs + 2 * hd + 64


def kv_prog(T=4, kvd=8, bs=16, nblocks=4):
    """kv_write of one kv head of kvd values into fp32 pools; the pools' Refs."""
    p = Prog(ISA0, 2, T=T, kv_slots=bs * nblocks, bs=bs, B=nblocks, P=bs * nblocks, S=2,
             scratch=attention_scratch(4, kvd, bs, nblocks))
    p.buf("k", np.zeros((T, kvd))), p.buf("v", np.zeros((T, kvd)))
    p.buf("kp", n=bs * nblocks * kvd), p.buf("vp", n=bs * nblocks * kvd)
    pools = dict(k_pool=p.a("kp", bs * nblocks, kvd, group=kvd), v_pool=p.a("vp", bs * nblocks, kvd, group=kvd))
    p.add("kv_write", k=p.a("k", ROWS_TOKENS, kvd), v=p.a("v", ROWS_TOKENS, kvd), kv_heads=1, head_dim=kvd, **pools)
    return p, pools


def test_kv_slot_out_of_range():
    p, _ = kv_prog()
    for bad in (64, 65, -1, 2**31 - 1):
        with pytest.raises(ValueError, match="slot"):
            p.run(2, slots=[0, bad])
    p.run(2, slots=[63, 0])


def test_attention_bad_block_table():
    p, pools = kv_prog()
    p.buf("q", np.zeros((4, 16))), p.buf("out", n=4 * 16)
    p.add("attention", q=p.a("q", ROWS_TOKENS, 16), out=p.a("out", ROWS_TOKENS, 16), heads=2, kv_heads=1,
          head_dim=8, scale=0.3, **pools)
    ok = np.array([[3, 1, 0, 2], [2, 0, 1, 3]])
    for bad in (4, 5, -1, 2**31 - 1):
        bt = ok.copy()
        bt[1, 3] = bad
        with pytest.raises(ValueError, match="block id"):
            p.run(2, positions=[0, 1], slots=[48, 49], seq=[0, 0], bt=bt)
    with pytest.raises(ValueError, match="sequence"):
        p.run(2, positions=[0, 0], slots=[48, 32], seq=[0, 2], bt=ok)
    with pytest.raises(ValueError):  # block table wider than max_blocks
        p.run(1, bt=np.zeros((2, 5)))
    with pytest.raises(ValueError):  # more sequences than max_seqs
        p.run(1, bt=np.zeros((3, 4)))
    with pytest.raises(ValueError, match="position"):  # context past the block table's reach
        p.run(1, positions=[16], bt=ok[:, :1])
    p.run(2, positions=[0, 1], slots=[48, 49], seq=[0, 0], bt=ok)
    assert np.isfinite(p.get("out")[:32]).all()


def test_attention_bad_config():
    T, slots = 4, 64
    p = Prog(ISA0, 2, T=T, kv_slots=slots, bs=16, B=4, P=slots, S=2)
    for name, n in (("kp", slots * 16), ("vp", slots * 16), ("q", T * 24), ("out", T * 24), ("q8", T * 64)):
        p.buf(name, n=n)

    def att(kvh=2, hd=8, heads=3, pool_rows=slots, **kw):
        fields = dict(q=p.a("q", ROWS_TOKENS, heads * hd), out=p.a("out", ROWS_TOKENS, heads * hd),
                      k_pool=p.a("kp", pool_rows, kvh * hd, group=hd), v_pool=p.a("vp", pool_rows, kvh * hd, group=hd),
                      heads=heads, kv_heads=kvh, head_dim=hd, scale=0.3)
        fields.update(kw)
        p.add("attention", **fields)

    with pytest.raises(ValueError, match="multiple of kv_heads"):
        att(heads=3, kvh=2)
    with pytest.raises(ValueError):  # no kv heads
        att(kvh=0, heads=2)
    with pytest.raises(ValueError, match="kv_slots"):  # a pool of another size than the executor's
        att(heads=2, kvh=1, pool_rows=slots // 2)
    with pytest.raises(ValueError, match="out of its buffer"):  # pools sized for kv_dim 16, not 32
        att(heads=4, kvh=4)
    # quantize-on-write: a Q8_ACT output whose group is a multiple of 8 dividing head_dim
    with pytest.raises(ValueError, match="divide head_dim"):
        att(heads=2, kvh=2, qout=p.a("q8", ROWS_TOKENS, 16, "q8_act", group=16))
    with pytest.raises(ValueError, match="multiple of 8"):
        att(heads=2, kvh=1, hd=12, qout=p.a("q8", ROWS_TOKENS, 24, "q8_act", group=12))
    with pytest.raises(ValueError, match="cannot hold"):  # Q8_ACT without a group
        att(heads=2, kvh=2, qout=p.a("q8", ROWS_TOKENS, 16, "q8_act", group=0))
    assert p.ex.num_ops == 0
    att(heads=2, kvh=2, qout=p.a("q8", ROWS_TOKENS, 16, "q8_act", group=8))
    assert p.ex.num_ops == 1
    # Scratch smaller than the context needs: the executor grows it when the op
    # is added (counted as an allocation), never inside a step.
    q = Prog(ISA0, 1, T=1, kv_slots=64, bs=16, B=4, P=64, scratch=63)
    q.buf("a", n=64 * 8)
    before = q.ex.allocations
    q.add("attention", q=q.a("a", ROWS_TOKENS, 8), out=q.a("a", ROWS_TOKENS, 8), k_pool=q.a("a", 64, 8, group=8),
          v_pool=q.a("a", 64, 8, group=8), heads=1, kv_heads=1, head_dim=8, scale=0.3)
    assert q.ex.allocations == before + 1


def test_n_out_and_step_sizes():
    T, O, n = 6, 3, 8
    p = Prog(ISA0, 2, T=T, O=O)
    p.buf("x", np.zeros((T, n))), p.buf("out", n=O * n)
    p.add("gather", x=p.a("x", ROWS_TOKENS, n), out=p.a("out", ROWS_OUT, n))
    with pytest.raises(ValueError, match="output row count"):
        p.run(5, out_rows=[0, 1, 2, 3])  # n_out > max_out
    with pytest.raises(ValueError, match="output row count"):
        p.run(2, out_rows=[0, 1, 1])  # n_out > n_tokens
    for bad in (2, -1):
        with pytest.raises(ValueError, match="output row"):
            p.run(2, out_rows=[0, bad])
    with pytest.raises(ValueError, match="token count"):
        p.run(T + 1)
    with pytest.raises(ValueError, match="token count"):
        p.ex.run(*(np.zeros(0, np.int32),) * 4, i32(np.zeros((1, 1))), np.zeros(0, np.int32))
    with pytest.raises(ValueError, match="differ in length"):
        p.ex.run(*(np.zeros(2, np.int32),) * 3, np.zeros(3, np.int32), i32(np.zeros((1, 1))),
                 np.zeros(0, np.int32))
    p.run(2, out_rows=[1, 0])


def test_operand_past_buffer_end():
    T, n = 4, 8
    p = Prog(ISA0, 1, T=T)
    p.buf("a", n=T * n)
    p.buf("big", n=T * n + 4)
    a = p.a("a", ROWS_TOKENS, n)

    def big(offset, rows=ROWS_TOKENS):
        return p.a("big", rows, n, offset=offset)

    absent = ops.Ref()
    other = ops.Ref.in_buffer(99, 0, ops.DType.F32, ROWS_TOKENS, n)
    for fields, why in ((dict(a=big(20), b=a, out=a), "out of its buffer"),  # ends one float past the end
                        (dict(a=a, b=big(64), out=a), "out of its buffer"),  # twelve floats past
                        (dict(a=a, b=a, out=big(4 * (T * n + 4))), "out of its buffer"),  # starts at the end
                        (dict(a=a, b=a, out=big(-4)), "out of its buffer"),  # negative offset
                        (dict(a=a, b=a, out=big(2)), "out of its buffer"),   # misaligned offset
                        (dict(a=a, b=a, out=other), "no such buffer"),
                        (dict(a=a, b=absent, out=a), "b is required"),
                        (dict(a=a, b=a, out=big(0, rows=-3)), "row count")):
        with pytest.raises(ValueError, match=why):
            p.add("add", **fields)
    p.add("add", a=big(16), b=a, out=a)  # exactly fits
    assert p.ex.num_ops == 1


@pytest.mark.parametrize("dtype", FLOAT_TYPES + QUANT_TYPES)
def test_weight_too_small(dtype):
    N, K = 5, 96
    W = make_table(dtype, N, K, rng("small", dtype))
    p = Prog(ISA0, 1, T=2, scratch=K)
    p.buf("x", n=2 * K), p.buf("out", n=2 * N)
    x, out = p.a("x", ROWS_TOKENS, K), p.a("out", ROWS_TOKENS, N)
    with pytest.raises(ValueError, match="too small"):
        p.add("matmul", x=x, w=p.w(W.ravel()[:-1], dtype, N, K), out=out)
    with pytest.raises(ValueError, match="too small"):
        p.add("matmul", x=x, w=p.w(W, dtype, N + 1, K), out=p.a("out", ROWS_TOKENS, N + 1))
    with pytest.raises(ValueError, match="w is required"):
        p.add("matmul", x=x, out=out)
    with pytest.raises(ValueError, match="columns"):  # out declared for another N
        p.add("matmul", x=x, w=p.w(W, dtype, N, K), out=p.a("out", ROWS_TOKENS, N - 1))
    # K beyond the per-thread scratch: grown when the op is added, once
    before = p.ex.allocations
    p.add("matmul", x=x, w=p.w(W, dtype, N, K), out=out)
    assert p.ex.allocations == before + 1


@pytest.mark.parametrize("dtype", QUANT_TYPES)
def test_quant_k_not_multiple_of_32(dtype):
    K = 48
    W = np.zeros(10 * 4 * K, np.uint8)  # plenty of bytes
    p = Prog(ISA0, 1, T=2, scratch=64)
    p.buf("x", n=2 * K), p.buf("out", n=2 * 64)
    with pytest.raises(ValueError, match="32"):
        p.add("matmul", x=p.a("x", ROWS_TOKENS, K), w=p.w(W, dtype, 4, K), out=p.a("out", ROWS_TOKENS, 4))
    with pytest.raises(ValueError, match="32"):
        p.add("embed", table=p.w(W, dtype, 4, K), out=p.a("out", ROWS_TOKENS, K))
    with pytest.raises(ValueError):
        ops.row_bytes(dtype, K)


def test_unknown_types_fields_and_negative_sizes():
    p = Prog(ISA0, 1, T=2, scratch=64)
    p.buf("a", n=2 * 64)
    a = p.a("a", ROWS_TOKENS, 8)
    W = np.zeros((4, 64), np.float32)
    with pytest.raises(AttributeError):  # a field the op does not have
        p.add("add", a=a, b=a, out=a, x=a)
    bad_type = ops.Ref.in_buffer(p.ids["a"], 0, ops.DType.F32, ROWS_TOKENS, 8)
    bad_type.dtype = 12345
    with pytest.raises(ValueError, match="unknown storage type"):
        p.add("add", a=bad_type, b=a, out=a)
    with pytest.raises(ValueError, match="storage type"):  # int32 rows are no weights
        p.add("matmul", x=p.a("a", ROWS_TOKENS, 64), w=p.w(W.view(np.int32), "i32", 4, 64), out=a)
    with pytest.raises(ValueError, match="cannot hold"):  # packed weights need a group
        p.add("matmul", x=p.a("a", ROWS_TOKENS, 64), w=p.w(np.zeros(4096, np.uint8), "pk_i4s", 16, 64), out=a)
    with pytest.raises(ValueError):
        p.add("add", a=p.a("a", ROWS_TOKENS, -8), b=a, out=a)
    with pytest.raises(ValueError, match="row count"):
        p.add("add", a=p.a("a", -3, 8), b=a, out=a)
    with pytest.raises(ValueError, match="no conversion"):  # a Ref is never built on a temporary conversion
        ops.Ref.from_array([1.0, 2.0], ops.DType.F32, 1, 2)
    with pytest.raises(ValueError, match="no conversion"):  # nor from a strided view (it would copy)
        ops.Ref.from_array(W[:, :32], ops.DType.F32, 4, 32)
    with pytest.raises(ValueError, match="epilogue"):
        p.add("matmul", x=p.a("a", ROWS_TOKENS, 64), w=p.w(W, "f32", 4, 64), out=p.a("a", ROWS_TOKENS, 4),
              residual=p.a("a", ROWS_TOKENS, 4))  # a residual without the RESIDUAL epilogue
    assert p.ex.num_ops == 0


# Inputs that once crashed the process instead of raising (fixed in
# executor.cpp: positive sizes and overflow-checked extents). Run in a child
# process so a regression fails one test, not the session.
_CRASHERS = {
    # embed with dim 0: the executor once divided the table size by row_bytes(.., 0) == 0 (SIGFPE)
    "embed_dim0": ("p.add('embed', table=p.w(np.zeros(16, np.float32), 'f32', 4, 0),"
                   " out=p.a('b', -1, 0))"),
    # a constant row count so large that the extent M*K*4 wrapped to 0 in int64: accepted, then
    # the kernel walked 2**62 rows at run (SIGSEGV)
    "rows_overflow": ("r = p.a('b', 2**62, 1); p.add('add', a=r, b=r, out=r); p.run(1)"),
    # the same wrap-around hid a weight far too small: N*row_bytes and T*N*4 both wrapped to 0
    "matmul_n_overflow": ("p.add('matmul', x=p.a('b', -1, 16), w=p.w(np.zeros(16, np.float32), 'f32', 2**60, 16),"
                          " out=p.a('b', -1, 2**60)); p.run(1)"),
    "packed_group_overflow": ("p.add('matmul', x=p.a('b', -1, 64), w=p.w(np.zeros(64, np.uint8), 'pk_i8', 16, 64,"
                              " 2**62), out=p.a('b', -1, 16)); p.run(1)"),
}


@pytest.mark.parametrize("case", sorted(_CRASHERS))
def test_boundary_input_never_crashes(case):
    code = textwrap.dedent(f"""
        import numpy as np, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_kernels import Prog
        p = Prog("ref", 1, T=4, scratch=64)
        p.buf("b", n=1024)
        try:
            {_CRASHERS[case]}
        except ValueError:
            sys.exit(0)
        sys.exit(3)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert r.returncode == 0, f"rc={r.returncode} (negative: killed by signal) {r.stderr.decode()[-500:]}"


# ------------------------------------------------------------------ bias in every epilogue


def _weight_case(kind, N, K, g):
    """(raw storage, storage type, group, matmul kwargs, float64 values) of an
    [N, K] weight: f32 and q4_1 rows (the float path), pk_i4a packed with int8
    activations (a8) or float ones (a16)."""
    from llamajet.formats.packed import dequantize, quantize_rtn

    if kind in ("f32", "q4_1"):
        raw = make_table(kind, N, K, g)
        return raw, kind, 0, {}, ref.dequantize(raw, kind, (N, K))
    pw = quantize_rtn("w", g.standard_normal((N, K)).astype(np.float32), "int4_asym_g32")
    return pw.data, "pk_i4a", pw.group, {"float_act": kind == "pk_a16"}, dequantize(pw)


def _tile_interleave(a, b):
    """Rows (float storage) or tiles (packed storage, [tiles, groups, bytes])
    of a and b alternating, 16 rows at a time: what gate/up stacking does."""
    if a.ndim == 3:
        return np.stack([a, b], 1).reshape(-1, *a.shape[1:])
    return np.stack([a.reshape(-1, 16, *a.shape[1:]), b.reshape(-1, 16, *b.shape[1:])], 1).reshape(-1, *a.shape[1:])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ("f32", "q4_1", "pk_a8", "pk_a16"))
def test_bias_in_every_epilogue_equals_the_unfused_ops(isa, kind):
    """The bias is added to a finished tile before any epilogue, so each fused
    epilogue with a bias gives the bits of the unfused ops (matmul + bias,
    then add / swiglu / rope): RESIDUAL, SWIGLU, QKV. STORE + bias is within
    the matmul bound (plus one addition) of numpy's (the a8 path rounds the
    activations to int8 first: its own reference is in test_packed.py)."""
    g = rng("bias", isa, kind)
    M, K, hd, H, KVH, P = 7, 96, 16, 2, 1, 32
    F, N, D = 32, H * hd + 2 * KVH * hd, 64  # gate/up rows (two tiles each), qkv rows, o-proj rows
    x = g.standard_normal((M, K)).astype(np.float32)
    res = g.standard_normal((M, D)).astype(np.float32)
    pos = g.integers(0, P, size=M)
    cos, sin = rope_tables(hd, P)
    p = Prog(isa, 2, T=M, P=P, B=2, kv_slots=P, scratch=K)
    p.buf("x", x), p.buf("res", res)
    for name, n in (("o", D), ("r_unfused", D), ("r_fused", D), ("g", F), ("u", F), ("s_unfused", F),
                    ("s_fused", F), ("q", H * hd), ("k", KVH * hd), ("v", KVH * hd), ("qr", H * hd),
                    ("kr", KVH * hd), ("fq", H * hd), ("fk", KVH * hd), ("fv", KVH * hd)):
        p.buf(name, n=M * n)
    act = lambda name, n: p.a(name, ROWS_TOKENS, n)  # noqa: E731

    def mm(raw, dt, grp, kw, n, b, out, cols=None, **more):
        p.add("matmul", x=act("x", K), w=p.w(raw, dt, n, K, grp), out=act(out, cols or n), bias=p.w(b, "f32", 1, n),
              **kw, **more)

    # STORE, and RESIDUAL against matmul + add
    raw, dt, grp, kw, wf = _weight_case(kind, D, K, g)
    b = (g.standard_normal(D) * 3).astype(np.float32)
    mm(raw, dt, grp, kw, D, b, "o")
    p.add("add", a=act("res", D), b=act("o", D), out=act("r_unfused", D))
    mm(raw, dt, grp, kw, D, b, "r_fused", epilogue=ops.Epilogue.RESIDUAL, residual=act("res", D))
    # SWIGLU against gate, up (each with its bias) + swiglu; stacked in alternating 16-row tiles
    rg, ru = _weight_case(kind, F, K, g)[0], _weight_case(kind, F, K, g)[0]
    bg, bu = (g.standard_normal(F).astype(np.float32) for _ in range(2))
    mm(rg, dt, grp, kw, F, bg, "g")
    mm(ru, dt, grp, kw, F, bu, "u")
    p.add("swiglu", gate=act("g", F), up=act("u", F), out=act("s_unfused", F))
    mm(_tile_interleave(rg, ru), dt, grp, kw, 2 * F, _tile_interleave(bg, bu), "s_fused", cols=F,
       epilogue=ops.Epilogue.SWIGLU)
    # QKV against q, k, v (each with its bias) + rope of q and k (interleaved pairs)
    parts = [_weight_case(kind, n, K, g)[0] for n in (H * hd, KVH * hd, KVH * hd)]
    bq, bk, bv = (g.standard_normal(n).astype(np.float32) for n in (H * hd, KVH * hd, KVH * hd))
    tables = dict(cos=p.w(cos, "f32", *cos.shape), sin=p.w(sin, "f32", *sin.shape))
    for r, bb, out in zip(parts, (bq, bk, bv), ("q", "k", "v")):
        mm(r, dt, grp, kw, len(bb), bb, out)
    for src, dst, heads in (("q", "qr", H), ("k", "kr", KVH)):
        p.add("rope", x=act(src, heads * hd), out=act(dst, heads * hd), heads=heads, head_dim=hd, interleaved=True,
              **tables)
    mm(np.concatenate(parts, 0), dt, grp, kw, N, np.concatenate([bq, bk, bv]), "fq", cols=H * hd,
       epilogue=ops.Epilogue.QKV, head_dim=hd, k_out=act("fk", KVH * hd), v_out=act("fv", KVH * hd), **tables)
    p.run(M, positions=pos, bt=np.zeros((1, 2)))  # block tables reach the positions (no attention here)
    for fused, unfused in (("r_fused", "r_unfused"), ("s_fused", "s_unfused"), ("fq", "qr"), ("fk", "kr"),
                           ("fv", "v")):
        assert_bits_equal(p.get(fused), p.get(unfused))
    if kind != "pk_a8":
        want = ref.matmul(x, wf, b)
        atol = 2 * (K + 2) * U * (np.abs(x).astype(np.float64) @ np.abs(wf).T) + 2 * U * np.abs(want)
        assert_close(p.get("o", (M, D)), want, atol, f"matmul + bias {kind}")
