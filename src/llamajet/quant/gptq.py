"""GPTQ (Frantar et al., 2022): quantize a linear layer's weights column by
column, each column's rounding error spread over the columns not yet
quantized through the inverse Hessian of the layer's calibration inputs.

For W [N, K] and calibration inputs X [T, K] (rows are tokens), the layer's
loss is ||W X^T - Ŵ X^T||^2, whose Hessian in each row of W is H = 2 X^T X.
With H^-1 = U^T U (U upper triangular, the Cholesky factor of H^-1), column
j quantized to q_j leaves the error e = (w_j - q_j) / U_jj, and the columns
after j absorb -e U_j,j+1: (the optimal update for the remaining ones).
Columns go in lazy blocks of 128: inside a block the update is applied
column by column, the rest of the matrix gets one rank-128 update per block.
Damping adds 1% of the mean diagonal to H (dead inputs, whose diagonal is
0, get weight 0 and a unit diagonal). Inside a block the updates are lazy
again, by sub-blocks of 16 columns. The weights being updated, H's
factorization and the updates are float32, as in GPTQ's reference code;
each column's rounding is computed in float64 (gptq_quantize's docstring has
the measurements).

Groups: each group of `g` columns gets its scale (and min) by the scheme's
own RTN rule (formats/packed.py: sym: the largest-magnitude value maps to
code -8; asym: [min, max] over 15 steps; both fp16) or, with `search`, that
rule's range shrunk by the factor of least rounding error, each column
weighted by H_jj (group_params); computed when the
group's first column is reached, from the columns as GPTQ has updated them.
act_order (quantize columns by decreasing H_jj, the most salient first)
visits columns out of order, so there every group's scales are fixed up
front from the original weights ("static groups"), which keeps the packed
layout (groups of consecutive columns) unchanged.

The result is packed in the scheme's own layout, so `LLM` runs it with the
ordinary kernels and nothing is re-quantized at load.
"""

from __future__ import annotations

import numpy as np

from llamajet.formats.packed import F16, T, _geometry, pack, rtn_scales
from llamajet.formats.schemes import QuantScheme
from llamajet.formats.weight import Kind, Weight
from llamajet.quant.calibrate import Inputs, Method

SHRINK = np.linspace(1.0, 0.7, 13)  # range shrink factors the scale search tries
SUB = 16  # columns per sub-block of GPTQ's lazy updates inside a block (gptq_quantize)


