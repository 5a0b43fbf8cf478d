"""Engine: runs requests on a ModelRunner, one step at a time.

A step is schedule -> run -> postprocess: pick the tokens to compute
(a prefill chunk, or one decode token), run the whole forward pass in one
executor call, then sample and check stop conditions. Requests are served
one after another here; the batched scheduler extends this loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from llamajet.engine.block_manager import BlockManager
from llamajet.engine.runner import ModelRunner, StepBatch
from llamajet.engine.sampling import Sampler, SamplingParams
from llamajet.engine.sequence import Sequence
from llamajet.errors import RequestError


@dataclass(frozen=True)
class StreamEvent:
    token_id: int | None   # the new token (None on the final event of a stop string)
    text: str              # newly completed text (never half a UTF-8 character)
    finish_reason: str | None = None


@dataclass
class RequestStats:
    """Wall-clock split of the last request: prefill (prompt -> first logits)
    and decode (every later step), for `llamajet generate --stats`."""

    prompt_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    extra: dict = field(default_factory=dict)


class Engine:
    def __init__(self, runner: ModelRunner, tokenizer) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.blocks = BlockManager(runner.num_blocks, runner.block_size)
        self._all_rows = np.arange(runner.max_out, dtype=np.int32)
        self.last_stats = RequestStats()

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    # -- validation

    def check_prompt(self, ids: list[int]) -> None:
        if len(ids) == 0:
            raise RequestError("empty prompt: give at least one token")
        vocab = self.runner.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        if len(ids) >= self.max_model_len:
            raise RequestError(
                f"prompt has {len(ids)} tokens but the context holds {self.max_model_len} "
                f"(prompt + at least one new token); shorten it or raise max_model_len")

    # -- one step

    def _run(self, seq: Sequence, ids: list[int], start: int, out_rows: np.ndarray) -> np.ndarray:
        """Computes tokens `ids` at positions start.. of `seq`; returns logits rows."""
        n = len(ids)
        self.blocks.ensure(seq.block_table, start + n)
        pos = np.arange(start, start + n, dtype=np.int32)
        table = np.asarray(seq.block_table, dtype=np.int32)
        bs = self.blocks.block_size
        slots = table[pos // bs] * bs + pos % bs
        bt = np.zeros((1, self.runner.max_blocks), dtype=np.int32)
        bt[0, : len(table)] = table
        batch = StepBatch(np.asarray(ids, dtype=np.int32), pos, slots.astype(np.int32),
                          np.zeros(n, dtype=np.int32), bt, out_rows)
        out = self.runner.execute(batch)
        seq.num_computed = start + n
        return out

    def _prefill(self, seq: Sequence, ids: list[int], start: int = 0) -> np.ndarray:
        """Feeds `ids` in chunks; returns the last token's logits (a copy)."""
        step = self.runner.max_tokens
        last = None
        for s in range(0, len(ids), step):
            chunk = ids[s : s + step]
            final = s + step >= len(ids)
            rows = np.array([len(chunk) - 1], dtype=np.int32) if final else self._all_rows[:0]
            out = self._run(seq, chunk, start + s, rows)
            if final:
                last = out[0].copy()
        return last

    # -- requests

    def logits(self, ids: list[int]) -> np.ndarray:
        """Full-sequence logits [len(ids), vocab] (for scoring)."""
        if len(ids) == 0:
            raise RequestError("empty token list")
        if len(ids) > self.max_model_len:
            raise RequestError(f"{len(ids)} tokens exceed the context of {self.max_model_len}")
        vocab = self.runner.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise RequestError(f"token ids must lie in 0..{vocab - 1}")
        seq = Sequence(list(ids), SamplingParams(max_tokens=1))
        out = np.empty((len(ids), self.runner.config.vocab_size), dtype=np.float32)
        step = self.runner.max_out  # every row is an output row
        try:
            for s in range(0, len(ids), step):
                chunk = ids[s : s + step]
                out[s : s + len(chunk)] = self._run(seq, chunk, s, self._all_rows[: len(chunk)])
        finally:
            self.blocks.free(seq.block_table)
        return out

    def generate_ids(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[tuple[int, str | None]]:
        """Yields (token_id, finish_reason) per new token; finish_reason is set on
        the last one. Stop tokens end generation and are not yielded."""
        self.check_prompt(prompt_ids)
        seq = Sequence(list(prompt_ids), params)
        sampler = Sampler(params)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= set(self.tokenizer.stop_ids)
        stats = self.last_stats = RequestStats(prompt_tokens=len(prompt_ids))
        try:
            t0 = time.perf_counter()
            logits = self._prefill(seq, seq.prompt_ids)
            stats.prefill_s = time.perf_counter() - t0
            while True:
                tok = sampler(logits, seq.all_ids)
                if tok in stop_ids:
                    seq.finish_reason = "stop"
                    yield tok, "stop"
                    return
                seq.output_ids.append(tok)
                n = len(seq.all_ids)
                if len(seq.output_ids) >= params.max_tokens or n >= self.max_model_len:
                    seq.finish_reason = "length"
                    yield tok, "length"
                    return
                yield tok, None
                t0 = time.perf_counter()
                logits = self._run(seq, [tok], n - 1, self._all_rows[:1])[0]
                stats.decode_s += time.perf_counter() - t0
                stats.decode_tokens += 1
        finally:
            self.blocks.free(seq.block_table)

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[StreamEvent]:
        """Text-level stream: whole UTF-8 characters only; stop strings cut the
        text before them (held back while they might still be forming)."""
        dec = self.tokenizer.stream_decoder()
        pending = ""
        hold = max((len(s) for s in params.stop), default=0)
        for tok, reason in self.generate_ids(prompt_ids, params):
            if reason == "stop":  # a stop token (not part of the output): flush and end
                text = pending + dec.flush()
                cut = _find_stop(text, params.stop)
                yield StreamEvent(None, text if cut is None else text[:cut], "stop")
                return
            pending += dec.push(tok)
            if reason is not None:
                pending += dec.flush()
            cut = _find_stop(pending, params.stop)
            if cut is not None:
                yield StreamEvent(tok, pending[:cut], "stop")
                return
            if reason is not None:
                yield StreamEvent(tok, pending, reason)
                return
            # emit all but a tail that could still be the start of a stop string
            keep = _stop_prefix_len(pending, params.stop) if hold else 0
            emit, pending = pending[: len(pending) - keep], pending[len(pending) - keep :]
            yield StreamEvent(tok, emit, None)


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
