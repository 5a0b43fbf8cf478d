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

The scales fold into the preceding RMSNorm (q/k/v, gate/up) or into up's
rows (down); the attention output projection is not scaled (its input
mixes v across the query heads that share it; AWQ's own code scales v→o
only when the two have the same shape). The packed result is the scheme's
own layout.
"""

from __future__ import annotations

import numpy as np

from llamajet.formats.packed import rtn_dequant, rtn_scales
from llamajet.quant.calibrate import Inputs, Method, output_error
from llamajet.quant.gptq import pack_gptq, round_to

ALPHAS = np.linspace(0.0, 1.0, 21)
CLIPS = np.linspace(1.0, 0.5, 21)


def awq_scales(ws: list[np.ndarray], inputs: Inputs, scheme, alphas=ALPHAS) -> tuple[np.ndarray, float, list]:
    """(s, the chosen α, [(α, output error)] for every α tried)."""
    W = np.concatenate([np.asarray(w, np.float64) for w in ws])
    G = inputs.gram.astype(np.float32)  # the errors compare candidates: float32 traces are ample
    x = np.maximum(inputs.absmean, 1e-6 * max(float(inputs.absmean.max()), 1e-30))
    tried, best = [], None
    for a in alphas:
        s = x ** a
        s = s / np.sqrt(s.max() * s.min())
        q = rtn_dequant((W * s).astype(np.float32), scheme) / s
        e = output_error((W - q).astype(np.float32), G)
        tried.append((float(a), e))
        if best is None or e < best[1]:
            best = (s, e, float(a))
    return best[0], best[2], tried


def clip_search(w: np.ndarray, gram: np.ndarray, scheme, clips=CLIPS):
    """Codes [N, K], scales d and mins m [N, n_groups] (fp16), and the dequantized values,
    with each row's range per group shrunk by the factor of least output error on that group.
    All groups at once: the columns are padded to whole groups by repeating the last one (the
    packing's rule, so a group's statistics are its real columns'), with no weight in the Gram."""
    W = np.asarray(w, np.float64)
    N, K = W.shape
    g = scheme.group_for(K)
    ng = -(-K // g)
    Wp = np.concatenate([W, np.repeat(W[:, -1:], ng * g - K, axis=1)], axis=1).reshape(N, ng, g)
    Gp = np.zeros((ng * g, ng * g), np.float32)
    Gp[:K, :K] = gram
    Gb = np.stack([Gp[i * g:(i + 1) * g, i * g:(i + 1) * g] for i in range(ng)])  # [ng, g, g]
    best_e = codes = Q = d_all = m_all = None
    for f in clips:
        d, m = rtn_scales((Wp * f).astype(np.float32), scheme)  # [N, ng]
        c, q = round_to(Wp, d[..., None], None if m is None else m[..., None], scheme)
        dx = (Wp - q).astype(np.float32).transpose(1, 0, 2)  # [ng, N, g]
        e = np.einsum("gnk,gnk->ng", dx @ Gb, dx)
        if best_e is None:
            best_e, codes, Q, d_all, m_all = e, c, q, d, m
            continue
        better = e < best_e
        best_e = np.where(better, e, best_e)
        codes = np.where(better[..., None], c, codes)
        Q = np.where(better[..., None], q, Q)
        d_all = np.where(better, d, d_all)
        if m is not None:
            m_all = np.where(better, m, m_all)
    return (codes.reshape(N, -1)[:, :K].astype(np.int16), d_all, m_all, Q.reshape(N, -1)[:, :K])


class AWQ(Method):
    smooths = True

    def __init__(self, scheme, weights, clip: bool = True):
        self.scheme, self.weights, self.clip = scheme, weights, clip
        self.alphas: dict[str, float] = {}  # first matrix of each group -> chosen α (the report's)

    def smooth(self, names, ws, inputs):
        s, a, _ = awq_scales(ws, inputs, self.scheme)
        self.alphas[names[0]] = a
        return None if a == 0.0 else s

    def quantize(self, names, ws, inputs):
        deq, packed = [], {}
        clips = CLIPS if self.clip else CLIPS[:1]
        for name, w in zip(names, ws):
            codes, d, m, q = clip_search(w, inputs.gram, self.scheme, clips)
            src = self.weights[name]
            packed[name] = pack_gptq(name, self.scheme, tuple(w.shape), codes, d, m, src.kind, src.rope_interleaved)
            deq.append(q)
        return deq, packed
