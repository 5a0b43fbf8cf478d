"""Packed weight formats: layout, lossless GGUF repacking, and the W*A8 / W*A16
matmul and packed-embedding kernels on every ISA against numpy references."""

from __future__ import annotations

import numpy as np
import pytest

from llamajet import ops
from llamajet.formats.gguf_blocks import repack_gguf, repack_gguf_reference
from llamajet.formats.packed import (dequantize, matmul_a8_reference, pack, quantize_activations,
                                     quantize_rtn, unpack)
from llamajet.formats.schemes import get_scheme, schemes
from llamajet.formats.weight import Kind, Weight

TILE_ROWS = ops.TILE

gguf = pytest.importorskip("gguf")

SCHEMES = [s for s in schemes() if s.rtn]  # RTN targets; the GGUF twins are tested below
ISAS = ops.supported_isas()


def _exe(isa, nth, T, scratch=1 << 20):
    return ops.Executor(isa=isa, n_threads=nth, max_tokens=T, max_out=T, max_seqs=1, max_blocks=1,
                        kv_slots=16, block_size=16, max_pos=1, scratch_floats=scratch)


def _run_matmul(isa, nth, x, pw, a16, bias=None):
    M, K = x.shape
    N = pw.shape[0]
    ex = _exe(isa, nth, M)
    xb, ob = ex.alloc_buffer(4 * M * K), ex.alloc_buffer(4 * M * N)
    ex.buffer(xb).view(np.float32)[:] = x.ravel()
    ex.buffer(ob).view(np.float32)[:] = np.nan  # every output must be written
    p = ops.OPS["matmul"]()
    p.x = ops.Ref.in_buffer(xb, 0, ops.DType.F32, ops.ROWS_TOKENS, K)
    p.w = ops.Ref.from_array(pw.data, ops.dtype(pw.dtype), N, K, pw.group)
    p.out = ops.Ref.in_buffer(ob, 0, ops.DType.F32, ops.ROWS_TOKENS, N)
    p.float_act = a16
    if bias is not None:
        p.bias = ops.Ref.from_array(bias, ops.DType.F32, 1, N)
    ex.add(p)
    z = np.zeros(M, np.int32)
    ex.run(z, z, z, z, np.zeros((1, 1), np.int32), np.zeros(0, np.int32))
    return ex.buffer(ob).view(np.float32).reshape(M, N).copy()


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_pack_roundtrip_and_rtn_rounding_rule(scheme):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(37, 172)).astype(np.float32)  # N and K not multiples of 16 / the groups
    pw = quantize_rtn("w", w, scheme)
    codes, d, m = unpack(pw)
    assert pack("w", scheme, pw.shape, codes, d, m).data.tobytes() == pw.data.tobytes()
    deq = dequantize(pw)
    # RTN error is at most half a step (|d|) per element, except int4 sym,
    # whose code range -8..7 clips the side opposite the largest element at
    # 7|d| while that side may reach 8|d|: up to a whole step there. (1e-3:
    # the scale is fp16-rounded before the codes are computed.)
    g = pw.group
    step = np.abs(d[:37].astype(np.float64)).repeat(g, axis=1)[:, :172]
    half = 1.0 if scheme.bits == 4 and scheme.symmetric else 0.5
    assert np.all(np.abs(deq - w) <= half * step * (1 + 1e-3) + 1e-6)


