"""Calibration: run the model over calibration text and hand each group of
linear layers its inputs, layer after layer, so a method quantizes a layer
seeing the outputs of the layers it already quantized (GPTQ's sequential order).

The forward here is numpy (float32 matmuls, the model's own ops as
ops/ref.py defines them: RMSNorm, RoPE in the weights' pair order, causal
GQA attention, SwiGLU, the checkpoint's biases), over the canonical float
weights (a GGUF's blocks dequantized). It is the calibration path only: the
engine's steps are not touched, so ordinary inference pays nothing for it.
Inside a layer the order is "true sequential": q/k/v are quantized from the
attention norm's output, the attention output projection from the attention
computed with the quantized q/k/v, gate/up from the MLP norm's output after
the quantized attention block, down from the activation of the quantized
gate/up.

A method (class Method) sees each group's Inputs (Gram 2XᵀX, per-channel
mean, mean |x|, max |x|, a sample of rows) and may first return a smoothing
s per input channel (AWQ, SmoothQuant): the group's matrices become W·diag(s)
and s is folded into the input's producer, so the float model is unchanged —
q/k/v and gate/up into their RMSNorm's weight (÷ s), down into up's rows
(÷ s; chosen from the float gate/up before those are quantized). The
attention output projection has no such producer (its input mixes v across
the heads that share it), so it is never smoothed.

    calibration_windows(tokenizer, text, n=128, length=512)  -> token windows
    sequential(model, windows, method, progress, bias_correction=, report_scheme=) -> Calibrated
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from llamajet.errors import LlamajetError
from llamajet.loaders.base import page_releaser
from llamajet.ops import ref
from llamajet.quant.bias_correction import corrected_bias


def calibration_windows(tokenizer, text: str, n: int, length: int) -> list[list[int]]:
    """The first `n` non-overlapping windows of `length` tokens of `text` (BOS
    first when the model wants one)."""
    ids = tokenizer.encode(text[: n * length * 8], add_special_tokens=False)
    body = length - (1 if tokenizer.add_bos else 0)
    out = []
    for i in range(min(n, len(ids) // body)):
        w = ids[i * body:(i + 1) * body]
        out.append(([tokenizer.bos_id] if tokenizer.add_bos else []) + w)
    if not out:
        raise LlamajetError(f"calibration text too short for one window of {length} tokens")
    return out


def _embed_rows(w, ids: np.ndarray) -> np.ndarray:
    """float32 rows `ids` of the token embedding; only the rows used are converted when the storage
    is row-major (float and GGUF block types), not the whole table (1 GB in f32 for Llama-3's)."""
    if not w.packed and w.data.ndim == 2 and w.data.shape[0] == w.shape[0]:
        uniq, inv = np.unique(ids, return_inverse=True)
        rows = w.format.to_f32(w.data[uniq], (len(uniq), w.shape[1]))
        return np.asarray(rows, np.float32)[inv.reshape(ids.shape)]
    return w.to_f32().astype(np.float32)[ids]


def _rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    xf = x if x.dtype == np.float32 else x.astype(np.float32)
    r = 1.0 / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + eps)
    out = xf * r  # (x * r) * w, as before, without the copies astype made of each product
    out *= w
    return out


def _rope32(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, heads: int, hd: int, interleaved: bool) -> np.ndarray:
    """ops/ref.py's rope on x [..., T, heads*hd] (every window at positions 0..T-1) in float32, with
    float32 tables cos, sin [T, hd/2]: the calibration forward's rotation (ref.rope rotates in float64,
    which made a float64 copy of every q and k: a tenth of the forward's time)."""
    shape = x.shape
    x = x.reshape(*shape[:-1], heads, hd)
    c, sn = cos[:, None, :], sin[:, None, :]
    out = np.empty_like(x)
    if interleaved:
        a, b, oa, ob = x[..., 0::2], x[..., 1::2], out[..., 0::2], out[..., 1::2]
    else:
        h = hd // 2
        a, b, oa, ob = x[..., :h], x[..., h:], out[..., :h], out[..., h:]
    np.multiply(a, c, out=oa)
    oa -= b * sn
    np.multiply(b, c, out=ob)
    ob += a * sn
    return out.reshape(shape)


