"""Scheduler: which tokens of which sequences the next step computes.

Continuous batching with one token budget per step (as in vLLM v1): there
are no prefill and decode phases, only sequences whose computed tokens lag
their known tokens. Each step,
1. running sequences, oldest first, get what they lack (1 token when
   decoding, the rest of a long prompt in chunks) while the budget lasts;
   when the KV pool cannot hold a sequence's new tokens, the newest running
   sequence is preempted: its blocks are freed and it goes back to the
   front of the queue, to be recomputed when readmitted (its full blocks
   usually are still in the prefix cache, so this is cheap);
2. then, if nothing was preempted, waiting sequences are admitted in
   arrival order (a prefix-cache hit skips computing the cached blocks) while
   the budget, the sequence limit and the pool allow; the first that does
   not fit stops admission, so no request is starved by later smaller ones.

A step also returns at most `max_rows` logits rows (the runner's max_out):
one per sequence whose chunk reaches its last token (it samples), and, for a
sequence with prompt_logprobs, one per prompt position its chunk computes
(row q scores prompt token q + 1). Such a chunk is cut where the step's rows
run out, and such a sequence takes nothing from the prefix cache for the
positions whose rows it still needs (a cache hit computes no logits).
NOTE: each running sequence keeps a row for every running sequence after it
(max_rows >= max_num_seqs), so every running sequence can have its sampling
row in every step, however many rows the scoring chunks take.

NOTE: the oldest running sequence can always proceed: admission
(Engine.add_request) refuses any request whose longest possible length does
not fit the whole pool, and every other running sequence can be preempted to
make room. So preemption never loops and no request fails for lack of space.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from llamajet.engine.block_manager import BlockManager
from llamajet.engine.sequence import Sequence, Status


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    start: int        # first position computed this step (= seq.num_computed)
    num_tokens: int   # tokens computed this step: positions start .. start + num_tokens - 1
    logits: bool      # the chunk reaches the last known token: sample the next one (never when score-only)
    scored: range = range(0)  # positions whose rows score the prompt token after them (prompt_logprobs)
    # proposed tokens computed after the last known one (speculative decoding; only with logits): they
    # take positions start + num_tokens - len(draft) ..; each gets a row after the sampling row
    draft: tuple[int, ...] = ()

    @property
    def num_rows(self) -> int:
        """Logits rows the step returns for it: the scored positions' in
        order, then the sampling row, then one per proposed token."""
        return len(self.scored) + (1 + len(self.draft) if self.logits else 0)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # KV block copies (src, dst) to do first
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def num_rows(self) -> int:
        return sum(s.num_rows for s in self.scheduled)


class Scheduler:
    def __init__(self, blocks: BlockManager, *, max_num_seqs: int, max_tokens: int, max_rows: int) -> None:
        if max_rows < max_num_seqs:
            raise ValueError(f"max_rows={max_rows} < max_num_seqs={max_num_seqs}: a step must have a logits "
                             "row for each sequence")
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_tokens = max_tokens  # token budget of one step
        self.max_rows = max_rows      # logits rows one step returns at most
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last is the newest
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends `seq` (running or waiting) and frees its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:  # (a new Sequence is WAITING before it is queued)
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget, rows = self.max_tokens, self.max_rows
        # 1. running sequences, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            # one row kept for each later running sequence: a scoring chunk
            # never holds back another sequence's next token
            later = len(self.running) - i - 1
            # proposed tokens ride along only on a decode step (the last known token is all that is left)
            draft = seq.draft if seq.draft and seq.num_tokens - seq.num_computed == 1 else ()
            chunk = self._chunk(seq, seq.num_computed, min(seq.num_tokens - seq.num_computed + len(draft), budget),
                                rows - later, draft)
            n = chunk.num_tokens
            assert n > 0, "rows - later >= 1 (see the NOTE on rows)"
            if chunk.draft and not self.blocks.allocate_slots(seq, seq.num_computed, seq.num_computed + n):
                # proposed tokens never preempt anyone: without room for them, the plain decode token
                chunk = self._chunk(seq, seq.num_computed, 1, rows - later)
                n = chunk.num_tokens
            while not self.blocks.allocate_slots(seq, seq.num_computed, seq.num_computed + n):
                victim = self.running.pop()  # the newest; never one scheduled already (index > i)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(chunk)
                budget -= n
                rows -= chunk.num_rows
                i += 1
                continue
            break  # seq preempted itself: it was the newest, nothing after it
        # 2. admissions, in arrival order
        # Choices of n > 1 requests not yet forked hold their places: they join
        # `running` at their parent's first draw.
        reserved = len(self.running) + sum(len(s.forks) for s in self.running)
        while (self.waiting and budget > 0 and not out.preempted
               and reserved + 1 + len(self.waiting[0].forks) <= self.max_num_seqs):
            seq = self.waiting[0]
            # Cached blocks may cover only positions whose rows no prompt
            # logprob needs any more: none at all for a new scoring request.
            need = seq.scoring_from
            hits = self.blocks.match_prefix(seq) if seq.num_computed == 0 and need != 0 else []
            if need is not None:
                hits = hits[: need // self.blocks.block_size]
            # At least the last token is computed (its logits give the next
            # token); when every block hit, it is rewritten into a copy.
            start = min(len(hits) * self.blocks.block_size, seq.num_tokens - 1)
            chunk = self._chunk(seq, start, min(seq.num_tokens - start, budget), rows)
            n = chunk.num_tokens
            if n == 0 or not self.blocks.allocate_slots(seq, start, start + n, hits):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            if seq.admit_time is None:
                seq.admit_time = time.perf_counter()
            seq.num_computed = start
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = start
            self.running.append(seq)
            reserved += 1 + len(seq.forks)
            out.scheduled.append(chunk)
            budget -= n
            rows -= chunk.num_rows
        out.copies = self.blocks.take_copies()
        return out

    @staticmethod
    def _chunk(seq: Sequence, start: int, n: int, rows: int, draft=()) -> ScheduledSeq:
        """seq's chunk of at most n tokens from `start`, cut so that it takes
        at most `rows` logits rows (num_tokens 0: none fits). `draft`:
        proposed tokens after the known ones (a decode step), kept as far as
        the tokens and rows allow."""
        if draft:
            keep = max(0, min(len(draft), n - 1, rows - 1))
            return ScheduledSeq(seq, start, 1 + keep if rows >= 1 else 0, rows >= 1, draft=tuple(draft[:keep]))
        end, scored = start + n, range(0)
        first = seq.scoring_from
        if first is not None:
            # each position of [lo, num_prompt - 1) takes a row; earlier ones were scored already
            lo, stop = max(start, first), seq.num_prompt - 1
            if lo + rows < stop:
                end = min(end, lo + rows)
            scored = range(lo, max(lo, min(end, stop)))
            rows -= len(scored)
        sample = end == seq.num_tokens and not seq.params.score_only
        if sample and rows < 1:  # the last token waits for a step with a row left
            end, sample = end - 1, False
        return ScheduledSeq(seq, start, end - start, sample, scored)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