@pytest.mark.parametrize("ggml", ["q4_0", "q4_1", "q8_0"])
def test_gguf_blocks_repack_without_loss(ggml):
    rng = np.random.default_rng(1)
    qt = gguf.GGMLQuantizationType[ggml.upper()]
    for n in (48, 40):  # a whole number of 16-row tiles, and a padded last tile
        w = rng.normal(size=(n, 96)).astype(np.float32)
        raw = gguf.quants.quantize(w, qt)
        ref = gguf.quants.dequantize(raw, qt)  # the external reference
        pw = repack_gguf(Weight("w", Kind.MATRIX, ggml, (n, 96), raw))
        np.testing.assert_array_equal(pw.to_f32(), ref)
        if n % TILE_ROWS == 0:  # same bits, same bytes: nothing added, nothing lost
            assert pw.data.nbytes == raw.nbytes


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
@pytest.mark.parametrize("M,N,K", [(1, 40, 172), (7, 33, 96), (83, 64, 576), (5, 16, 1000)])
def test_matmul_a8_matches_reference(isa, scheme, M, N, K):
    rng = np.random.default_rng(M * N + K)
    w = rng.normal(size=(N, K)).astype(np.float32)
    x = rng.normal(size=(M, K)).astype(np.float32) * 3
    pw = quantize_rtn("w", w, scheme)
    ref = matmul_a8_reference(x, pw)  # exact integer dots, float64 scales
    # Integer parts are exact on every ISA; the kernel applies scales and sums
    # the ng groups in fp32: a few roundings per group, bounded by
    # (3 ng + 2) * 2^-24 * sum_g |partial_g| <= (3 ng + 2) u * |x| @ |w|^T.
    bound = (3 * pw.data.shape[1] + 2) * 2.0**-24 * (np.abs(x) @ np.abs(dequantize(pw)).T) * 4 + 1e-30
    for nth in (1, 2):
        got = _run_matmul(isa, nth, x, pw, a16=False)
        assert np.all(np.abs(got - ref) <= bound), np.abs(got - ref).max()
    # with a bias: one more fp32 addition, at most u * |result| (times 2)
    b = rng.normal(size=N).astype(np.float32) * 5
    got = _run_matmul(isa, 2, x, pw, a16=False, bias=b)
    want = ref + b
    assert np.all(np.abs(got - want) <= bound + 2 * 2.0**-24 * np.abs(want)), np.abs(got - want).max()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("scheme", SCHEMES[::3], ids=lambda s: s.name)
@pytest.mark.parametrize("M", [9, 20])  # the register path (<= 16 rows) and the dequantized-group path
def test_matmul_a16_matches_dequantized_reference(isa, scheme, M):
    rng = np.random.default_rng(5)
    N, K = 37, 200
    w = rng.normal(size=(N, K)).astype(np.float32)
    x = rng.normal(size=(M, K)).astype(np.float32)
    pw = quantize_rtn("w", w, scheme)
    ref = x.astype(np.float64) @ dequantize(pw).T
    # fp32 dequantization (one rounding per weight) and a length-K fp32 dot:
    # (K + 3) * 2^-24 * |x| @ |w|^T, times 2 for safety.
    bound = 2 * (K + 3) * 2.0**-24 * (np.abs(x) @ np.abs(dequantize(pw)).T)
    got = _run_matmul(isa, 2, x, pw, a16=True)
    assert np.all(np.abs(got - ref) <= bound)
    b = rng.normal(size=N).astype(np.float32)  # a bias: one more rounding, u * |result| (times 2)
    got_b = _run_matmul(isa, 2, x, pw, a16=True, bias=b)
    assert np.all(np.abs(got_b - (ref + b)) <= bound + 2 * 2.0**-24 * np.abs(ref + b))
    # every row the same bits as computed alone (all rows share each dequantized group)
    alone = np.stack([_run_matmul(isa, 1, x[m : m + 1], pw, a16=True)[0] for m in range(M)])
    np.testing.assert_array_equal(got, alone)


def test_activation_quantization_is_the_documented_rule():
    x = np.array([[0.5, -1.0, 0.25, 2.0, 0.0, 0.0, 0.0, 0.0]], np.float32)
    q, dx, s = quantize_activations(x, 8, 8)
    assert q.tolist() == [[32, -64, 16, 127, 0, 0, 0, 0]]  # rint(x * 127/2), 31.75 -> 32, 15.875 -> 16
    assert dx[0, 0] == np.float32(2.0) / np.float32(127) and s[0, 0] == 111


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("K,G,dt", [(576, 32, "q8_act"), (1536, 32, "q8_act"), (96, 32, "q8_act"), (100, 32, "q8_act"),
                                    (576, 16, "q8_act"), (576, 64, "q8_act"),
                                    (512, 32, "q8_actk"), (1536, 32, "q8_actk"), (768, 16, "q8_actk")])
