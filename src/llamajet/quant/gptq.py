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
0, get weight 0 and a unit diagonal).

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
    X = L^-1 is X_ii = L_ii^-1 and X_i,:i = -X_ii (L_i,:i X_:i,:i), all matrix products
    (K^3 / 3 multiply-adds; np.linalg.inv's LU of the same matrix does 2 K^3 / 3 more and
    ignores the zeros)."""
    K = len(L)
    X = np.zeros_like(L)
    for b0 in range(0, K, block):
        b1 = min(b0 + block, K)
        Xii = np.linalg.inv(L[b0:b1, b0:b1])
        X[b0:b1, b0:b1] = Xii
        if b0:
            X[b0:b1, :b0] = -Xii @ (L[b0:b1, :b0] @ X[:b0, :b0])
    return X


def inverse_cholesky_upper(H: np.ndarray) -> np.ndarray:
    """The upper-triangular U with U^T U = H^-1 (H symmetric positive definite) that GPTQ
    reads, without forming H^-1: with J the reversal, J H J = L L^T gives H = R R^T for the
    upper R = J L J, so H^-1 = R^-T R^-1 and U = R^-1 = J L^-1 J (the Cholesky factor of H^-1
    is unique, so this is the same matrix as cholesky(inv(H)).T). One Cholesky and one
    triangular inverse instead of a full inverse and a Cholesky: at K = 8192 (1B's down)
    33.0 s -> 14.2 s on 2 cores, the two agreeing to 1.5e-14 relative."""
    L = np.linalg.cholesky(np.ascontiguousarray(H[::-1, ::-1]))
    X = _inv_lower(L)
    del L
    return np.ascontiguousarray(X[::-1, ::-1])


def gptq_quantize(w: np.ndarray, hessian: np.ndarray, scheme: QuantScheme, block: int = 128,
                  damp: float = 0.01, act_order: bool = False, search: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                       np.ndarray | None]:
    """GPTQ of w [N, K] against hessian [K, K] (= 2 X^T X, any positive
    multiple: the result does not depend on the scale). Returns the
    dequantized weights Ŵ [N, K] (float64), codes [N, K], and the group
    scales d, mins m [N, n_groups] (fp16)."""
    W = np.array(w, np.float64)
    N, K = W.shape
    g = scheme.group_for(K)
    ng = -(-K // g)
    H = np.array(hessian, np.float64)
    dead = np.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    d_all = np.zeros((N, ng), F16)
    m_all = None if scheme.symmetric else np.zeros((N, ng), F16)
    hd = np.diag(H).copy()  # each column's weight in the scale search (dead columns: 1, their values 0)
    if act_order:  # static groups from the original weights (see the module docstring)
        for gi in range(ng):
            d, m = group_params(W[:, gi * g:(gi + 1) * g], scheme, search, hd[gi * g:(gi + 1) * g])
            d_all[:, gi] = d
            if m_all is not None:
                m_all[:, gi] = m
        perm = np.argsort(-np.diag(H), kind="stable")
    else:
        perm = np.arange(K)
    H = H[np.ix_(perm, perm)]
    H[np.diag_indices(K)] += damp * np.mean(np.diag(H))
    U = inverse_cholesky_upper(H)  # upper: H^-1 = U^T U
    del H
    # Columns as rows: WT [K, N] (in visiting order), so each column the loop reads, rounds and
    # updates is contiguous; in [N, K] every value of a column sat on its own cache line.
    WT = np.ascontiguousarray(W[:, perm].T)
    QT = np.zeros_like(WT)
    codesT = np.zeros((K, N), np.int16)
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
    c = np.empty(N)
    for b0 in range(0, K, block):
        b1 = min(b0 + block, K)
        W1 = WT[b0:b1].copy()
        E1 = np.zeros_like(W1)
        U1 = U[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = perm[b0 + i]
            gi = col // g
            if not act_order and col % g == 0:  # a new group: its scales from the updated columns
                cols = (np.concatenate([W1[i:i + g], WT[b1:b0 + i + g]], axis=0)
                        if i + g > b1 - b0 else W1[i:i + g])
                set_group(gi, *group_params(np.ascontiguousarray(cols.T), scheme, search, hd[col:col + g]))
            w_i, df, mf = W1[i], df_all[gi], mf_all[gi]
            # round_to: codes rint(w / d) (+ 8), or rint((w - m) / d), clipped; values d (c - 8), d c + m, d c
            np.multiply(w_i - mf if asym4 else w_i, inv_all[gi], out=c)
            np.rint(c, out=c)
            if off:
                c += off
            np.clip(c, lo, hi, out=c)
            codesT[b0 + i] = c
            q = df * (c - off) + mf if asym4 else df * (c - off)
            QT[b0 + i] = q
            err = (w_i - q) / U1[i, i]
            W1[i:] -= U1[i, i:, None] * err
            E1[i] = err
        WT[b1:] -= U[b0:b1, b1:].T @ E1
    Q, codes = QT.T, codesT.T
    inv = np.argsort(perm)
    return Q[:, inv], codes[:, inv], d_all, m_all


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
