"""SmoothQuant (Xiao et al., 2022) for W8A8: int8 weights per output
channel and int8 activations with one dynamic scale per token over the
whole row (the kernels' activation group is the weight's group, the whole
row for `int8_pc`). Per-token scales suffer from the few input channels
whose activations are far larger than the rest; SmoothQuant moves that
range into the weights, which are quantized per output channel and can
take it:

    s_j = max|X_j|^α / max|W_j|^(1-α)     (max over tokens / over the rows of every matrix sharing x)
    W ← W·diag(s),  x ← x / s               (folded into the preceding RMSNorm, or into up's rows for down)

The float product is unchanged. α is chosen per group from a grid (0.3 ..
0.9, and no smoothing at all), by the error of the simulated W8A8 product
(the kernels' rounding: formats.packed.quantize_activations and the RTN
rule) on a fixed sample of the group's calibration rows — the paper's 0.5
is one of the grid's points, and the error decides. The attention output
projection is not smoothed (nothing to fold into; see calibrate.py).
"""

from __future__ import annotations

import numpy as np

from llamajet.formats.packed import _geometry, quantize_activations, rtn_dequant
from llamajet.quant.calibrate import Inputs
from llamajet.quant.rtn import RTN

ALPHAS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def w8a8_error(W: np.ndarray, x: np.ndarray, scheme) -> float:
    """||x Wᵀ - a8(x) RTN(W)ᵀ||² with the kernels' per-row activation rounding."""
    g, _, k_pad, _, _ = _geometry(scheme, W.shape)
    q, dx, _ = quantize_activations(x, g, k_pad)
    xq = (q.reshape(len(x), -1, g).astype(np.float32) * dx[..., None]).reshape(len(x), -1)[:, : x.shape[1]]
    y = x.astype(np.float64) @ W.T.astype(np.float64)
    yq = xq.astype(np.float64) @ rtn_dequant(W.astype(np.float32), scheme).T
    return float(((y - yq) ** 2).sum())


def smooth_scales(ws: list[np.ndarray], inputs: Inputs, alpha: float) -> np.ndarray:
    wmax = np.max([np.abs(w).max(axis=0) for w in ws], axis=0).astype(np.float64)
    xmax = inputs.absmax
    s = np.maximum(xmax, 1e-5) ** alpha / np.maximum(wmax, 1e-5) ** (1.0 - alpha)
    return np.where((xmax > 0) & (wmax > 0), s, 1.0)


class SmoothQuant(RTN):
    smooths = True

    def __init__(self, scheme, weights, alphas=ALPHAS):
        super().__init__(scheme, weights)
        self.alphas_tried = tuple(alphas)
        self.alphas: dict[str, float | None] = {}  # first matrix of each group -> chosen α (None: not smoothed)

    def smooth(self, names, ws, inputs):
        W = np.concatenate([np.asarray(w, np.float32) for w in ws])
        x = inputs.sample
        best_e, best = w8a8_error(W, x, self.scheme), (None, None)
        for a in self.alphas_tried:
            s = smooth_scales(ws, inputs, a)
            e = w8a8_error(W * s.astype(np.float32), (x / s).astype(np.float32), self.scheme)
            if e < best_e:
                best_e, best = e, (s, a)
        self.alphas[names[0]] = best[1]
        return best[0]