def test_cpp_activation_quantization_equals_numpy_bit_for_bit(isa, K, G, dt):
    """The kernels' activation quantizer (here through add_rmsnorm's
    quantize-on-write, the same quantize_row the matmuls' input stage runs)
    against quantize_activations on the op's own normalized rows: codes,
    scales and sums bit for bit. K = 576 / 1536 with groups of 32 take the
    AVX-512 batched path (16 groups per batch, 576: a batch of 2 after one of
    16); K = 96 (3 groups, below the batched path's 8), K = 100 (not a
    multiple of G) and G = 16 / 64 the per-group loop. q8_actk (the K-quants'
    input: one scale per 256 values, written into each of the span's groups):
    groups of 32 (Q4_K, Q5_K) and 16 (Q6_K). Then the quantize op (each thread
    a contiguous share of the groups, whole spans for q8_actk) on x: the same bits."""
    span = ops.qact_span(dt, G)
    rng = np.random.default_rng(K + G)
    M = 6
    x = rng.normal(size=(M, K)).astype(np.float32) * np.float32(3.0)
    x[1] = 0.0                        # all-zero row: codes 0, scale 0
    x[2, :G] = 0.0                    # one all-zero group
    x[3] *= np.float32(1e4)           # large values
    x[4, G:2 * G] *= np.float32(1e-6)  # one tiny group next to normal ones
    w = rng.uniform(0.5, 1.5, size=K).astype(np.float32)
    kpad = -(-K // G) * G
    ng = kpad // G
    qbytes = -(-M * kpad // 64) * 64 + 8 * M * ng
    ex = _exe(isa, 2, M)
    xb, hb, qb = ex.alloc_buffer(4 * M * K), ex.alloc_buffer(4 * M * K), ex.alloc_buffer(qbytes)
    ex.buffer(xb).view(np.float32)[:] = x.ravel()
    assert ops.tensor_bytes(dt, M, K, G) == qbytes  # the layout read back below
    p = ops.OPS["add_rmsnorm"]()
    p.x = ops.Ref.in_buffer(xb, 0, ops.DType.F32, ops.ROWS_TOKENS, K)
    p.w = ops.Ref.from_array(w, ops.DType.F32, 1, K)
    p.out = ops.Ref.in_buffer(hb, 0, ops.DType.F32, ops.ROWS_TOKENS, K)
    p.qout = ops.Ref.in_buffer(qb, 0, ops.dtype(dt), ops.ROWS_TOKENS, K, G)
    p.eps = 1e-5
    ex.add(p)
    z = np.zeros(M, np.int32)
    ex.run(z, z, z, z, np.zeros((1, 1), np.int32), np.zeros(0, np.int32))
    h = ex.buffer(hb).view(np.float32).reshape(M, K).copy()
    raw = ex.buffer(qb)
    qoff = -(-M * kpad // 64) * 64
    q = raw[:M * kpad].view(np.int8).reshape(M, kpad)
    dx = raw[qoff:qoff + 4 * M * ng].view(np.float32).reshape(M, ng)
    sq = raw[qoff + 4 * M * ng:qoff + 8 * M * ng].view(np.int32).reshape(M, ng)
    wq, wdx, wsq = quantize_activations(h, G, kpad, span)
    np.testing.assert_array_equal(q, wq)
    np.testing.assert_array_equal(dx.view(np.uint32), wdx.view(np.uint32))
    np.testing.assert_array_equal(sq, wsq)
    assert np.all(q[1] == 0) and np.all(dx[1] == 0)
    # the quantize op (ffn_quant) on x itself, its groups split over 1-3 threads
    wq, wdx, wsq = quantize_activations(x, G, kpad, span)
    for nth in (1, 2, 3):
        ex = _exe(isa, nth, M)
        xb, qb = ex.alloc_buffer(4 * M * K), ex.alloc_buffer(qbytes)
        ex.buffer(xb).view(np.float32)[:] = x.ravel()
        ex.buffer(qb)[:] = 0xA5
        p = ops.OPS["quantize"]()
        p.x = ops.Ref.in_buffer(xb, 0, ops.DType.F32, ops.ROWS_TOKENS, K)
        p.out = ops.Ref.in_buffer(qb, 0, ops.dtype(dt), ops.ROWS_TOKENS, K, G)
        ex.add(p)
        ex.run(z, z, z, z, np.zeros((1, 1), np.int32), np.zeros(0, np.int32))
        raw = ex.buffer(qb)
        np.testing.assert_array_equal(raw[:M * kpad].view(np.int8).reshape(M, kpad), wq)
        np.testing.assert_array_equal(raw[qoff:qoff + 4 * M * ng].view(np.uint32).reshape(M, ng), wdx.view(np.uint32))
        np.testing.assert_array_equal(raw[qoff + 4 * M * ng:qoff + 8 * M * ng].view(np.int32).reshape(M, ng), wsq)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("scheme", SCHEMES[::2], ids=lambda s: s.name)
def test_packed_embedding_rows(isa, scheme):
    rng = np.random.default_rng(2)
    V, D = 50, 172
    pw = quantize_rtn("emb", rng.normal(size=(V, D)).astype(np.float32), scheme)
    tokens = np.array([0, 49, 17, 16, 15, 3], np.int32)
    ex = _exe(isa, 2, len(tokens))
    ob = ex.alloc_buffer(4 * len(tokens) * D)
    p = ops.OPS["embed"]()
    p.table = ops.Ref.from_array(pw.data, ops.dtype(pw.dtype), V, D, pw.group)
    p.out = ops.Ref.in_buffer(ob, 0, ops.DType.F32, ops.ROWS_TOKENS, D)
    ex.add(p)
    z = np.zeros(len(tokens), np.int32)
    ex.run(tokens, z, z, z, np.zeros((1, 1), np.int32), np.zeros(0, np.int32))
    got = ex.buffer(ob).view(np.float32).reshape(len(tokens), D)
    # d*(c-8), d*c+m, d*c in fp32: one or two roundings of values the
    # reference holds in float64.
    np.testing.assert_allclose(got, dequantize(pw)[tokens], rtol=3 * 2.0**-24, atol=1e-7)
    with pytest.raises(ValueError, match="vocabulary"):
        ex.run(np.array([V] * len(tokens), np.int32), z, z, z, np.zeros((1, 1), np.int32), np.zeros(0, np.int32))


def test_packed_refusals():
    ex = _exe("ref", 1, 4)
    b = ex.alloc_buffer(4096)
    pw = quantize_rtn("w", np.ones((16, 64), np.float32), "int4_sym_g32")

    big = np.zeros(8192, np.uint8)  # holds any of the weights below

    def mm(n=16, group=32, data=pw.data, **kw):
        p = ops.OPS["matmul"]()
        p.x = ops.Ref.in_buffer(b, 0, ops.DType.F32, ops.ROWS_TOKENS, 64)
        p.w = ops.Ref.from_array(data, ops.DType.PK_I4S, n, 64, group)
        p.out = ops.Ref.in_buffer(b, 0, ops.DType.F32, ops.ROWS_TOKENS, n)
        for k, v in kw.items():
            setattr(p, k, v)
        return p

    with pytest.raises(ValueError, match="group"):  # group not a multiple of 8
        ex.add(mm(group=12, data=big))
    with pytest.raises(ValueError, match="too small"):  # packed data shorter than N, K, G imply
        ex.add(mm(n=32))
    q8 = ops.Ref.in_buffer(b, 1024, ops.DType.Q8_ACT, ops.ROWS_TOKENS, 64, 32)
    with pytest.raises(ValueError, match="pre-quantized"):  # float activations cannot take int8 input
        ex.add(mm(x=ops.Ref(), qin=q8, prologue=ops.Prologue.PREQUANT, float_act=True))
    with pytest.raises(ValueError, match="qin needs"):  # an int8 input without its prologue
        ex.add(mm(qin=q8))
    with pytest.raises(ValueError, match="group"):  # int8 input in another group than the weights'
        ex.add(mm(x=ops.Ref(), qin=ops.Ref.in_buffer(b, 1024, ops.DType.Q8_ACT, ops.ROWS_TOKENS, 64, 16),
                  prologue=ops.Prologue.PREQUANT))
    assert ex.num_ops == 0
    tiny = _exe("ref", 1, 64, scratch=64)  # scratch grows when an op is added, to what it needs
    tb = tiny.alloc_buffer(1 << 16)
    before = tiny.allocations
    p = mm()
    p.x = ops.Ref.in_buffer(tb, 0, ops.DType.F32, ops.ROWS_TOKENS, 64)
    p.out = ops.Ref.in_buffer(tb, 0, ops.DType.F32, ops.ROWS_TOKENS, 16)
    tiny.add(p)
    assert tiny.allocations == before + 1
    assert TILE_ROWS == ops.TILE == 16


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_cpp_quantize_and_dequantize_equal_numpy_bit_for_bit(isa, scheme):
    rng = np.random.default_rng(11)
    # odd shapes; ties of the rounding rule (x*inv exactly .5) come from the
    # integer-valued rows; a zero row and a constant row give zero scales
    w = (rng.normal(size=(37, 172)) * rng.uniform(0.01, 10, size=(37, 1))).astype(np.float32)
    w[3] = np.round(w[3] * 4) / 4
    w[5] = 0.0
    w[6] = 1.5
    ref = quantize_rtn("w", w, scheme)
    for nth in (1, 2):
        got = ops.quantize_packed(scheme.kind, ref.group, w, isa=isa, n_threads=nth)
        assert got.shape == ref.data.shape
        assert got.tobytes() == ref.data.tobytes()
    deq = ops.dequantize_packed(scheme.kind, ref.group, ref.shape, ref.data, isa=isa, n_threads=2)
    # products of an fp16 scale and a small integer are exact in fp32 and the
    # asymmetric sum is rounded once either way: bit-equal to float64 -> fp32
    np.testing.assert_array_equal(deq, dequantize(ref).astype(np.float32))


@pytest.mark.parametrize("k", [1032, 1536, 8200])
def test_per_channel_int8_on_rows_wider_than_1024(k):
    """int8_pc's group is the whole row: K past 1024 (SmolLM2's ffn_down has 1536, Llama-3's 8192/14336)
    quantizes in C++ as numpy does, dequantizes back, and multiplies as the exact-integer reference."""
    from llamajet.formats.packed import matmul_a8_reference

    scheme = get_scheme("int8_pc")
    w = np.random.default_rng(k).normal(size=(21, k)).astype(np.float32)
    ref = quantize_rtn("w", w, scheme)
    assert ref.group == -(-k // 8) * 8
    got = ops.quantize_packed(scheme.kind, ref.group, w, n_threads=2)
    assert got.tobytes() == ref.data.tobytes()
    deq = ops.dequantize_packed(scheme.kind, ref.group, ref.shape, ref.data, n_threads=2)
    np.testing.assert_array_equal(deq, dequantize(ref).astype(np.float32))
    assert np.abs(deq - w).max() <= np.abs(w).max(axis=1).max() / 127  # half a step of the largest row, twice
    x = np.random.default_rng(1).normal(size=(3, k)).astype(np.float32)
    want = matmul_a8_reference(x, ref)  # exact integer dots: one group per row, so one fp32 scaling
    for isa in ISAS:
        for a16 in (False, True):
            got = _run_matmul(isa, 2, x, ref, a16=a16)
            if a16:  # float activations: vs the dequantized weights in float64
                np.testing.assert_allclose(got, x.astype(np.float64) @ deq.T.astype(np.float64),
                                           rtol=1e-4, atol=1e-3 * np.sqrt(k))
            else:
                bound = 8 * 2.0**-24 * (np.abs(x) @ np.abs(deq).T) + 1e-30
                assert np.all(np.abs(got - want) <= bound), (isa, np.abs(got - want).max())


def test_cpp_quantize_refusals():
    w = np.ones((16, 64), np.float32)
    with pytest.raises(ValueError, match="group"):
        ops.quantize_packed("pk_i4s", 12, w)
    with pytest.raises(ValueError, match="size"):
        ops.dequantize_packed("pk_i8", 32, (16, 64), np.zeros(10, np.uint8))
    with pytest.raises(ValueError, match="unknown storage type"):
        ops.quantize_packed("q4_7", 32, w)
    with pytest.raises(ValueError, match="packed kind"):
        ops.quantize_packed("q4_0", 32, w)


WIDE = [i for i in ISAS if i in ("avx512", "amx")]


@pytest.mark.skipif(not WIDE, reason="no AVX-512 tier on this CPU")
@pytest.mark.parametrize("isa", WIDE)
@pytest.mark.parametrize("scheme", [s for s in SCHEMES if s.name in
                                    ("int4_sym_g32", "int4_asym_g32", "int4_asym_g16", "int4_asym_g128",
                                     "int8_g32", "int8_g64", "int8_g128", "int8_pc")], ids=lambda s: s.name)
def test_matmul_a8_rows_do_not_depend_on_batch_or_path(isa, scheme):
    """A row's W*A8 result is the same bits whichever row block computes it:
    alone (M = 1, vpdpbusd), in 8- and 4-row blocks, or in a 16-row AMX tile
    (amx tier: rows [0, 32) here, the other 3 on the vpdpbusd path), and the
    same on the avx512 and amx tiers — what batched == alone generation rests on.
    M = 19 is one AMX row block, whose groups are unpacked (int8: copied) one
    at a time into a ring instead of the whole tile at once (K = 1536: 48
    groups of 32; groups of 128 take the whole tile).
    The values themselves are checked against numpy in the test above."""
    rng = np.random.default_rng(11)
    N = 48
    for M, K in ((35, 576), (19, 1536)):
        w = rng.normal(size=(N, K)).astype(np.float32)
        x = (rng.normal(size=(M, K)) * 3).astype(np.float32)
        pw = quantize_rtn("w", w, scheme)
        b = rng.normal(size=N).astype(np.float32)  # the bias rides along: same bits either way
        got = _run_matmul(isa, 2, x, pw, a16=False, bias=b)
        alone = np.stack([_run_matmul(isa, 1, x[m : m + 1], pw, a16=False, bias=b)[0] for m in range(M)])
        np.testing.assert_array_equal(got, alone)
        if isa != WIDE[0]:
            np.testing.assert_array_equal(got, _run_matmul(WIDE[0], 2, x, pw, a16=False, bias=b))


# ---------------------------------------------------------------- GGUF twins

GGUF_TYPES = ["q4_0", "q4_1", "q8_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"]
_FP16_FIELDS = {"q4_0": [0], "q4_1": [0, 2], "q8_0": [0], "q5_0": [0], "q5_1": [0, 2], "q4_k": [0, 2],
                "q5_k": [0, 2], "q6_k": [208]}  # byte offsets of each block's fp16 scales


def gguf_blocks(name, n, k, seed=0):
    """Random but valid GGUF blocks [n, row bytes]: every code and 6-bit scale
    pattern (random bytes), fp16 scales of either sign in [1e-3, 1)."""
    rng = np.random.default_rng(seed)
    qt = gguf.GGMLQuantizationType[name.upper()]
    qk, bb = gguf.GGML_QUANT_SIZES[qt]
    b = rng.integers(0, 256, (n, k // qk, bb), dtype=np.uint8)
    for o in _FP16_FIELDS[name]:
        v = (rng.uniform(1e-3, 1, (n, k // qk)) * rng.choice([-1, 1], (n, k // qk))).astype(np.float16)
        b[..., o : o + 2] = v.view(np.uint8).reshape(n, k // qk, 2)
    return b.reshape(n, -1), qt


def _twin(name, n, k, seed=0):
    raw, qt = gguf_blocks(name, n, k, seed)
    return repack_gguf(Weight("w", Kind.MATRIX, name, (n, k), raw)), raw, qt


@pytest.mark.parametrize("name", GGUF_TYPES)
def test_gguf_twins_dequantize_as_gguf_bit_for_bit(name):
    """The packed twin holds exactly the file's values: numpy and C++ (every
    tier) dequantization equal gguf.quants.dequantize bit for bit, on ragged
    row counts (a padded last tile) and several blocks per row."""
    for n, k in ((37, 512), (16, 256), (5, 768)):
        pw, raw, qt = _twin(name, n, k, seed=n + k)
        ref = gguf.quants.dequantize(raw, qt).reshape(n, k).astype(np.float32)
        np.testing.assert_array_equal(pw.to_f32().view(np.uint32), ref.view(np.uint32))
        for isa in ISAS:
            got = ops.dequantize_packed(pw.code, pw.group, (n, k), pw.data, isa=isa, n_threads=2)
            np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("name", GGUF_TYPES)
def test_cpp_repack_equals_the_numpy_specification(name):
    """The C++ repack (threaded, from the file's bytes) writes the bytes the
    numpy decode + pack_parts specification does, also into a strided
    destination (the tiles of a stacked / interleaved matrix)."""
    for n, k in ((37, 512), (16, 256), (5, 768)):
        raw, _ = gguf_blocks(name, n, k, seed=7)
        w = Weight("w", Kind.MATRIX, name, (n, k), raw)
        ref = repack_gguf_reference(w)
        for nth in (1, 2):
            assert repack_gguf(w, n_threads=nth).data.tobytes() == ref.data.tobytes()
        tb = ref.data[0].nbytes
        out = np.full((2 * ref.data.shape[0], *ref.data.shape[1:]), 0xAB, np.uint8)
        repack_gguf(w, out=out, offset=tb, tile_stride=2 * tb)  # every other tile, from the second
        assert out[1::2].tobytes() == ref.data.tobytes() and (out[0::2] == 0xAB).all()
    with pytest.raises(ValueError, match="too small"):
        ops.repack_gguf(name, raw, (5, 768), np.zeros(10, np.uint8))
    with pytest.raises(ValueError, match="source size"):
        ops.repack_gguf(name, raw[:4], (5, 768), np.zeros(10**6, np.uint8))


@pytest.mark.parametrize("name", GGUF_TYPES)
def test_gguf_twins_stay_compact(name):
    """Bytes the kernels read per weight, against the file's: within 3% (Q4_K's
    6-bit scales are bytes here: +2.8%; Q5_K +2.3%; the others are equal)."""
    pw, raw, _ = _twin(name, 64, 1024)
    ratio = pw.data.nbytes / raw.nbytes
    assert 1.0 <= ratio <= 1.03, ratio
    if name in ("q4_0", "q4_1", "q8_0", "q5_0", "q5_1", "q6_k"):
        assert ratio == 1.0


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", GGUF_TYPES[3:])
@pytest.mark.parametrize("M", [1, 7, 19])
def test_gguf_twins_matmul_a8_matches_reference(isa, name, M):
    n, k = 37, 512
    pw, _, _ = _twin(name, n, k, seed=M)
    x = (np.random.default_rng(M).normal(size=(M, k)) * 3).astype(np.float32)
    ref = matmul_a8_reference(x, pw)
    deq = dequantize(pw)
    ng = k // pw.group
    bound = (3 * ng + 2) * 2.0**-24 * (np.abs(x) @ np.abs(deq).T) * 4 + 1e-30  # as test_matmul_a8_matches_reference
    for nth in (1, 2):
        got = _run_matmul(isa, nth, x, pw, a16=False)
        assert np.all(np.abs(got - ref) <= bound), np.abs(got - ref).max()
    # and the result is the float product up to the activations' int8 rounding
    exact = x.astype(np.float64) @ deq.T
    assert np.abs(got - exact).max() <= 0.02 * np.abs(exact).max()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", GGUF_TYPES + ["int4_sym_g128", "int4_asym_g32"])
def test_matmul_a8_at_the_largest_integer_sums(isa, name):
    """Every code at its largest (GGUF blocks of 0xFF bytes besides their fp16 scales; RTN weights
    whose groups hold their maximum) times activations all quantized to +127 or -127: the largest
    partial sums the integer dots make. The AVX2 tier sums vpmaddubsw's int16 pairs in int16 lanes
    for several chunks before widening (vec/avx2.h; tile_a8's bound P); a bound one chunk too large
    wraps a lane here and misses the reference by its whole scale."""
    n, k = 37, 1024
    if name.startswith("int4"):
        w = np.ones((n, k), np.float32)
        w[:, ::32] = -1.0  # asymmetric groups need a spread: codes 15 and 0
        pw = quantize_rtn("w", w, get_scheme(name))
    else:
        raw, qt = gguf_blocks(name, n, k, seed=3)
        qk, bb = gguf.GGML_QUANT_SIZES[qt]
        b = raw.reshape(n, k // qk, bb)
        keep = np.zeros(bb, bool)
        for o in _FP16_FIELDS[name]:
            keep[o : o + 2] = True
        b[..., ~keep] = 0xFF
        pw = repack_gguf(Weight("w", Kind.MATRIX, name, (n, k), b.reshape(n, -1)))
    deq = dequantize(pw)
    for sign in (1.0, -1.0):
        x = np.full((3, k), sign, np.float32)
        x[1, ::2] = -sign  # and alternating signs
        ref = matmul_a8_reference(x, pw)
        bound = (3 * (k // pw.group) + 2) * 2.0**-24 * (np.abs(x) @ np.abs(deq).T) * 4 + 1e-30
        for nth in (1, 2):
            got = _run_matmul(isa, nth, x, pw, a16=False)
            assert np.all(np.abs(got - ref) <= bound), np.abs(got - ref).max()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", GGUF_TYPES[3:])
def test_gguf_twins_matmul_a16_and_embedding(isa, name):
    n, k = 37, 512
    pw, _, _ = _twin(name, n, k, seed=3)
    deq = dequantize(pw)
    x = np.random.default_rng(4).normal(size=(5, k)).astype(np.float32)
    ref = x.astype(np.float64) @ deq.T
    bound = 2 * (k + 3) * 2.0**-24 * (np.abs(x) @ np.abs(deq).T)
    got = _run_matmul(isa, 2, x, pw, a16=True)
    assert np.all(np.abs(got - ref) <= bound)
    # 5 rows: two row blocks and one alone (the AVX-512 tiers' table path), the bits of each row alone
    alone = np.stack([_run_matmul(isa, 1, x[m : m + 1], pw, a16=True)[0] for m in range(len(x))])
    np.testing.assert_array_equal(got, alone)
    tokens = np.array([0, 36, 17, 16, 15, 3], np.int32)
    ex = _exe(isa, 2, len(tokens))
    ob = ex.alloc_buffer(4 * len(tokens) * k)
    p = ops.OPS["embed"]()
    p.table = ops.Ref.from_array(pw.data, pw.code, n, k, pw.group)
    p.out = ops.Ref.in_buffer(ob, 0, ops.DType.F32, ops.ROWS_TOKENS, k)
    ex.add(p)
    z = np.zeros(len(tokens), np.int32)
    ex.run(tokens, z, z, z, np.zeros((1, 1), np.int32), np.zeros(0, np.int32))
    got = ex.buffer(ob).view(np.float32).reshape(len(tokens), k)
    np.testing.assert_array_equal(got, deq[tokens].astype(np.float32))  # the same fp32 operations


@pytest.mark.skipif(not WIDE, reason="no AVX-512 tier on this CPU")
@pytest.mark.parametrize("isa", WIDE)
@pytest.mark.parametrize("name", GGUF_TYPES[3:])
def test_gguf_twins_rows_do_not_depend_on_batch(isa, name):
    """Every row the bits it has alone: 35 rows (on amx, two 16-row tile blocks with the whole
    tile unpacked, then the vpdpbusd rows) and 20 (one block: its groups unpacked one at a time
    into the ring, K = 1536 > 1024), for each kind the amx tier multiplies on tiles (Q4_K too)."""
    pw, _, _ = _twin(name, 48, 1536, seed=9)
    for M in (35, 20):
        x = (np.random.default_rng(M).normal(size=(M, 1536)) * 3).astype(np.float32)
        got = _run_matmul(isa, 2, x, pw, a16=False)
        alone = np.stack([_run_matmul(isa, 1, x[m : m + 1], pw, a16=False)[0] for m in range(len(x))])
        np.testing.assert_array_equal(got, alone)


def test_gguf_twin_refusals():
    pw, _, _ = _twin("q6_k", 16, 256)
    with pytest.raises(ValueError, match="groups of 16"):  # a K-quant's group is its own
        ops.dequantize_packed(pw.code, 32, (16, 256), pw.data)
    with pytest.raises(ValueError, match="RTN"):  # no RTN quantizer writes the twins
        ops.quantize_packed("pk_q4k", 32, np.ones((16, 256), np.float32))
    from llamajet.errors import LlamajetError
    from llamajet.formats.schemes import rtn_scheme

    with pytest.raises(LlamajetError, match="no quantization target"):
        rtn_scheme("gguf_q4_k")


@pytest.mark.parametrize("name", GGUF_TYPES[3:] + ["int4_asym_g32", "int4_sym_g128", "int8_g32"])
def test_packed_columns_are_the_dequantized_values(name):
    """_core.packed_columns (the outlier pass's weight columns) gives each value of the chosen
    columns bit for bit as the numpy dequantization (for the GGUF twins: gguf's own), over
    padded tiles, every group position and super-block; a column outside [0, k) is refused."""
    n, k = 37, 512
    if name in GGUF_TYPES:
        pw, raw, qt = _twin(name, n, k, seed=7)
        ref = gguf.quants.dequantize(raw, qt).reshape(n, k).astype(np.float32)  # the external reference
    else:
        pw = quantize_rtn("w", np.random.default_rng(7).normal(size=(n, k)).astype(np.float32), get_scheme(name))
        ref = dequantize(pw).astype(np.float32)
    cols = np.array([0, 1, 7, 8, 15, 16, 31, 32, 255, 256, 300, 511], np.int64)
    got = ops._core.packed_columns(ops.dtype(pw.dtype), pw.group, n, k, pw.data.reshape(-1), cols)
    np.testing.assert_array_equal(got, ref[:, cols])
    with pytest.raises(ValueError, match="outside"):
        ops._core.packed_columns(ops.dtype(pw.dtype), pw.group, n, k, pw.data.reshape(-1), np.array([k], np.int64))
    with pytest.raises(ValueError, match="size"):
        ops._core.packed_columns(ops.dtype(pw.dtype), pw.group, n + 16, k, pw.data.reshape(-1), cols)
