"""Sampling: turn one row of logits into the next token.

Order of operations (as in HF transformers' logits processors): repetition
penalty -> temperature -> top-k -> top-p -> min-p -> draw. Temperature 0 is
greedy (argmax, first index on ties). A seed makes the draw reproducible: each
request owns its own numpy Generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llamajet.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128          # new tokens at most
    temperature: float = 1.0       # 0 = greedy
    top_k: int = 0                 # 0 = off
    top_p: float = 1.0             # nucleus mass; 1 = off
    min_p: float = 0.0             # drop tokens below min_p * p(best); 0 = off
    repetition_penalty: float = 1.0  # CTRL-style on prompt+output tokens; 1 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()     # stop strings (not included in the text)
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's end-of-turn tokens
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        def bad(field: str, why: str):
            raise RequestError(f"SamplingParams.{field}={getattr(self, field)!r}: {why}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if not (self.temperature >= 0.0) or not np.isfinite(self.temperature):
            bad("temperature", "must be a finite number >= 0")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "must be an integer >= 0")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", "must be in (0, 1]")
        if not (0.0 <= self.min_p <= 1.0):
            bad("min_p", "must be in [0, 1]")
        if not (self.repetition_penalty > 0.0) or not np.isfinite(self.repetition_penalty):
            bad("repetition_penalty", "must be a finite number > 0")
        if isinstance(self.stop, str):  # a lone string is one stop string
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if any(not s for s in self.stop):
            bad("stop", "stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    """Per-request sampler (owns the request's random generator)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def penalized(self, logits: np.ndarray, history) -> np.ndarray:
        """float64 copy of `logits` with the repetition penalty applied."""
        p = self.params
        x = np.array(logits, dtype=np.float64)  # copy: never modify the arena
        if p.repetition_penalty != 1.0 and len(history):
            seen = np.unique(np.asarray(history, dtype=np.int64))
            v = x[seen]
            x[seen] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        return x

    def probs(self, logits: np.ndarray, history) -> np.ndarray:
        """The distribution a non-greedy draw samples from (float64, sums to 1)."""
        p = self.params
        x = self.penalized(logits, history) / p.temperature
        if p.top_k and p.top_k < x.size:
            kth = np.partition(x, -p.top_k)[-p.top_k]
            x[x < kth] = -np.inf
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cum = np.cumsum(probs[order])
            # keep the smallest prefix whose mass reaches top_p (at least one token)
            cut = int(np.searchsorted(cum, p.top_p)) + 1
            mask = np.zeros_like(probs, dtype=bool)
            mask[order[:cut]] = True
            probs = np.where(mask, probs, 0.0)
        if p.min_p > 0.0:
            probs = np.where(probs >= p.min_p * probs.max(), probs, 0.0)
        return probs / probs.sum()

    def __call__(self, logits: np.ndarray, history) -> int:
        if self.params.greedy:
            if self.params.repetition_penalty == 1.0:  # float32 -> float64 keeps the order: same argmax
                return int(np.argmax(logits))
            return int(np.argmax(self.penalized(logits, history)))
        probs = self.probs(logits, history)
        return int(self.rng.choice(probs.size, p=probs))
