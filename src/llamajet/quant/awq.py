"""AWQ (Lin et al., 2023): activation-aware weight quantization. Weights
that meet large activations matter more; scaling their input channels up
before rounding (and the activations down by the same factor, folded into
the input's producer) gives them finer steps relative to their size.

Scale search, per group of matrices sharing an input x [tokens, K]:
    s = mean|x|^α, normalised by sqrt(max s · min s),  α over a grid of 21 in [0, 1]
    Ŵ(α) = RTN(W·diag(s))·diag(1/s)
keeping the α whose output error ||(W - Ŵ) Xᵀ||² over the group's matrices
(calibrate.output_error, from the Gram 2XᵀX) is least. α = 0 is s = 1, so
the search is never worse than not scaling. The error is measured on the
group's own outputs (q/k/v, or gate/up, or down), not after the attention
or the activation function that follow them, which keeps the search to
closed-form traces of the Gram.

Clipping search, per group of g columns of each row: the scheme's RTN
range shrunk by a factor in 1 .. 0.5 (21 steps; 1 is the plain rule), the
factor kept per row whose error on that group's share of the output,
Δ G_gg Δᵀ, is least (AWQ's auto-clip, with the Gram in place of sampled
tokens). Each row keeps the plain rule unless a shrink is strictly better.

AWQGPTQ ("awq-gptq"): the same scales, then GPTQ on the smoothed weights.

Duo scaling (AutoAWQ's option, AWQ(duo=True)): the search also tries
s = x^α / w^(1-α), w the per-channel mean of |W| over its group's max, and
keeps the family of lower output error. Off by default: measured on SmolLM2
int4_sym_g128 (64 x 512 calibration, 8 WikiText-2 windows, a16) it lowered
the per-layer error it searches on but not the model's: PPL 37.29 -> 37.53,
KL 0.207 -> 0.217 (`benchmarks/quant_table.py --only 11`).

The scales fold into the preceding RMSNorm (q/k/v, gate/up) or into up's
rows (down); the attention output projection is not scaled (its input
mixes v across the query heads that share it; AWQ's own code scales v→o
only when the two have the same shape). The packed result is the scheme's
own layout.
"""

from __future__ import annotations

import numpy as np

from llamajet.formats.packed import rtn_scales
from llamajet.quant.calibrate import Inputs, Method, output_error
from llamajet.quant.gptq import pack_gptq, round_to, values32

ALPHAS = np.linspace(0.0, 1.0, 21)
CLIPS = np.linspace(1.0, 0.5, 21)


