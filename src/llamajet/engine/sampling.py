"""Sampling: turn one row of logits into the next token.

Order of operations (as in HF transformers' logits processors, with OpenAI's
additions first): logit bias -> grammar mask -> repetition penalty ->
presence/frequency penalties -> temperature -> top-k -> top-p -> min-p ->
draw. Temperature 0 is greedy (argmax, first index on ties). A seed makes the
draw reproducible: each request owns its own numpy Generator (choice i of an
n > 1 request draws from the generator seeded with (seed, i)).

Log-probabilities (`logprobs`) are those of the model's own distribution: the
log-softmax of the raw logits, before bias, mask, penalties and temperature
(as vLLM reports them by default), so they say what the model thought, not
what the sampler did with it. `prompt_logprobs` are the same numbers for the
prompt's own tokens (token p under the row of position p - 1), made from the
logits rows of the prompt's prefill (engine/scheduler.py asks for every row
of such a prompt), as vLLM's `prompt_logprobs`; with them `max_tokens=0` is a
score-only request: it ends after its prefill and draws nothing.

A `Constraint` (structured output) is an object the engine asks for the
allowed tokens before each draw and tells the drawn token after; the engine
knows nothing of grammars (server/grammar.py implements one with llguidance).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from llamajet.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128          # new tokens at most (0: score the prompt only, with prompt_logprobs)
    temperature: float = 1.0       # 0 = greedy
    top_k: int = 0                 # 0 = off
    top_p: float = 1.0             # nucleus mass; 1 = off
    min_p: float = 0.0             # drop tokens below min_p * p(best); 0 = off
    repetition_penalty: float = 1.0  # CTRL-style on prompt+output tokens; 1 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()     # stop strings (not included in the text)
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's end-of-turn tokens
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in the output so far
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit); a dict is accepted
    logprobs: int | None = None    # None: none; k >= 0: the chosen token's and the k most likely tokens'
    n: int = 1                     # choices from one prompt (computed once, KV blocks shared)
    prompt_logprobs: int | None = None  # None: none; k >= 0: each prompt token's and the k most likely tokens'
    speculative: bool = True       # False: no tokens proposed for it even when the engine speculates

    # Bounds on one request (a server refuses more with a 400).
    MAX_N = 16
    MAX_LOGPROBS = 20
    MAX_STOP = 16

    def __post_init__(self) -> None:
        def bad(field: str, why: str):
            raise RequestError(f"SamplingParams.{field}={getattr(self, field)!r}: {why}")

        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int) or
                                                 not 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS):
            bad("prompt_logprobs", f"must be an integer in [0, {self.MAX_LOGPROBS}] or None")
        if self.prompt_logprobs is None:
            if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
                bad("max_tokens", "must be an integer >= 1 (0 only with prompt_logprobs: score the prompt)")
        elif not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            bad("max_tokens", "must be an integer >= 0")
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
        if len(self.stop) > self.MAX_STOP:
            bad("stop", f"at most {self.MAX_STOP} stop strings")
        for f in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, f)
            if not (-2.0 <= v <= 2.0):
                bad(f, "must be in [-2, 2]")
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = bias.items()
        try:
            bias = tuple(sorted((int(k), float(v)) for k, v in bias))
        except (TypeError, ValueError):
            bad("logit_bias", "must map token ids to numbers")
        if any(not (-100.0 <= v <= 100.0) for _, v in bias):
            bad("logit_bias", "biases must be in [-100, 100]")
        if any(k < 0 for k, _ in bias):
            bad("logit_bias", "token ids must be >= 0")
        object.__setattr__(self, "logit_bias", bias)
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or
                                          not 0 <= self.logprobs <= self.MAX_LOGPROBS):
            bad("logprobs", f"must be an integer in [0, {self.MAX_LOGPROBS}] or None")
        if not isinstance(self.n, int) or not 1 <= self.n <= self.MAX_N:
            bad("n", f"must be an integer in [1, {self.MAX_N}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def score_only(self) -> bool:
        """Prompt logprobs and no new token (max_tokens=0)."""
        return self.max_tokens == 0

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits: the argmax of the raw row."""
        return (self.greedy and self.repetition_penalty == 1.0 and not self.logit_bias
                and self.presence_penalty == 0.0 and self.frequency_penalty == 0.0)


class Constraint(Protocol):
    """Structured output for one sequence (see the module docstring)."""

    def allowed(self, vocab_size: int) -> np.ndarray:
        """bool[vocab_size]: the tokens the next draw may take (at least one)."""

    def consume(self, token_id: int) -> None:
        """The drawn token (a stop token included)."""

    def is_done(self) -> bool:
        """Whether the output is complete (nothing more may follow)."""

    def copy(self) -> "Constraint":
        """An independent copy in the same state (for the choices of n > 1)."""


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax over the last axis (a row, or rows of logits)."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))


def top_logprobs(lp: np.ndarray, k: int) -> tuple[tuple[int, float], ...]:
    """The k most likely (id, logprob), most likely first (ties: lower id first)."""
    if k <= 0:
        return ()
    k = min(k, lp.size)
    idx = np.argpartition(-lp, k - 1)[:k]
    idx = idx[np.lexsort((idx, -lp[idx]))]
    return tuple((int(i), float(lp[i])) for i in idx)


class Sampler:
    """Per-request sampler (owns the request's random generator)."""

    def __init__(self, params: SamplingParams, index: int = 0) -> None:
        self.params = params
        seed = params.seed if index == 0 or params.seed is None else [params.seed, index]
        self.rng = np.random.default_rng(seed)

    def penalized(self, logits: np.ndarray, history, num_prompt: int = 0,
                  allowed: np.ndarray | None = None) -> np.ndarray:
        """float64 copy of `logits` with bias, mask and penalties applied.
        history: prompt + output ids; the first `num_prompt` are the prompt
        (the presence and frequency penalties count only the output)."""
        p = self.params
        x = np.array(logits, dtype=np.float64)  # copy: never modify the arena
        for t, b in p.logit_bias:
            if t < x.size:
                x[t] += b
        if allowed is not None:
            x[~allowed[: x.size]] = -np.inf
        if p.repetition_penalty != 1.0 and len(history):
            seen = np.unique(np.asarray(history, dtype=np.int64))
            v = x[seen]
            x[seen] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and len(history) > num_prompt:
            out, counts = np.unique(np.asarray(history[num_prompt:], dtype=np.int64), return_counts=True)
            x[out] -= p.frequency_penalty * counts + p.presence_penalty
        return x

    def probs(self, logits: np.ndarray, history, num_prompt: int = 0,
              allowed: np.ndarray | None = None) -> np.ndarray:
        """The distribution a non-greedy draw samples from (float64, sums to 1)."""
        p = self.params
        x = self.penalized(logits, history, num_prompt, allowed) / p.temperature
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

    def __call__(self, logits: np.ndarray, history, num_prompt: int = 0,
                 allowed: np.ndarray | None = None) -> int:
        if self.params.greedy:
            if self.params.plain_greedy and allowed is None:  # float32 -> float64 keeps the order
                return int(np.argmax(logits))
            return int(np.argmax(self.penalized(logits, history, num_prompt, allowed)))
        probs = self.probs(logits, history, num_prompt, allowed)
        # Generator.choice(n, p=probs)'s own draw (inverse CDF of one uniform,
        # the same stream of numbers) without its checks of p, which cost
        # twice the draw on a 128k vocabulary.
        cdf = np.cumsum(probs)
        cdf /= cdf[-1]
        return int(min(np.searchsorted(cdf, self.rng.random(), side="right"), probs.size - 1))
