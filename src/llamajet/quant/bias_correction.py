"""Bias correction (Nagel et al., 2019): rounding weights shifts a layer's
mean output. For a matrix W quantized to Ŵ and calibration inputs x,

    E[W x] - E[Ŵ x] = (W - Ŵ) E[x]

is a per-output-channel constant that a bias cancels exactly on the
calibration data: b ← b + (W - Ŵ) E[x]. calibrate.sequential applies it
after each matrix is quantized (any method), so the layers after it are
calibrated on corrected outputs; the saved model's config then states
attention_bias and mlp_bias, and the kernels add the bias in the matmul's
epilogue (before RoPE for q and k, as a checkpoint's own bias)."""

from __future__ import annotations

import numpy as np


def mean_shift(w: np.ndarray, deq: np.ndarray, mean_x: np.ndarray) -> np.ndarray:
    """(W - Ŵ) E[x], float64 [N]."""
    return (np.asarray(w, np.float64) - np.asarray(deq, np.float64)) @ np.asarray(mean_x, np.float64)


def corrected_bias(bias: np.ndarray | None, w: np.ndarray, deq: np.ndarray, mean_x: np.ndarray) -> np.ndarray:
    """The bias (float32) that cancels Ŵ's mean output shift; `bias`: the one the matrix had, or None."""
    return ((0.0 if bias is None else np.asarray(bias, np.float64)) + mean_shift(w, deq, mean_x)).astype(np.float32)