@functools.lru_cache(maxsize=2)
def _causal_mask(T: int) -> np.ndarray:
    """[T, T] float32: 0 on and below the diagonal, -inf above (added to the scores); read-only, as
    the cache shares it between calls."""
    m = np.triu(np.full((T, T), -np.inf, np.float32), 1)
    m.flags.writeable = False
    return m


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, heads: int, kv_heads: int, hd: int) -> np.ndarray:
    """Causal GQA over one sequence: q [T, heads*hd], k/v [T, kv_heads*hd]. The scores of the heads
    that share a kv head are one matmul, and the softmax runs in place (the masked half still costs
    its exp: a whole-row softmax is simpler than blocking and this is not the engine)."""
    T, g = q.shape[0], heads // kv_heads
    qh = q.reshape(T, kv_heads, g, hd).transpose(1, 2, 0, 3).reshape(kv_heads, g * T, hd)
    kh = k.reshape(T, kv_heads, hd).transpose(1, 2, 0)  # [kv, hd, T]
    vh = v.reshape(T, kv_heads, hd).transpose(1, 0, 2)  # [kv, T, hd]
    s = np.matmul(qh, kh)  # [kv, g*T, T]
    s /= np.float32(np.sqrt(hd))
    s4 = s.reshape(kv_heads, g, T, T)
    s4 += _causal_mask(T)  # one pass (a boolean-mask store of -inf was a gather: 1.3 s a layer at 1B)
    s -= s.max(-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(-1, keepdims=True)
    o = np.matmul(s, vh)  # [kv, g*T, hd]
    return o.reshape(kv_heads, g, T, hd).transpose(2, 0, 1, 3).reshape(T, heads * hd)


def _gram(x: np.ndarray, blocks: int | None = None) -> np.ndarray:
    """2 X^T X over every token of x [S, T, K] (float32 products, float64 result). Symmetric: only
    the blocks on and above the diagonal are multiplied (10 of 16 with 4 blocks), the rest mirrored.
    Blocks of about 1024 channels (at least 4): a 1B's down (K = 8192) multiplies 36 of 64."""
    flat = x.reshape(-1, x.shape[-1])
    K = flat.shape[1]
    blocks = max(4, K // 1024) if blocks is None else blocks
    edges = np.linspace(0, K, min(blocks, K) + 1).astype(int)
    g = np.empty((K, K), np.float64)
    for i in range(len(edges) - 1):
        a = flat[:, edges[i]:edges[i + 1]]
        for j in range(i, len(edges) - 1):
            blk = (a.T @ flat[:, edges[j]:edges[j + 1]]).astype(np.float64)
            g[edges[i]:edges[i + 1], edges[j]:edges[j + 1]] = blk
            g[edges[j]:edges[j + 1], edges[i]:edges[i + 1]] = blk.T
    return 2.0 * g


def _silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """silu(g) * u, as g u / (1 + exp(-g)), in the memory of g and u: no temporary (a fresh array of
    this size costs more in page faults than the arithmetic: 9 against 1.2 ns per value here)."""
    u *= g
    np.negative(g, out=g)
    np.exp(g, out=g)
    g += 1.0
    np.divide(u, g, out=u)
    return u


SMOOTH_TOKENS = 16384  # tokens down's smoothing is chosen from (the float MLP, computed only for that)
SAMPLE = 512  # tokens of each input kept as rows (the methods that simulate activation rounding use them)


class Inputs:
    """Calibration statistics of the input a group of linear layers shares
    (x [tokens, K]): the Gram 2 XᵀX (the output error of any Ŵ is
    tr(ΔW XᵀX ΔWᵀ)), per channel E[x], E|x| and max|x|, and a fixed sample
    of its rows. The Gram (the costly one: tokens x K² multiply-adds) is
    computed when a method first reads it."""

    def __init__(self, x: np.ndarray, gram: np.ndarray | None = None):
        self._x = x.reshape(-1, x.shape[-1])
        self.tokens = len(self._x)
        # E[x], E|x|, max|x| in one pass by chunks of rows: a whole |x| was a copy of the input (1 GB for
        # a 1B's down at 64 x 512). The Gram reads the rows once more, when a method asks for it; that
        # pass costs K multiply-adds per value read, so reading the rows twice is not worth coupling them.
        K = self._x.shape[1]
        xsum, asum, self.absmax = np.zeros(K), np.zeros(K), np.zeros(K)
        step = max(1, (1 << 24) // max(K, 1))
        for r in range(0, self.tokens, step):
            c = self._x[r:r + step]
            xsum += c.sum(0, dtype=np.float64)
            a = np.abs(c)
            asum += a.sum(0, dtype=np.float64)
            np.maximum(self.absmax, a.max(0), out=self.absmax)
        self.mean = xsum / max(self.tokens, 1)
        self.absmean = asum / max(self.tokens, 1)
        rows = np.random.default_rng(0).permutation(self.tokens)[:SAMPLE]
        self.sample = np.ascontiguousarray(self._x[np.sort(rows)])
        self._gram = gram
        self._div = None  # divided(): _x stays the unsmoothed rows, the statistics are of _x / _div

    @property
    def x(self) -> np.ndarray:
        """The rows [tokens, K] (of x / s for a divided one: made on request)."""
        return self._x if self._div is None else (self._x / self._div).astype(np.float32)

    @property
    def gram(self) -> np.ndarray:
        if self._gram is None:
            self._gram = _gram(self._x)  # _x is the unsmoothed input: then the smoothing's division
            if self._div is not None:
                self._gram /= np.outer(self._div, self._div)
        return self._gram

    def gram_blocks(self, g: int) -> np.ndarray:
        """The Gram's diagonal blocks [n_groups, g, g] over groups of g consecutive channels (the last
        padded with zeros), float32: all a per-group search reads (AWQ's clipping). Sliced from the
        Gram when it exists; otherwise computed alone, K g multiply-adds per token instead of the
        Gram's K² (down's clipping at K = 1536, g = 128: 12x fewer), and the Gram is not made."""
        K = self._x.shape[1]
        ng = -(-K // g)
        out = np.zeros((ng, g, g), np.float32)
        for i in range(ng):
            c = slice(i * g, min((i + 1) * g, K))
            n = c.stop - c.start
            if self._gram is not None:
                out[i, :n, :n] = self._gram[c, c]
                continue
            a = np.ascontiguousarray(self._x[:, c])
            blk = 2.0 * (a.T @ a).astype(np.float64)
            if self._div is not None:
                blk /= np.outer(self._div[c], self._div[c])
            out[i, :n, :n] = blk
        return out

    def divided(self, s: np.ndarray) -> "Inputs":
        """The statistics of x / s (a smoothing folded into the input's producer), from this one's:
        each is linear in 1 / s per channel (s > 0), so x / s itself is never made (at 65,536
        tokens it was a copy of every smoothed input, 0.4 GB for down's)."""
        out = object.__new__(Inputs)
        s64 = np.asarray(s, np.float64)
        out._x, out._div = self._x, s64 if self._div is None else self._div * s64
        out.tokens = self.tokens
        out.mean, out.absmean, out.absmax = self.mean / s64, self.absmean / s64, self.absmax / s64
        out.sample = np.ascontiguousarray((self.sample / s).astype(np.float32))
        out._gram = None if self._gram is None else self._gram / np.outer(s64, s64)
        return out


def output_error(dw: np.ndarray, gram: np.ndarray) -> float:
    """||ΔW Xᵀ||² over the calibration tokens, from the Gram (2 XᵀX): tr(ΔW G ΔWᵀ) / 2."""
    return float(np.einsum("nk,nk->", dw @ gram, dw)) / 2.0


class Method:
    """A calibrated quantization method, one group of linear layers at a time
    (the layers that read one input: q/k/v, attention output, gate/up, down).

    smooth(names, ws, inputs) -> per-input-channel scales s, or None:
        the layers become W·diag(s) and their input x/s (s is folded into the
        input's producer: the RMSNorm's weight, or the rows of up for down);
        called only where such a producer exists (`foldable`).
    quantize(names, ws, inputs) -> (dequantized Ŵ list, {name: packed Weight})."""

    smooths = False  # whether smooth() may return scales (the forward prepares down's inputs for it)

    def smooth(self, names: list[str], ws: list[np.ndarray], inputs: Inputs) -> np.ndarray | None:
        return None

    def quantize(self, names: list[str], ws: list[np.ndarray], inputs: Inputs) -> tuple[list[np.ndarray], dict]:
        raise NotImplementedError


@dataclass
class LayerRecord:
    """What quantizing one matrix cost, for the report: weight error and the
    output error on the calibration inputs (both as SQNR, dB), and RTN's
    output SQNR on the same matrix and inputs (unsmoothed, for comparison)."""

    name: str
    layer: int
    shape: tuple[int, int]
    weight_mse: float
    weight_sqnr_db: float
    output_sqnr_db: float
    rtn_output_sqnr_db: float

    def as_dict(self) -> dict:
        return asdict(self)


def _sqnr(signal: float, noise: float) -> float:
    return float("inf") if noise <= 0 else 10.0 * np.log10(max(signal, 1e-300) / noise)


@dataclass
class Calibrated:
    """sequential's result: packed matrices, the float tensors it changed or
    added (RMSNorm weights that absorbed a smoothing, bias corrections), and
    one record per matrix when a report was asked for."""

    packed: dict = field(default_factory=dict)
    floats: dict = field(default_factory=dict)
    records: list[LayerRecord] = field(default_factory=list)
    # the smoothings, per matrix: saved = diag(1/rows) W diag(cols) before quantizing (the report undoes them)
    cols: dict = field(default_factory=dict)
    rows: dict = field(default_factory=dict)


def sequential(model, windows: list[list[int]], method: Method, progress: Callable[[int, int], None] | None = None,
               hidden: list | None = None, bias_correction: bool = False, report_scheme=None) -> Calibrated:
    """Quantizes every decoder matrix of `model` in order (module docstring).
    bias_correction: each matrix gets the bias b += (W - Ŵ) E[x] over its
    calibration inputs (quant/bias_correction.py), used by the layers after it. report_scheme: record each matrix's errors
    (LayerRecord; RTN under this scheme as the comparison). `hidden` (a list)
    receives the last layer's output [S, T, D] (for checking the forward)."""
    cfg, W = model.config, model.weights
    H, KV, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    cos32, sin32 = (t.astype(np.float32) for t in ref.rope_tables(cfg.rope_inv_freq(), len(windows[0])))
    h = _embed_rows(W["token_embd"], np.asarray(windows))  # [S, T, D]
    res = Calibrated()

    release = page_releaser(model)

    def f32(name):  # the source's file pages are dropped once read (a 1B's bf16 pages were 1.9 GB by the end)
        a = W[name].to_f32().astype(np.float32)
        release(W[name])
        return a

    def bias(name):  # the checkpoint's bias (or 0) plus any correction made so far
        b = res.floats.get(name + ".bias")
        if b is None and name + ".bias" in W:
            b = f32(name + ".bias")
        return b

    def run(names, ws, inputs, layer, s=None):
        deq, packed = method.quantize(names, ws, inputs)
        res.packed.update(packed)
        for name, w, q in zip(names, ws, deq):
            dw = np.asarray(w, np.float64) - q
            if bias_correction:  # quant/bias_correction.py
                res.floats[name + ".bias"] = corrected_bias(bias(name), w, q, inputs.mean)
            if report_scheme is not None:
                res.records.append(_record(name, layer, w, dw, inputs, s, f32(name), report_scheme))
        return [np.asarray(q, np.float32) for q in deq]

    def lin(x, w, name):
        y = x @ w.T
        b = bias(name)
        return y if b is None else y + b

    def smooth(names, ws, inputs):
        s = method.smooth(names, ws, inputs)
        if s is None:
            return ws, inputs, None
        res.cols.update({n: s.astype(np.float32) for n in names})
        return [(w * s).astype(np.float32) for w in ws], inputs.divided(s), s

    for layer in range(cfg.num_layers):
        p = f"blk.{layer}."
        an, fn = f32(p + "attn_norm"), f32(p + "ffn_norm")
        xa = _rmsnorm(h, an, eps)
        names = [p + "attn_q", p + "attn_k", p + "attn_v"]
        ws, ia, s = smooth(names, [f32(n) for n in names], Inputs(xa))
        if s is not None:  # folded into the attention norm
            an = (an / s).astype(np.float32)
            res.floats[p + "attn_norm"] = an
            xa = _rmsnorm(h, an, eps)
        wq, wk, wv = run(names, ws, ia, layer, s)
        q = _rope32(lin(xa, wq, names[0]), cos32, sin32, H, hd, W[names[0]].rope_interleaved)
        k = _rope32(lin(xa, wk, names[1]), cos32, sin32, KV, hd, W[names[1]].rope_interleaved)
        v = lin(xa, wv, names[2])
        att = np.empty((h.shape[0], h.shape[1], H * hd), np.float32)
        for i in range(h.shape[0]):
            att[i] = _attention(q[i], k[i], v[i], H, KV, hd)
        del q, k, v
        o = p + "attn_output"
        (wo,) = run([o], [f32(o)], Inputs(att), layer)  # no producer to fold into (attention mixes v)
        h += lin(att, wo, o)
        del att, xa
        xm = _rmsnorm(h, fn, eps)
        names, dn = [p + "ffn_gate", p + "ffn_up"], p + "ffn_down"
        wg, wu, wd = f32(names[0]), f32(names[1]), f32(dn)
        # down's smoothing first, from the float gate/up (over a sample of SMOOTH_TOKENS tokens), so it can
        # fold into up's rows before up is quantized
        sd = None
        if method.smooths:
            xs = xm.reshape(-1, xm.shape[-1])[np.random.default_rng(1).permutation(xm.shape[0] * xm.shape[1])
                                              [:SMOOTH_TOKENS]]
            g = lin(xs, wg, names[0])
            sd = method.smooth([dn], [wd], Inputs(g / (1.0 + np.exp(-g)) * lin(xs, wu, names[1])))
            del g, xs
        if sd is not None:
            res.cols[dn], res.rows[names[1]] = sd.astype(np.float32), sd.astype(np.float32)
            wu, wd = (wu / sd[:, None]).astype(np.float32), (wd * sd).astype(np.float32)
            if bias(names[1]) is not None:
                res.floats[names[1] + ".bias"] = (bias(names[1]) / sd).astype(np.float32)
        ws, im, s = smooth(names, [wg, wu], Inputs(xm))
        if s is not None:
            fn = (fn / s).astype(np.float32)
            res.floats[p + "ffn_norm"] = fn
            xm = _rmsnorm(h, fn, eps)
        wg, wu = run(names, ws, im, layer, s)
        act = _silu_mul(lin(xm, wg, names[0]), lin(xm, wu, names[1]))
        del xm
        (wd,) = run([dn], [wd], Inputs(act), layer, sd)
        h += lin(act, wd, dn)
        del act
        if progress is not None:
            progress(layer + 1, cfg.num_layers)
    if hidden is not None:
        hidden.append(h)
    return res


def _record(name, layer, w, dw, inputs: Inputs, s, src, scheme) -> LayerRecord:
    """The errors of one matrix: w (smoothed by s, or not) quantized with
    error dw against `inputs`; RTN of the source matrix `src` on the
    unsmoothed inputs (Gram · s sᵀ) for comparison."""
    from llamajet.formats.packed import dequantize, quantize_rtn

    w64, src = np.asarray(w, np.float64), np.asarray(src, np.float64)
    g_src = inputs.gram if s is None else inputs.gram * np.outer(s, s)
    rtn = dequantize(quantize_rtn(name, src.astype(np.float32), scheme))
    noise_w = float((dw ** 2).sum())
    return LayerRecord(name, layer, tuple(w64.shape), noise_w / w64.size, _sqnr(float((w64 ** 2).sum()), noise_w),
                       _sqnr(output_error(w64, inputs.gram), output_error(dw, inputs.gram)),
                       _sqnr(output_error(src, g_src), output_error(src - rtn, g_src)))