def group_params(x: np.ndarray, scheme: QuantScheme, search: bool = False,
                 h: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """fp16 scale d (and min m) of each row of x [N, g] by the scheme's RTN
    rule; with `search`, the rule's range shrunk by the factor (1 .. 0.7)
    whose rounding error sum_j h_j (x_j - q_j)^2 is least, row by row
    (clipping a few outliers buys finer steps for the rest). h: each
    column's weight, GPTQ's diag(H) = 2 sum x_j^2 over the calibration
    tokens (the output error a column's rounding alone causes); None: 1.
    Weighting by H was measured on SmolLM2 int4_sym_g128 act-order (64 x 512
    calibration, 8 WikiText-2 windows): PPL 36.47 -> 34.60, KL 0.203 ->
    0.178 against the unweighted error; the whole block's error
    Δ H_gg Δᵀ (AWQ's clip criterion) gave 34.93 / 0.172, at more cost."""
    if not search:
        return rtn_scales(x, scheme)
    # The candidates are ranked in float32 (values32: the rounding rule in float32), as AWQ's searches
    # are; the chosen scales are the exact fp16 ones either way, and codes come from round_to. At
    # 1B shape (gate/up stacked, N = 16384) the float64 search was 12 s of a layer's 20 s.
    x32 = np.ascontiguousarray(x, np.float32)
    h32 = None if h is None else np.asarray(h, np.float32)
    best_d, best_m, best_e = None, None, None
    for f in SHRINK:
        d, m = rtn_scales(x32 * np.float32(f), scheme)
        q = values32(x32, d, m, scheme)
        np.subtract(x32, q, out=q)
        np.square(q, out=q)
        e = q.sum(axis=-1) if h32 is None else q @ h32
        if best_e is None:
            best_d, best_m, best_e = d, m, e
            continue
        better = e < best_e
        best_d[better] = d[better]
        if m is not None:
            best_m[better] = m[better]
        best_e = np.where(better, e, best_e)
    return best_d, best_m


def values32(x: np.ndarray, d: np.ndarray, m: np.ndarray | None, scheme: QuantScheme) -> np.ndarray:
    """float32 values the groups of x [..., g] (float32) round to under fp16 scales d (and mins m)
    [...]: the rule of round_to in float32, for ranking the searches' candidates (here and in AWQ).
    Products of a code and an fp16 scale are exact in float32 (sym, int8); asym's d c + m is one
    rounding."""
    d32 = d.astype(np.float32)[..., None]
    inv = np.divide(np.float32(1), d32, out=np.zeros_like(d32), where=d32 != 0)
    if scheme.bits == 4 and not scheme.symmetric:
        m32 = m.astype(np.float32)[..., None]
        c = np.rint((x - m32) * inv)
        np.clip(c, 0, 15, out=c)
        c *= d32
        c += m32
        return c
    lo, hi = (-8, 7) if scheme.bits == 4 else (-127, 127)
    c = np.rint(x * inv)
    np.clip(c, lo, hi, out=c)
    c *= d32
    return c


def round_to(w: np.ndarray, d: np.ndarray, m: np.ndarray | None, scheme: QuantScheme) -> tuple[np.ndarray, np.ndarray]:
    """Codes of column(s) w under scales d (and mins m), and the values they stand for."""
    df = d.astype(np.float32).astype(np.float64)
    inv = np.divide(1.0, df, out=np.zeros_like(df), where=df != 0)
    if scheme.bits == 4 and scheme.symmetric:
        c = np.clip(np.rint(w * inv) + 8, 0, 15)
        return c, df * (c - 8)
    if scheme.bits == 4:
        mf = m.astype(np.float32).astype(np.float64)
        c = np.clip(np.rint((w - mf) * inv), 0, 15)
        return c, df * c + mf
    c = np.clip(np.rint(w * inv), -127, 127)
    return c, df * c


def _inv_lower(L: np.ndarray, block: int = 256) -> np.ndarray:
    """Inverse of a lower-triangular L [K, K] by blocked forward substitution: block row i of
    X = L^-1 is X_ii = L_ii^-1 and X_i,:i = -X_ii (L_i,:i X_:i,:i), all matrix products. X_:i,:i is
    lower triangular, so block column j of L_i,:i X_:i,:i reads only L_i,j: and X_j:,j (K^3 / 3
    multiply-adds in all where the whole product did 2 K^3 / 3: at K = 8192 4.66 -> 2.36 s on
    2 cores, float64; np.linalg.inv's LU of the same matrix does 2 K^3 / 3 more and ignores the zeros)."""
    K = len(L)
    X = np.zeros_like(L)
    for b0 in range(0, K, block):
        b1 = min(b0 + block, K)
        Xii = np.linalg.inv(L[b0:b1, b0:b1])
        X[b0:b1, b0:b1] = Xii
        if b0:
            P = np.empty((b1 - b0, b0), L.dtype)
            for j0 in range(0, b0, block):
                P[:, j0:j0 + block] = L[b0:b1, j0:b0] @ X[j0:b0, j0:j0 + block]
            X[b0:b1, :b0] = -Xii @ P
    return X


def _cholesky(A: np.ndarray, block: int = 512) -> np.ndarray:
    """Lower-triangular L with L L^T = A (symmetric positive definite), in A's memory, right-looking
    by blocks of `block` columns: each diagonal block by LAPACK, the panel below it by one product
    with that block's inverse, the trailing lower blocks by matrix products (into one buffer). At
    K = 8192, float32, 2 cores: 1.7-2.2 s, where LAPACK's potrf through numpy took 5.1 s (36 GFLOP/s,
    no faster than its float64)."""
    K = len(A)
    L = A
    buf = np.empty((K, block), A.dtype)
    for b0 in range(0, K, block):
        b1 = min(b0 + block, K)
        L11 = np.linalg.cholesky(L[b0:b1, b0:b1])
        L[b0:b1, b0:b1] = L11
        if b1 == K:
            break
        L[b0:b1, b1:] = 0.0
        P = L[b1:, b0:b1] @ np.linalg.inv(L11).T  # L21 = A21 L11^-T
        L[b1:, b0:b1] = P
        for j0 in range(b1, K, block):  # A22 -= L21 L21^T, lower blocks only
            j1 = min(j0 + block, K)
            t = buf[:K - j0, :j1 - j0]
            np.matmul(P[j0 - b1:], P[j0 - b1:j1 - b1].T, out=t)
            L[j0:, j0:j1] -= t
    return L


def _upper_from_reversed(A: np.ndarray) -> np.ndarray:
    """inverse_cholesky_upper's U from A = J H J (H reversed in both axes); a float32 A is
    overwritten by its Cholesky factor (the caller's reference keeps it alive until U is made)."""
    L = np.linalg.cholesky(A) if A.dtype == np.float64 else _cholesky(A)
    X = _inv_lower(L)
    del L
    return np.ascontiguousarray(X[::-1, ::-1])


def inverse_cholesky_upper(H: np.ndarray) -> np.ndarray:
    """The upper-triangular U with U^T U = H^-1 (H symmetric positive definite) that GPTQ
    reads, without forming H^-1: with J the reversal, J H J = L L^T gives H = R R^T for the
    upper R = J L J, so H^-1 = R^-T R^-1 and U = R^-1 = J L^-1 J (the Cholesky factor of H^-1
    is unique, so this is the same matrix as cholesky(inv(H)).T). One Cholesky and one
    triangular inverse instead of a full inverse and a Cholesky, in H's precision: at K = 8192
    (1B's down) on 2 cores 33.0 s -> 14.2 s (float64), ~3 s in float32 with the blocked
    Cholesky and _inv_lower's triangular products (float64: agreeing with numpy's to 1.5e-14)."""
    return _upper_from_reversed(np.array(H[::-1, ::-1]))


def _permuted32(h: np.ndarray, p: np.ndarray) -> np.ndarray:
    """h[p][:, p] in float32, by chunks of rows (no whole-matrix float64 temporary: at K = 8192
    one is 512 MB), each chunk's columns gathered after the cast (np.take into the output: 0.34 s
    at K = 8192, where fancy-indexing the float64 columns took 1.5-2 s)."""
    K = len(p)
    out = np.empty((K, K), np.float32)
    for r0 in range(0, K, 256):
        np.take(h[p[r0:r0 + 256]].astype(np.float32), p, axis=1, out=out[r0:r0 + 256])
    return out


def gptq_quantize(w: np.ndarray, hessian: np.ndarray, scheme: QuantScheme, block: int = 128,
                  damp: float = 0.01, act_order: bool = False, search: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                       np.ndarray | None]:
    """GPTQ of w [N, K] against hessian [K, K] (= 2 X^T X, any positive
    multiple: the result does not depend on the scale). Returns the
    dequantized weights Ŵ [N, K] (float32: exactly the packed values, as
    `dequantize` gives them), codes [N, K], and the group scales d, mins m
    [N, n_groups] (fp16).

    Precision: as in GPTQ's reference code, the weights being updated, the
    factorization of H and the updates are float32 (H is damped in float64
    first); each column's rounding and error are computed in float64 from
    its float32 values. At 1B shape this halves the loop's products and
    memory traffic (float64 products streaming the remaining columns ran at
    31 GFLOP/s here, float32 at 123) and the factorization (9.3 -> 2.9 s)."""
    W = np.array(w, np.float32)
    N, K = W.shape
    g = scheme.group_for(K)
    ng = -(-K // g)
    hd = np.array(np.diag(hessian), np.float64)  # each column's weight in the scale search
    dead = hd == 0
    hd[dead] = 1.0  # dead columns: a unit diagonal (and weight 1 in the search), their values 0
    W[:, dead] = 0.0
    d_all = np.zeros((N, ng), F16)
    m_all = None if scheme.symmetric else np.zeros((N, ng), F16)
    if act_order:  # static groups from the original weights (see the module docstring)
        for gi in range(ng):
            d, m = group_params(W[:, gi * g:(gi + 1) * g], scheme, search, hd[gi * g:(gi + 1) * g])
            d_all[:, gi] = d
            if m_all is not None:
                m_all[:, gi] = m
        perm = np.argsort(-hd, kind="stable")
    else:
        perm = np.arange(K)
    # J H[perm][:, perm] J (J: the reversal; see inverse_cholesky_upper) in float32, gathered at once
    A = _permuted32(hessian, perm[::-1])
    A[np.diag_indices(K)] = (hd[perm[::-1]] + damp * np.mean(hd)).astype(np.float32)
    U = _upper_from_reversed(A)  # upper: H^-1 = U^T U, in visiting order
    del A
    # Columns as rows: WT [K, N] (in visiting order), so each column the loop reads, rounds and
    # updates is contiguous; in [N, K] every value of a column sat on its own cache line.
    # (W.T made contiguous first, then its rows gathered: a gather of W's columns was 1.1 s at 1B.)
    WT = np.ascontiguousarray(W.T)
    del W
    if act_order:
        WT = WT[perm]
    QT = np.empty_like(WT)
    codesT = np.empty((K, N), np.int16)
    # Per group, the float64 constants round_to derives from the fp16 scales, made once per group
    # instead of once per column; the same operations on the same values as round_to, so the same codes.
    sym4, asym4 = scheme.bits == 4 and scheme.symmetric, scheme.bits == 4 and not scheme.symmetric
    lo, hi, off = (0.0, 15.0, 8.0) if sym4 else (0.0, 15.0, 0.0) if asym4 else (-127.0, 127.0, 0.0)
    df_all, inv_all, mf_all = np.zeros((ng, N)), np.zeros((ng, N)), np.zeros((ng, N))

    def set_group(gi, d, m):
        d_all[:, gi] = d
        df = d.astype(np.float32).astype(np.float64)
        df_all[gi] = df
        inv_all[gi] = np.divide(1.0, df, out=np.zeros_like(df), where=df != 0)
        if m is not None:
            m_all[:, gi] = m
            mf_all[gi] = m.astype(np.float32).astype(np.float64)

    if act_order:
        for gi in range(ng):
            set_group(gi, d_all[:, gi].copy(), None if m_all is None else m_all[:, gi].copy())
    c, q, err = np.empty(N), np.empty(N), np.empty(N)
    # The products of the lazy updates go into buffers made once: a fresh (K - 128) x N product per
    # block cost more in page faults than its arithmetic.
    big = np.empty(max(K - block, 0) * N, np.float32)
    small = np.empty(block * N, np.float32)
    for b0 in range(0, K, block):
        b1 = min(b0 + block, K)
        n = b1 - b0
        W1 = WT[b0:b1].copy()
        E1 = np.zeros_like(W1)
        U1 = U[b0:b1, b0:b1]
        # Inside the block, the columns' updates are lazy too, by sub-blocks of SUB: column i updates
        # only the rest of its sub-block, and each finished sub-block updates the rest of the block in
        # one product. A column still receives every earlier column's update before it is read (the
        # same sums, in another order), and a sub-block ends where a group begins (the group's scales
        # are read from fully updated columns). Rank-1 updates of the whole block were 13 s of a
        # 1B layer's 68: at N = 16384 a block is 8-16 MB, re-read and re-written for every column.
        starts = set(range(0, n, SUB))
        if not act_order:
            starts |= {i for i in range(n) if perm[b0 + i] % g == 0}
        edges = sorted(starts) + [n]
        for s0, s1 in zip(edges[:-1], edges[1:]):
            for i in range(s0, s1):
                col = perm[b0 + i]
                gi = col // g
                if not act_order and col % g == 0:  # a new group: its scales from the updated columns
                    cols = (np.concatenate([W1[i:i + g], WT[b1:b0 + i + g]], axis=0)
                            if i + g > n else W1[i:i + g])
                    set_group(gi, *group_params(np.ascontiguousarray(cols.T), scheme, search, hd[col:col + g]))
                w_i, df, mf = W1[i], df_all[gi], mf_all[gi]
                # round_to: codes rint(w / d) (+ 8), or rint((w - m) / d), clipped; values d (c - 8), d c + m, d c
                if asym4:
                    np.subtract(w_i, mf, out=c)
                    c *= inv_all[gi]
                else:
                    np.multiply(w_i, inv_all[gi], out=c)
                np.rint(c, out=c)
                if off:
                    c += off
                np.clip(c, lo, hi, out=c)
                codesT[b0 + i] = c
                np.subtract(c, off, out=q)
                q *= df
                if asym4:
                    q += mf
                QT[b0 + i] = q
                np.subtract(w_i, q, out=err)
                err /= U1[i, i]
                E1[i] = err
                W1[i + 1:s1] -= U1[i, i + 1:s1, None] * E1[i]
            if s1 < n:
                t = small[:(n - s1) * N].reshape(n - s1, N)
                np.matmul(U1[s0:s1, s1:].T, E1[s0:s1], out=t)
                W1[s1:] -= t
        if b1 < K:
            t = big[:(K - b1) * N].reshape(K - b1, N)
            np.matmul(U[b0:b1, b1:].T, E1, out=t)
            WT[b1:] -= t
    del WT, big, small
    if act_order:  # back to column order, rows first (contiguous), then the transpose
        inv = np.argsort(perm)
        QT, codesT = QT[inv], codesT[inv]
    return QT.T, codesT.T, d_all, m_all  # views [N, K]: the forward reads Ŵ^T, which is QT itself


def pack_gptq(name: str, scheme: QuantScheme, shape: tuple[int, int], codes: np.ndarray, d: np.ndarray,
              m: np.ndarray | None, kind: Kind = Kind.MATRIX, rope_interleaved: bool = False) -> Weight:
    """Codes [N, K] and group scales [N, ng] in the scheme's packed layout
    (rows padded to tiles with zero scales, columns to whole groups with the
    zero code: the activations there are zero)."""
    n, k = shape
    g, n_pad, k_pad, _, _ = _geometry(scheme, shape)
    zero = 8 if (scheme.bits == 4 and scheme.symmetric) else 0
    dt = np.int8 if scheme.bits == 8 else np.uint8
    c = np.full((n_pad, k_pad), zero, np.int16)
    c[:n, :k] = codes
    ng_pad = k_pad // g
    dp = np.zeros((n_pad, ng_pad), F16)
    dp[:n, : d.shape[1]] = d
    mp = None
    if m is not None:
        mp = np.zeros((n_pad, ng_pad), F16)
        mp[:n, : m.shape[1]] = m
    assert n_pad % T == 0
    return pack(name, scheme, shape, c.astype(dt), dp, mp, kind, rope_interleaved)


class GPTQ(Method):
    """GPTQ as a calibrated method (calibrate.sequential): each matrix of a
    group against the group's Gram."""

    def __init__(self, scheme: QuantScheme, weights, act_order: bool = False, search: bool = True):
        self.scheme, self.weights, self.act_order, self.search = scheme, weights, act_order, search

    def quantize(self, names: list[str], ws: list[np.ndarray], inputs: Inputs) -> tuple[list[np.ndarray], dict]:
        # The matrices of a group share their input, hence the Hessian, and GPTQ treats rows
        # independently (every update is per row, the order of columns comes from H alone): so they
        # are quantized stacked, as one matrix: one inverse and Cholesky, one pass over the columns.
        rows = np.cumsum([0] + [w.shape[0] for w in ws])
        q, codes, d, m = gptq_quantize(np.concatenate(ws, axis=0) if len(ws) > 1 else ws[0], inputs.gram,
                                       self.scheme, act_order=self.act_order, search=self.search)
        deq, packed = [], {}
        for i, (name, w) in enumerate(zip(names, ws)):
            r = slice(rows[i], rows[i + 1])
            src = self.weights[name]
            packed[name] = pack_gptq(name, self.scheme, tuple(w.shape), codes[r], d[r],
                                     None if m is None else m[r], src.kind, src.rope_interleaved)
            deq.append(q[r])
        return deq, packed
