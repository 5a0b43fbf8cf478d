"""Round to nearest as a calibrated method: the scheme's own RTN rule
(formats/packed.py, bit for bit what `LLM(path, quantize=S)` runs), inside
the sequential calibration pass only so that bias correction or the report
can use the calibration inputs. Plain `--method rtn` needs no calibration
and does not come here."""

from __future__ import annotations

import numpy as np

from llamajet.formats.packed import dequantize, quantize_rtn
from llamajet.quant.calibrate import Inputs, Method


class RTN(Method):
    def __init__(self, scheme, weights):
        self.scheme, self.weights = scheme, weights

    def quantize(self, names: list[str], ws: list[np.ndarray], inputs: Inputs) -> tuple[list[np.ndarray], dict]:
        packed = {}
        for name, w in zip(names, ws):
            src = self.weights[name]
            packed[name] = quantize_rtn(name, np.asarray(w, np.float32), self.scheme, src.kind, src.rope_interleaved)
        return [dequantize(packed[n]) for n in names], packed
