"""Sequence: one request's tokens, KV blocks, state and pending output.

A request is a Sequence from admission to finish. Its tokens are one list
(prompt then output) because everything downstream wants them that way: the
block hashes cover prompt and output alike, a preempted sequence recomputes
all of them, and the repetition penalty looks at both.

The text side (incremental detokenization, stop strings held back while they
might still be forming) is a `TextStream` per sequence, so stop strings end a
sequence inside the engine (its blocks are freed at once) rather than in
whoever reads the stream.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections import deque
from dataclasses import dataclass

from llamajet.engine.sampling import Sampler, SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"    # queued: not admitted yet, or preempted (recomputed when readmitted)
    RUNNING = "running"    # holds KV blocks; scheduled every step
    FINISHED = "finished"  # done (stop, length, abort); holds no blocks


@dataclass(frozen=True)
class StreamEvent:
    token_id: int | None   # the new token (None on the closing event of a stop token or a score-only request)
    text: str              # newly completed text (never half a UTF-8 character)
    finish_reason: str | None = None
    index: int = 0         # which choice of an n > 1 request
    logprob: float | None = None  # of token_id, when the request asked for logprobs
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (id, logprob), most likely first


_ids = itertools.count()


class Sequence:
    """One request. Fields the BlockManager reads and writes: `token_ids`,
    `block_table`, `num_computed`, `block_hashes`, `num_cached_blocks`."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, stop_ids: frozenset[int] = frozenset(),
                 text: TextStream | None = None, index: int = 0, constraint=None) -> None:
        self.id = next(_ids)
        self.index = index  # choice number within its request (n > 1)
        # Choices 1..n-1 of an n > 1 request, not started yet: at the first
        # draw they fork off this sequence (sharing its prompt's KV blocks).
        self.forks: list[Sequence] = []
        self.constraint = constraint  # a sampling.Constraint, or None
        self.token_ids: list[int] = list(prompt_ids)  # prompt, then output
        self.num_prompt = len(prompt_ids)
        self.params = params
        self.sampler = Sampler(params, index)
        self.stop_ids = stop_ids
        self.text = text
        self.status = Status.WAITING
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        # KV state.
        # NOTE: tokens [0, num_computed) have their K/V in the blocks of
        # block_table (the slot of position p: block_manager.kv_slot).
        self.block_table: list[int] = []
        self.num_computed = 0
        self.block_hashes: list[bytes] = []  # chained hashes of full blocks of token_ids (lazily extended)
        self.num_cached_blocks = 0           # leading full blocks already offered to the prefix cache
        self.num_cached_tokens = 0           # prompt tokens served from the prefix cache at admission
        self.num_preemptions = 0
        self.num_tokens_run = 0              # tokens computed for it, summed over steps (recomputes count again)
        # speculative decoding (engine/speculative.py): the tokens proposed for the next step (never in
        # token_ids until verified) and the proposer's state
        self.draft: list[int] = []
        self.spec = None
        # With params.prompt_logprobs: entry p is None for p = 0, else (logprob
        # of prompt token p under the row of position p - 1, top-k ((id,
        # logprob), most likely first)), appended as prefill chunks complete.
        # NOTE: entries are never recomputed (a preempted sequence keeps them),
        # so the list only grows, and it is whole before the first event.
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None
        # Output not yet read (the sync/async streams drain it).
        self.events: deque[StreamEvent] = deque()
        # Timing (perf_counter seconds).
        self.arrival_time = time.perf_counter()
        self.admit_time: float | None = None  # first admitted to the running batch
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    def __repr__(self) -> str:
        return (f"Sequence(id={self.id}, tokens={len(self.token_ids)}, computed={self.num_computed}, "
                f"blocks={len(self.block_table)}, {self.status.value})")

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def scoring_from(self) -> int | None:
        """The first position whose logits row a prompt logprob still needs
        (row q scores prompt token q + 1), or None when none does."""
        pl = self.prompt_logprobs
        if pl is None or len(pl) >= self.num_prompt:
            return None
        return len(pl) - 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


class TextStream:
    """Token ids -> StreamEvents for one sequence: whole UTF-8 characters
    only; a stop string cuts the text before it (and ends the sequence); text
    that could still be the start of a stop string is held back."""

    def __init__(self, decoder, stop: tuple[str, ...], index: int = 0) -> None:
        self.dec = decoder
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=0)
        self.pending = ""
        self.index = index  # the choice whose events these are

    def push(self, tok: int, reason: str | None) -> StreamEvent:
        """The event for new token `tok`. reason: "stop" when `tok` is a stop
        token (not part of the output), "length" when it is the last token,
        "end" when it completes a structured output (finish_reason "stop"),
        else None. The event's finish_reason is "stop" also when a stop string
        completed (the caller then finishes the sequence)."""
        i = self.index
        if reason == "stop":  # a stop token: flush and end
            text = self.pending + self.dec.flush()
            cut = _find_stop(text, self.stop)
            return StreamEvent(None, text if cut is None else text[:cut], "stop", i)
        self.pending += self.dec.push(tok)
        if reason is not None:
            self.pending += self.dec.flush()
        cut = _find_stop(self.pending, self.stop)
        if cut is not None:
            return StreamEvent(tok, self.pending[:cut], "stop", i)
        if reason is not None:
            return StreamEvent(tok, self.pending, "stop" if reason == "end" else reason, i)
        # emit all but a tail that could still be the start of a stop string
        keep = _stop_prefix_len(self.pending, self.stop) if self.hold else 0
        emit, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return StreamEvent(tok, emit, None, i)


def _find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    idx = [text.find(s) for s in stops]
    idx = [i for i in idx if i >= 0]
    return min(idx) if idx else None


def _stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
