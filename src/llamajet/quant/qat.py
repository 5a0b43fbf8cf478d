"""Quantization-aware training (QAT): fine-tune the float weights so that
their round-to-nearest quantization, not the weights themselves, is good.

The student is the model with every decoder linear W (q, k, v, o, gate, up,
down) replaced in its forward by Q(W), the scheme's RTN values of the current
W (formats/packed.py's rule, bit for bit); the embedding and the head are
frozen at their RTN values under `embed_scheme`. The teacher is the same
forward over the original float weights. Training minimizes the distillation
loss, averaged over every position t of the calibration windows,

    L = mean_t KL(p_teacher(. | x<=t) || p_student(. | x<=t))

by AdamW over the latent float W and the RMSNorm weights. Q is piecewise
constant, so its gradient is the straight-through estimator (Bengio et al.,
2013): dQ(W)/dW = 1 where the code is the rounded value itself, 0 where the
clip to the code range changed it (the weight lies outside its group's
representable range); the scale d (and min m) are functions of W computed
afresh each step but treated as constants (no gradient through them).

The result is the trained float W: RTN of W under the scheme (as `llamajet
quantize` does) gives exactly the values the student was trained with, so
QAT packs with the ordinary quantizer and the kernels run it unchanged.

The forward (`TorchModel`) is the numpy forward of quant/calibrate.py in
torch, float32: RMSNorm, RoPE in the weights' own pair order, causal GQA
attention, SwiGLU, residuals, the output norm and the head (`output`, or
`token_embd` when tied).

Optimization: AdamW (betas 0.9 / 0.95, no weight decay), linear warmup over
5% of the steps, then a cosine down to lr/10. Measured on SmolLM2-135M
(int4_sym_g128, embedding int8_g32, 120 steps of 256 tokens, WikiText-2:
benchmarks/qat_smollm2.py): lr 5e-5 PPL 33.40 KL 0.221, 1e-4 32.44 / 0.205,
2e-4 32.18 / 0.221 (its training loss noisier, higher throughout). Adam moves
a weight by at most about lr per step: 120 steps at 1e-4 is 0.012, a fifth
of the int4 step there (d = 0.06-0.1 at g128), so QAT flips the roundings of
the weights near a rounding boundary, the choices that move the loss. The teacher runs on the fly (a cached distribution would be
vocab x tokens floats per window, 50 MB for 256 tokens, for windows that are
seen once).

On a shared CPU set OMP_WAIT_POLICY=PASSIVE before torch loads: spinning
threads of an oversubscribed OpenMP pool made steps up to 18x slower.

    fake_quant(w, scheme)                          -> RTN values, STE gradient
    qat_train(model, windows, scheme, steps=...)   -> QATResult (trained float weights)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from llamajet.errors import LlamajetError, UnsupportedModelError
from llamajet.formats.schemes import QuantScheme
from llamajet.ops import ref

LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
NORMS = ("attn_norm", "ffn_norm")


# ------------------------------------------------------------------ fake quantization


def _rtn(w: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """RTN values of w [N, K] (float32) under `scheme`, and the mask of the
    elements whose code was not clipped. The arithmetic is quantize_rtn's then
    dequantize's: groups of scheme.group_for(K) consecutive columns, the row
    padded to k_padded by repeating its last value; scale (and min) rounded
    to fp16; codes rint(x * (1/d)) (half to even), 1/d in float32; values
    d * (c - 8), d * c + m, d * c in float32. Divisions are done in float64
    and rounded once to float32, which is the correctly rounded float32
    quotient (53 >= 2 * 24 + 2 bits), as numpy's."""
    n, k = w.shape
    g, k_pad = scheme.group_for(k), scheme.k_padded(k)
    x = w.detach().to(torch.float32)
    if k_pad > k:
        x = torch.cat([x, x[:, -1:].expand(n, k_pad - k)], dim=1)
    x = x.reshape(n, k_pad // g, g)

    def fp16(a: torch.Tensor) -> torch.Tensor:  # a float64 quotient -> float32 -> fp16, held in float32
        return a.to(torch.float32).to(torch.float16).to(torch.float32)

    if scheme.bits == 4 and scheme.symmetric:  # the first largest-magnitude value maps to code -8
        first = x.abs().argmax(dim=-1, keepdim=True)  # torch: the first maximal index, as numpy
        d = fp16(x.gather(-1, first).to(torch.float64) / -8.0)
        m, lo, hi, bias = None, 0.0, 15.0, 8.0
    elif scheme.bits == 4:  # [min, max] over 15 steps
        mn = x.amin(dim=-1, keepdim=True)
        d = fp16((x.amax(dim=-1, keepdim=True) - mn).to(torch.float64) / 15.0)
        m, lo, hi, bias = mn.to(torch.float16).to(torch.float32), 0.0, 15.0, 0.0
    elif scheme.bits == 8:  # amax / 127
        d = fp16(x.abs().amax(dim=-1, keepdim=True).to(torch.float64) / 127.0)
        m, lo, hi, bias = None, -127.0, 127.0, 0.0
    else:
        raise LlamajetError(f"fake quantization handles the RTN schemes (int4, int8), not {scheme.name}")
    inv = torch.where(d != 0, (1.0 / d.to(torch.float64)).to(torch.float32), torch.zeros_like(d))
    r = torch.round((x if m is None else x - m) * inv)
    if bias:
        r = r + bias
    c = r.clamp(lo, hi)
    kept = r == c
    q = d * (c - bias) if m is None else d * c + m
    return q.reshape(n, k_pad)[:, :k], kept.reshape(n, k_pad)[:, :k]


class _FakeQuant(torch.autograd.Function):
    """Forward: the RTN values; backward: the straight-through estimator."""

    @staticmethod
    def forward(ctx, w, scheme):
        q, kept = _rtn(w, scheme)
        ctx.save_for_backward(kept)
        return q.to(w.dtype)

    @staticmethod
    def backward(ctx, grad):
        (kept,) = ctx.saved_tensors
        return grad * kept, None


def fake_quant(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """The scheme's RTN values of w [N, K], bit for bit those of
    dequantize(quantize_rtn(name, w, scheme)); the gradient passes unchanged
    to the elements inside their group's representable range (code not
    clipped) and is 0 for the clipped ones. The scales are computed from w
    and detached."""
    return _FakeQuant.apply(w, scheme)


# ------------------------------------------------------------------ the forward


class TorchModel:
    """The decoder of a LoadedModel in torch (float32), over any set of
    canonical tensors: `logits(weights, tokens)` with weights a dict
    canonical name -> tensor (e.g. `self.float`, or fake-quantized ones)."""

    def __init__(self, model, max_len: int):
        cfg = model.config
        if cfg.attention_bias or cfg.mlp_bias:
            raise UnsupportedModelError("QAT does not handle attention/MLP biases yet")
        self.config = cfg
        W = model.weights
        self.interleaved = {n: W[n].rope_interleaved for n in W if n.endswith(("attn_q", "attn_k"))}
        cos, sin = ref.rope_tables(cfg.rope_inv_freq(), max_len)
        self.cos = torch.from_numpy(cos.astype(np.float32))
        self.sin = torch.from_numpy(sin.astype(np.float32))
        self.float = {n: torch.from_numpy(np.ascontiguousarray(w.to_f32(), dtype=np.float32)) for n, w in W.items()}

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + self.config.rms_norm_eps) * w

    def _rope(self, x: torch.Tensor, heads: int, interleaved: bool) -> torch.Tensor:
        """ref.rope on x [B, T, heads*hd] at positions 0..T-1: pairs (2j, 2j+1) or (j, j+hd/2)."""
        B, T, _ = x.shape
        hd = self.config.head_dim
        x = x.reshape(B, T, heads, hd)
        c, s = self.cos[:T, None, :], self.sin[:T, None, :]
        a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., : hd // 2], x[..., hd // 2:])
        ra, rb = a * c - b * s, b * c + a * s
        out = torch.stack([ra, rb], dim=-1) if interleaved else torch.cat([ra, rb], dim=-1)
        return out.reshape(B, T, heads, hd).transpose(1, 2)  # [B, heads, T, hd]

    def hidden(self, w: dict, tokens: torch.Tensor) -> torch.Tensor:
        """The last layer's output [B, T, D] for tokens [B, T]."""
        cfg = self.config
        H, KV, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = w["token_embd"][tokens]
        B, T, _ = h.shape
        for layer in range(cfg.num_layers):
            p = f"blk.{layer}."
            xa = self._norm(h, w[p + "attn_norm"])
            q = self._rope(xa @ w[p + "attn_q"].T, H, self.interleaved[p + "attn_q"])
            k = self._rope(xa @ w[p + "attn_k"].T, KV, self.interleaved[p + "attn_k"])
            v = (xa @ w[p + "attn_v"].T).reshape(B, T, KV, hd).transpose(1, 2)
            if H != KV:  # query head i reads kv head i // (H / KV), as calibrate._attention
                k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # scale 1/sqrt(hd)
            h = h + att.transpose(1, 2).reshape(B, T, H * hd) @ w[p + "attn_output"].T
            xm = self._norm(h, w[p + "ffn_norm"])
            h = h + (F.silu(xm @ w[p + "ffn_gate"].T) * (xm @ w[p + "ffn_up"].T)) @ w[p + "ffn_down"].T
        return h

    def logits(self, w: dict, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] for tokens [B, T] (int64)."""
        head = w["output"] if "output" in w else w["token_embd"]
        return self._norm(self.hidden(w, tokens), w["output_norm"]) @ head.T


# ------------------------------------------------------------------ training


@dataclass
class QATResult:
    weights: dict[str, np.ndarray]          # canonical name -> trained float32 values (linears and norms)
    losses: list[float] = field(default_factory=list)  # the distillation KL of each step's batch
    seconds: float = 0.0
    steps: int = 0


def trained_names(config) -> list[str]:
    """The tensors QAT trains: every decoder linear and every RMSNorm weight."""
    return [f"blk.{i}.{n}" for i in range(config.num_layers) for n in NORMS + LINEARS] + ["output_norm"]


def kl_div(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """mean over positions of KL(p_teacher || p_student), logits [..., vocab]."""
    lt = F.log_softmax(teacher_logits.flatten(0, -2), dim=-1)
    ls = F.log_softmax(student_logits.flatten(0, -2), dim=-1)
    return F.kl_div(ls, lt, log_target=True, reduction="batchmean")


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warmup over `warmup` steps, then a cosine from lr down to lr / 10."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(steps - warmup, 1)
    return lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * t)))


def qat_train(model, windows: list[list[int]], scheme: QuantScheme, *, steps: int = 300, lr: float = 1e-4,
              seq_len: int | None = None, batch: int = 1, embed_scheme: QuantScheme | None = None,
              progress: Callable[[int, int], None] | None = None, seed: int = 0,
              threads: int | None = None, keep_head: bool = False) -> QATResult:
    """QAT of `model` (a LoadedModel) for `steps` AdamW steps (weight decay 0,
    betas 0.9/0.95, lr warmup over 5% of the steps then cosine to lr/10) of
    `batch` windows each, the windows (cropped to `seq_len` tokens, default:
    the shortest) visited in a random order (`seed`), reshuffled each epoch.
    The teacher's logits are computed on the fly (no grad). progress(done,
    total) is called after each step. See the module docstring."""
    if not windows:
        raise LlamajetError("QAT needs at least one calibration window")
    T = min(seq_len or min(len(w) for w in windows), min(len(w) for w in windows))
    if T < 2:
        raise LlamajetError("QAT needs windows of at least 2 tokens")
    data = torch.tensor([w[:T] for w in windows], dtype=torch.int64)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads or 2)
    try:
        return _train(model, data, scheme, steps, lr, batch, None if keep_head else (embed_scheme or scheme),
                      progress, seed)
    finally:
        torch.set_num_threads(threads_before)


def _train(model, data: torch.Tensor, scheme: QuantScheme, steps: int, lr: float, batch: int,
           frozen_sch: QuantScheme | None, progress, seed: int) -> QATResult:
    T = data.shape[1]
    tm = TorchModel(model, T)
    teacher = tm.float
    # frozen_sch None (keep_head): the embedding / head are saved as the source holds them (a Q8_0 table
    # repacked without loss), so the student sees exactly the teacher's values
    student_fixed = {n: teacher[n] if frozen_sch is None else fake_quant(teacher[n], frozen_sch)
                     for n in ("token_embd", "output") if n in teacher}
    names = trained_names(tm.config)
    params = {n: teacher[n].clone().requires_grad_(True) for n in names}
    opt = torch.optim.AdamW(params.values(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    warmup = max(1, steps // 20)
    rng = np.random.default_rng(seed)
    order: list[int] = []
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        while len(order) < batch:
            order.extend(rng.permutation(len(data)).tolist())
        ids, order = data[order[:batch]], order[batch:]
        with torch.no_grad():
            t_logits = tm.logits(teacher, ids)
        student = dict(student_fixed)
        for n, p in params.items():
            student[n] = fake_quant(p, scheme) if n.rsplit(".", 1)[-1] in LINEARS else p
        loss = kl_div(t_logits, tm.logits(student, ids))
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if progress is not None:
            progress(step + 1, steps)
    out = {n: p.detach().numpy().astype(np.float32, copy=True) for n, p in params.items()}
    return QATResult(out, losses, time.perf_counter() - t0, steps)


__all__ = ["LINEARS", "QATResult", "TorchModel", "fake_quant", "kl_div", "qat_train", "trained_names"]