def _whole_groups(a: np.ndarray, g: int) -> np.ndarray:
    """[N, K] -> [N, ng, g]: the columns padded to whole groups of g by repeating the last one (the
    packing's rule, so a ragged last group's statistics are its real columns')."""
    N, K = a.shape
    ng = -(-K // g)
    if ng * g != K:
        a = np.concatenate([a, np.repeat(a[:, -1:], ng * g - K, axis=1)], axis=1)
    return a.reshape(N, ng, g)


def weight_magnitude(W: np.ndarray, scheme) -> np.ndarray:
    """Per input channel, the mean over rows of |W| relative to its group's max|W| (AutoAWQ's
    "duo scaling" statistic: a channel whose weights are already large within their groups needs
    less scaling up)."""
    N, K = W.shape
    a = _whole_groups(np.abs(np.asarray(W, np.float32)), scheme.group_for(K))
    a = a / np.maximum(a.max(axis=-1, keepdims=True), 1e-30)
    return a.reshape(N, -1)[:, :K].mean(0, dtype=np.float64)


def _alpha_error(W: np.ndarray, x: np.ndarray, a: float, G: np.ndarray, scheme,
                 wmag: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """(s, ||(W - Ŵ(α)) Xᵀ||²) for one α (float32 throughout: the trace compares candidates).
    wmag: duo scaling, s = x^α / wmag^(1-α)."""
    s = x ** a if wmag is None else x ** a / wmag ** (1.0 - a)
    s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
    N, K = W.shape
    Wg = _whole_groups(W * s, scheme.group_for(K))
    q = values32(Wg, *rtn_scales(Wg, scheme), scheme).reshape(N, -1)[:, :K]
    q /= s
    np.subtract(W, q, out=q)
    return s, output_error(q, G)


def awq_scales(ws: list[np.ndarray], inputs: Inputs, scheme, alphas=ALPHAS, coarse: bool = True,
               duo: bool = False) -> tuple[np.ndarray, float, list]:
    """(s, the chosen α, [(α, output error)] for every α tried, in α order). coarse: every other α
    of the grid first (0, 0.1, .., 1), then the two neighbours of the best of those (13 of the 21
    traces, each N K² multiply-adds: the search's cost); the error is smooth in α, so this lands
    on the full grid's choice or next to it (α = 0 is always tried: never worse than s = 1).
    duo: s = x^α / w^(1-α) with w = weight_magnitude (α = 0 is then not s = 1; AWQ.smooth tries
    both families and keeps the better)."""
    return awq_search(ws, inputs, scheme, alphas, coarse, ("duo",) if duo else ("plain",))[0]


def awq_search(ws: list[np.ndarray], inputs: Inputs, scheme, alphas=ALPHAS, coarse: bool = True,
               families=("plain",)) -> list[tuple[np.ndarray, float, list]]:
    """awq_scales' result for each family ("plain": s = x^α; "duo": s = x^α / w^(1-α)), in the order
    given, from one preparation: the group's W concatenated and its Gram in float32 are made once
    (at 1B, down's are 256 MB each)."""
    bad = [f for f in families if f not in ("plain", "duo")]
    if bad:  # before the preparation, not after it
        raise ValueError(f"unknown AWQ scale family {bad[0]!r} (plain, duo)")
    W = np.concatenate([np.asarray(w, np.float32) for w in ws])
    G = inputs.gram.astype(np.float32)  # the errors compare candidates: float32 traces are ample
    x = np.maximum(inputs.absmean, 1e-6 * max(float(inputs.absmean.max()), 1e-30))
    out = []
    for family in families:
        wmag = None
        if family == "duo":
            wm = weight_magnitude(W, scheme)
            wmag = np.maximum(wm, 1e-4 * max(float(wm.max()), 1e-30))
        out.append(_search_alpha(W, x, G, scheme, alphas, coarse, wmag))
    return out


def _search_alpha(W, x, G, scheme, alphas, coarse, wmag):
    done: dict[int, tuple[np.ndarray, float]] = {}

    def at(i):
        if i not in done:
            done[i] = _alpha_error(W, x, float(alphas[i]), G, scheme, wmag)
        return done[i][1]

    first = range(0, len(alphas), 2) if coarse else range(len(alphas))
    best = min(first, key=at)
    if coarse:
        best = min([best] + [j for j in (best - 1, best + 1) if 0 <= j < len(alphas)], key=lambda i: (at(i), i))
    tried = [(float(alphas[i]), done[i][1]) for i in sorted(done)]
    return done[best][0].astype(np.float64), float(alphas[best]), tried


def clip_search(w: np.ndarray, gram: np.ndarray, scheme, clips=CLIPS):
    """Codes [N, K], scales d and mins m [N, n_groups] (fp16), and the dequantized values,
    with each row's range per group shrunk by the factor of least output error on that group.
    `gram`: the Gram [K, K], or only its diagonal blocks [n_groups, g, g] (Inputs.gram_blocks:
    all this reads). All groups at once: the columns are padded to whole groups by repeating the
    last one (the packing's rule, so a group's statistics are its real columns'), with no weight
    in the Gram. The search ranks the factors in float32 and keeps only each group's best index;
    the codes are made once, for the chosen factors, by the packing's own rounding (round_to)."""
    W = np.asarray(w, np.float64)
    N, K = W.shape
    g = scheme.group_for(K)
    ng = -(-K // g)
    Wp = _whole_groups(W, g)
    if gram.ndim == 3:
        Gb = np.asarray(gram, np.float32)
    else:
        Gp = np.zeros((ng * g, ng * g), np.float32)
        Gp[:K, :K] = gram
        Gb = np.stack([Gp[i * g:(i + 1) * g, i * g:(i + 1) * g] for i in range(ng)])  # [ng, g, g]
    clips = np.asarray(clips, np.float64)
    W32 = np.ascontiguousarray(Wp.astype(np.float32).transpose(1, 0, 2))  # [ng, N, g]
    best_e, best_i = None, np.zeros((ng, N), np.int64)
    for i, f in enumerate(clips):
        d, m = rtn_scales((Wp * f).astype(np.float32).transpose(1, 0, 2), scheme)  # [ng, N]
        dx = values32(W32, d, m, scheme)
        np.subtract(W32, dx, out=dx)
        e = np.einsum("gnk,gnk->gn", dx @ Gb, dx)
        if best_e is None:
            best_e = e
            continue
        better = e < best_e  # strictly: a row keeps the plain rule unless a shrink is better
        best_e = np.where(better, e, best_e)
        best_i[better] = i
    F = clips[best_i.T]  # [N, ng]
    d_all, m_all = rtn_scales((Wp * F[..., None]).astype(np.float32), scheme)  # each group as at its factor
    codes, Q = round_to(Wp, d_all[..., None], None if m_all is None else m_all[..., None], scheme)
    return (codes.reshape(N, -1)[:, :K].astype(np.int16), d_all, m_all, Q.reshape(N, -1)[:, :K])


class AWQ(Method):
    smooths = True

    def __init__(self, scheme, weights, clip: bool = True, duo: bool = False):
        self.scheme, self.weights, self.clip, self.duo = scheme, weights, clip, duo
        self.alphas: dict[str, float] = {}  # first matrix of each group -> chosen α (the report's)
        self.duo_chosen: dict[str, bool] = {}  # ... and whether the duo family won

    def smooth(self, names, ws, inputs):
        # with duo, both families from one preparation, the lesser output error kept (never worse than s = 1)
        found = awq_search(ws, inputs, self.scheme, families=("plain", "duo") if self.duo else ("plain",))
        s, a, tried = found[0]
        duo = False
        if self.duo:
            s2, a2, tried2 = found[1]
            if min(e for _, e in tried2) < min(e for _, e in tried):
                s, a, duo = s2, a2, True
        self.alphas[names[0]], self.duo_chosen[names[0]] = a, duo
        return None if (a == 0.0 and not duo) else s

    def quantize(self, names, ws, inputs):
        deq, packed = [], {}
        clips = CLIPS if self.clip else CLIPS[:1]
        for name, w in zip(names, ws):
            blocks = inputs.gram_blocks(self.scheme.group_for(w.shape[1]))  # the o / down Grams are never made
            codes, d, m, q = clip_search(w, blocks, self.scheme, clips)
            src = self.weights[name]
            packed[name] = pack_gptq(name, self.scheme, tuple(w.shape), codes, d, m, src.kind, src.rope_interleaved)
            deq.append(q)
        return deq, packed


class AWQGPTQ(AWQ):
    """AWQ's scales, then GPTQ (act-order, H-weighted scale search) in place of the clipping search:
    the smoothing moves the salient channels' range into the weights, GPTQ then spreads each column's
    rounding error over the columns not yet quantized, against the smoothed inputs' Hessian (the
    combination llm-compressor's recipes apply). SmolLM2 int4_sym_g128, 64 x 512 calibration:
    PPL 35.09, KL 0.149 against AWQ's 37.2 / 0.20 and GPTQ act-order's 34.60 / 0.178."""

    def __init__(self, scheme, weights, act_order: bool = True, search: bool = True):
        super().__init__(scheme, weights)
        from llamajet.quant.gptq import GPTQ
        self._gptq = GPTQ(scheme, weights, act_order=act_order, search=search)

    def quantize(self, names, ws, inputs):
        return self._gptq.quantize(names, ws, inputs)
