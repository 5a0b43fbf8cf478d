"""Engine: requests in, tokens out, many requests at once.

The engine is four nouns — Sequence, Scheduler, BlockManager, ModelRunner —
and a step is schedule -> run -> postprocess:
- schedule: the Scheduler picks the tokens to compute (decode tokens of
  running sequences, chunks of new prompts) within the step's token budget,
  and the BlockManager gives them KV slots (prefix hits, copy-on-write,
  preemption when the pool is full);
- run: the ModelRunner computes them all in one executor call;
- postprocess: a sequence with prompt_logprobs stores those of the prompt
  tokens its chunk scored (Sequence.prompt_logprobs); each sequence whose
  chunk reached its last token samples its next token, checks its stop
  conditions and queues a StreamEvent (a score-only request, max_tokens=0,
  queues its closing event instead); finished sequences free their blocks at
  once.

Requests join between steps (`add_request`); `stream` / `generate` drive the
loop synchronously, `AsyncEngine` (async_engine.py) from asyncio.

Threads: one lock (`Engine.lock`) guards the scheduler, the block pool and
the runner's arena. Every step, every scoring pass (`logits`) and every
add/abort of the synchronous drivers takes it, so drivers on several threads
(two `stream` consumers, a sync call beside the AsyncEngine's worker thread)
interleave whole steps and never corrupt the KV pool; each reads its own
sequences' events. Nothing else may change the engine from another thread
than the one holding the lock: other threads hand requests in with `post`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Iterator

import numpy as np

from llamajet.engine.block_manager import BlockManager, kv_slot
from llamajet.engine.runner import ModelRunner, StepBatch
from llamajet.engine.sampling import SamplingParams, log_softmax, top_logprobs
from llamajet.engine.scheduler import ScheduledSeq, Scheduler
from llamajet.engine.sequence import Sequence, Status, StreamEvent, TextStream
from llamajet.engine.speculative import PROBE_ACCEPTANCE, make_proposer, measure_step_cost, plan
from llamajet.errors import RequestError

__all__ = ["Engine", "EngineStats", "RequestStats", "StreamEvent"]


@dataclass
class RequestStats:
    """Wall-clock split of one request: prefill (arrival -> first token) and
    decode (first -> last token), for `llamajet generate --stats`."""

    prompt_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    cached_tokens: int = 0       # prompt tokens served from the prefix cache
    preemptions: int = 0
    extra: dict = field(default_factory=dict)


@dataclass
class EngineStats:
    """Totals since the engine started (for bench and metrics)."""

    steps: int = 0
    tokens: int = 0              # tokens computed (prefill + decode)
    generated: int = 0           # tokens sampled
    kv_slots_used: int = 0       # sum over steps of slots in blocks held by running sequences
    kv_tokens_held: int = 0      # sum over steps of tokens those sequences hold
    # speculative decoding (engine/speculative.py; vLLM's spec_decode_* counters)
    spec_drafts: int = 0         # verifications of one or more proposed tokens
    spec_draft_tokens: int = 0   # tokens proposed and computed
    spec_accepted_tokens: int = 0  # proposed tokens that were the sequence's next tokens
    spec_accepted_per_pos: list[int] = field(default_factory=list)  # [j]: accepted at proposed position j


class Engine:
    def __init__(self, runner: ModelRunner, tokenizer) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = runner.runtime  # the RuntimeConfig, max_model_len resolved
        self.blocks = BlockManager(runner.num_blocks, runner.block_size, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_num_seqs=runner.max_seqs, max_tokens=runner.max_tokens,
                                   max_rows=runner.max_out)
        self._all_rows = np.arange(runner.max_out, dtype=np.int32)
        self.proposer = make_proposer(self.config.speculative, self.config.num_speculative_tokens, runner,
                                      self.blocks)
        self._inbox: deque[tuple[str, Sequence]] = deque()  # from other threads, see post()
        self.lock = threading.Lock()  # see the module docstring
        self.last_stats = RequestStats()
        self.stats = EngineStats()
        self.last_schedule = None  # the SchedulerOutput of the latest step (for bench and tests)
        # speculative decoding's step-cost model (engine/speculative.py), and the
        # acceptance across sequences (decayed counts), each sequence's prior
        self.step_cost = None
        self.draft_cost = None  # a draft model's seconds per proposed token (engine/draft.py)
        self._spec_acc = self._spec_rej = 0.0
        if self.proposer is not None and self.config.speculative_cost_model:
            self.step_cost = self._measure_step_cost()

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    # ------------------------------------------------------------ admission

    def check_prompt(self, ids: list[int], score_only: bool = False) -> None:
        """score_only: no new token follows, so the prompt may fill the context."""
        if len(ids) == 0:
            raise RequestError("empty prompt: give at least one token")
        vocab = self.runner.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        if len(ids) > self.max_model_len or (len(ids) == self.max_model_len and not score_only):
            raise RequestError(
                f"prompt has {len(ids)} tokens but the context holds {self.max_model_len} "
                f"(prompt + at least one new token); shorten it or raise max_model_len")

    def check_request(self, ids: list[int], params: SamplingParams) -> None:
        """Refuses, before anything runs, a request that could never be
        served: bad prompt, or longer at its longest than the whole KV pool
        (it would preempt itself forever)."""
        self.check_prompt(ids, params.score_only)
        if params.n > self.scheduler.max_num_seqs:
            raise RequestError(f"n={params.n} choices but the engine runs at most "
                               f"{self.scheduler.max_num_seqs} sequences at once (max_num_seqs)")
        longest = min(len(ids) + params.max_tokens, self.max_model_len)
        need = self.blocks.blocks_for(longest)
        if need > self.blocks.num_blocks:
            bs = self.blocks.block_size
            raise RequestError(
                f"request needs up to {longest} tokens of KV cache ({len(ids)} prompt + up to "
                f"{params.max_tokens} new) but the pool holds {self.blocks.num_blocks * bs} "
                f"({self.blocks.num_blocks} blocks of {bs}); lower max_tokens or raise kv_cache_tokens")

    def new_sequence(self, prompt_ids: list[int], params: SamplingParams, constraint=None) -> Sequence:
        """A validated Sequence for the request (not yet queued). With
        params.n > 1 it carries the other choices in `forks`; constraint: a
        sampling.Constraint for structured output (each choice gets a copy)."""
        ids = [int(t) for t in prompt_ids]
        self.check_request(ids, params)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= set(self.tokenizer.stop_ids)
        stop_ids = frozenset(stop_ids)

        def one(i: int, c) -> Sequence:
            return Sequence(ids, params, stop_ids, TextStream(self.tokenizer.stream_decoder(), params.stop, i),
                            index=i, constraint=c)

        seq = one(0, constraint)
        seq.forks = [one(i, constraint.copy() if constraint is not None else None) for i in range(1, params.n)]
        return seq

    def add_request(self, prompt_ids: list[int] | Sequence, params: SamplingParams | None = None) -> Sequence:
        """Queues a request; it joins the running batch at the next step.
        Call from the thread that steps the engine (else use `post`)."""
        seq = prompt_ids if isinstance(prompt_ids, Sequence) else self.new_sequence(prompt_ids, params)
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Ends `seq` (and its choices not yet started) now and frees its
        blocks (from the stepping thread)."""
        for child in seq.forks:
            self.abort(child)
        if not seq.finished:
            self.scheduler.finish(seq, "abort")
            seq.finish_time = time.perf_counter()

    def post(self, what: str, seq: Sequence) -> None:
        """Thread-safe add_request ("add") or abort ("abort"): done at the
        start of the next step, by whichever thread steps the engine."""
        self._inbox.append((what, seq))  # deque.append is atomic

    def _drain_inbox(self) -> None:
        while self._inbox:
            what, seq = self._inbox.popleft()
            if what == "add":
                if not seq.finished:
                    self.add_request(seq)
            else:
                self.abort(seq)

    def has_unfinished(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_unfinished()

    # ------------------------------------------------------------ one step

    def step(self) -> list[Sequence]:
        """schedule -> run -> postprocess. Returns the sequences that got a
        new event (in seq.events). Holds `lock` throughout."""
        with self.lock:
            return self._step()

    def _step(self) -> list[Sequence]:
        self._drain_inbox()
        if self.proposer is not None:
            self._propose()
        out = self.last_schedule = self.scheduler.schedule()
        if not out.scheduled:
            return []
        t0 = time.perf_counter()
        logits = self.runner.run(out.scheduled, out.copies)
        if self.step_cost is not None:
            self.step_cost.observe(out.num_tokens, time.perf_counter() - t0, len(out.scheduled))
        st = self.stats
        st.steps += 1
        st.tokens += out.num_tokens
        # Plain greedy sampling rows (nothing changes the logits: the
        # sampler's own rule is this argmax, first index on ties) from the
        # step's argmax op (runner.greedy_ids).
        plain = [s.logits and s.seq.params.plain_greedy and s.seq.constraint is None and not s.seq.forks
                 for s in out.scheduled]
        argmax = self.runner.greedy_ids(len(logits)) if any(plain) else None
        touched, row = [], 0  # rows come per sequence: its scored positions', then its sampling row
        for s, greedy in zip(out.scheduled, plain):
            seq = s.seq
            k = len(s.draft)
            seq.num_computed = s.start + s.num_tokens - k  # proposed tokens count once accepted (_verify)
            seq.num_tokens_run += s.num_tokens
            if not k:
                self.blocks.cache_blocks(seq)
            if s.scored:
                self._score_prompt(seq, s.scored, logits[row : row + len(s.scored)])
                row += len(s.scored)
            if s.logits and k:
                self._verify(seq, s.draft, logits[row : row + k + 1], argmax[row : row + k + 1] if greedy else None)
                row += k + 1
                touched.append(seq)
            elif s.logits:
                self._append(seq, logits[row], int(argmax[row]) if greedy else None, touched)
                row += 1
                touched.append(seq)
            elif seq.params.score_only and seq.num_computed == seq.num_tokens:
                self._end_scoring(seq, touched)
        for seq in self.scheduler.running:  # KV use vs tokens held, after this step
            st.kv_slots_used += len(seq.block_table) * self.blocks.block_size
            st.kv_tokens_held += seq.num_computed
        return touched

    def _propose(self) -> None:
        """Proposed next tokens for each running sequence at a decode step
        (engine/speculative.py); none for one still in its prompt, scoring
        it, or about to fork."""
        limit = self.max_model_len
        base, eligible = 0, []  # the step's tokens without proposals; who may propose, with its room
        batch = len(self.scheduler.running)
        for seq in self.scheduler.running:
            seq.draft = []
            left = seq.num_tokens - seq.num_computed
            base += left
            if left == 1 and not seq.forks and seq.scoring_from is None and seq.params.speculative:
                room = limit - seq.num_tokens  # the last proposed token's position stays < max_model_len
                if room > 0:
                    eligible.append((seq, room))
        if not eligible:
            return
        base = min(base, self.config.step_tokens)
        many = getattr(self.proposer, "propose_many", None)  # a draft model: one batched run for all
        if many:
            self._propose_draft(base, eligible, batch)
            return
        proposing = []
        for seq, room in eligible:
            seq.draft = self.proposer.propose(seq)[:room]
            if seq.draft:
                proposing.append(seq)
        if self.step_cost is not None and proposing:
            self._plan_drafts(base, proposing, batch)

    def _propose_draft(self, base: int, eligible: list[tuple[Sequence, int]], batch: int) -> None:
        """A draft model's proposals. Its tokens cost time before the step
        (draft_cost seconds each, measured at start, then as observed), so
        the plan runs first, on the lengths the sequences would propose, with
        that cost added, and the draft computes only the tokens the plan
        keeps; none at all where none pays."""
        p = self.proposer
        limits = None
        if self.step_cost is not None:
            seqs = []
            for seq, room in eligible:
                seq.draft = [0] * p.length(seq, room)  # placeholders: only their count is planned
                seqs.append(seq)
            self._plan_drafts(base, seqs, batch, per_token=self.draft_cost)
            limits = [len(seq.draft) for seq in seqs]
        t0 = time.perf_counter()
        drafts = p.propose_many(eligible, limits)
        n = sum(map(len, drafts))
        if n and self.draft_cost is not None:
            self.draft_cost += self.step_cost.EMA * ((time.perf_counter() - t0) / n - self.draft_cost)
        for (seq, room), d in zip(eligible, drafts):
            seq.draft = d[:room]
            # the draft took blocks for what it computed: back any past what is verified
            self.blocks.truncate(seq, seq.num_tokens + len(seq.draft))

    def _plan_drafts(self, base: int, seqs: list[Sequence], batch: int = 1, per_token: float | None = None) -> None:
        """Cuts the proposals to what the step-cost model says pays
        (speculative.plan), each proposed token also costing `per_token`
        seconds (a draft model's); a sequence whose proposals it keeps
        dropping is probed at PROBE_ACCEPTANCE now and then (SpecState.probe_gap)."""
        prior = (self._spec_acc + 0.5) / (self._spec_acc + self._spec_rej + 1.0)
        cands = [(seq.spec.acceptance(prior, 2.0), len(seq.draft)) for seq in seqs]
        extra = per_token or 0.0

        def cost(n: int) -> float:
            return self.step_cost(n, batch) + extra * (n - base)

        for seq, k, (_, n) in zip(seqs, plan(base, cands, cost), cands):
            st = seq.spec
            if k == 0:
                st.skipped += 1
                if st.skipped >= st.probe_gap:
                    k = plan(base, [(PROBE_ACCEPTANCE, n)], cost)[0]
                    st.probing = k > 0
                    st.skipped = 0
            else:
                st.skipped = 0
            seq.draft = seq.draft[:k]

    def _measure_step_cost(self):
        """StepCost from steps of 1, 2, 3, 5, 9, 17 tokens (a one-token
        sequence and a proposal of the rest, at the start of the context), in
        blocks taken from the pool and given back; sizes stop where the
        measurement would pass about a second (a big model on a slow CPU)."""
        seq = Sequence([0], SamplingParams(max_tokens=1))
        cap = min(self.runner.max_out, self.config.step_tokens, self.max_model_len - 1,
                  self.blocks.num_blocks * self.blocks.block_size)
        def run_step(n: int) -> None:
            self.runner.run([ScheduledSeq(seq, 0, n, True, draft=(0,) * (n - 1))])

        sizes, spent = [], 0.0
        try:
            for n in (1, 2, 3, 5, 9, 17):  # each run once as its warm-up (twice for the first)
                if n > cap or not self.blocks.allocate_slots(seq, 0, n):
                    break
                t0 = time.perf_counter()
                run_step(n)
                spent += 2 * (time.perf_counter() - t0)  # with the timed run to come
                sizes.append(n)
                if spent > 1.0:
                    break
            run_step(1)
            cost = measure_step_cost(run_step, sizes, reps=1)
            draft = getattr(self.proposer, "runner", None)
            if draft is not None:  # the draft's 1-token step, in the same blocks of its own pool
                one = [ScheduledSeq(seq, 0, 1, True)]
                draft.run(one)
                t0 = time.perf_counter()
                draft.run(one)
                self.draft_cost = time.perf_counter() - t0
            return cost
        finally:
            self.blocks.free(seq)

    def _verify(self, seq: Sequence, draft: tuple[int, ...], rows: np.ndarray, greedy: np.ndarray | None) -> None:
        """Emits seq's tokens from the rows of its last token and its
        proposed ones, as plain decoding would (engine/speculative.py):
        token j is drawn from row j by the sequence's own sampler, and row
        j + 1 is used only while the drawn token equals proposed token j.
        Then the blocks past the known tokens go back and the accepted ones
        are offered to the prefix cache."""
        accepted = 0
        for j in range(len(draft) + 1):
            self._append(seq, rows[j], int(greedy[j]) if greedy is not None else None)
            if seq.finished or j == len(draft) or seq.token_ids[-1] != draft[j]:
                break
            seq.num_computed += 1  # proposed token j's K/V is that of the token now at its position
            accepted += 1
        st = self.stats
        st.spec_drafts += 1
        st.spec_draft_tokens += len(draft)
        st.spec_accepted_tokens += accepted
        per = st.spec_accepted_per_pos
        per.extend([0] * (accepted - len(per)))
        for j in range(accepted):
            per[j] += 1
        seq.spec.update(len(draft), accepted)
        d = seq.spec.DECAY
        self._spec_acc = self._spec_acc * d + accepted
        self._spec_rej = self._spec_rej * d + (accepted < len(draft))
        seq.draft = []
        if not seq.finished:
            self.blocks.truncate(seq, seq.num_tokens)
            self.blocks.cache_blocks(seq)

    def _fork(self, seq: Sequence, logits: np.ndarray, touched: list[Sequence] | None) -> None:
        """Starts seq's other choices at its first draw: each shares seq's
        blocks (the prompt is computed once; copy-on-write after) and draws
        its own first token from the same logits row."""
        forks, seq.forks = seq.forks, []
        for child in forks:
            if child.finished:  # aborted before it started
                continue
            self.blocks.fork(seq, child)
            child.status = Status.RUNNING
            child.num_cached_tokens = seq.num_cached_tokens
            child.arrival_time = seq.arrival_time
            child.admit_time = seq.admit_time
            child.prompt_logprobs = seq.prompt_logprobs  # the same prompt: scored once, by seq
            self.scheduler.running.append(child)
            self._append(child, logits)
            if touched is not None:
                touched.append(child)

    def _append(self, seq: Sequence, logits: np.ndarray, tok: int | None = None,
                touched: list[Sequence] | None = None) -> None:
        """Samples seq's next token from its logits row (tok: already chosen
        greedily); stops it if done."""
        if seq.forks:
            self._fork(seq, logits, touched)
        c = seq.constraint
        if tok is None:
            allowed = c.allowed(logits.shape[-1]) if c is not None else None
            tok = seq.sampler(logits, seq.token_ids, seq.num_prompt, allowed)
        lp, top = None, ()
        if seq.params.logprobs is not None:
            ls = log_softmax(logits)
            lp, top = float(ls[tok]), top_logprobs(ls, seq.params.logprobs)
        now = time.perf_counter()
        if seq.first_token_time is None:
            seq.first_token_time = now
        self.stats.generated += 1
        if c is not None:
            c.consume(tok)
        if tok in seq.stop_ids:  # a stop token ends the sequence and is not part of it
            seq.events.append(seq.text.push(tok, "stop"))
            return self._finish(seq, "stop")
        seq.token_ids.append(tok)
        done = seq.num_output >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len
        grammar_done = c is not None and c.is_done()
        ev = seq.text.push(tok, "length" if done and not grammar_done else "end" if grammar_done else None)
        if lp is not None:
            ev = replace(ev, logprob=lp, top_logprobs=top)
        seq.events.append(ev)
        if ev.finish_reason is not None:  # length, or a stop string completed, or the grammar's end
            self._finish(seq, ev.finish_reason)

    def _score_prompt(self, seq: Sequence, scored: range, rows: np.ndarray) -> None:
        """Stores the prompt logprobs that `rows` (those of positions
        `scored`) give: row q scores prompt token q + 1."""
        pl, ids, k = seq.prompt_logprobs, seq.token_ids, seq.params.prompt_logprobs
        # NOTE: positions are scored once each, in order (Scheduler._chunk asks
        # only for rows from seq.scoring_from on)
        assert len(pl) == scored.start + 1, (len(pl), scored)
        for q, x in zip(scored, rows):
            ls = log_softmax(x)
            pl.append((float(ls[ids[q + 1]]), top_logprobs(ls, k)))

    def _end_scoring(self, seq: Sequence, touched: list[Sequence]) -> None:
        """A score-only request's prompt is computed: each choice gets one
        closing event (no token) and the request ends."""
        forks, seq.forks = seq.forks, []
        for s in [seq, *forks]:
            if s.finished:  # a choice aborted before it started
                continue
            s.prompt_logprobs = seq.prompt_logprobs
            s.events.append(StreamEvent(None, "", "length", s.index))
            self._finish(s, "length")
            touched.append(s)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        if self.proposer is not None and hasattr(self.proposer, "finished"):
            self.proposer.finished(seq)
        seq.finish_time = time.perf_counter()
        first = seq.first_token_time or seq.finish_time
        self.last_stats = RequestStats(
            prompt_tokens=seq.num_prompt, prefill_s=first - seq.arrival_time,
            decode_tokens=max(seq.num_output - 1, 0), decode_s=seq.finish_time - first,
            cached_tokens=seq.num_cached_tokens, preemptions=seq.num_preemptions)

    # ------------------------------------------------------------ driving

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[StreamEvent]:
        """Adds the request and steps the engine (every queued request moves
        along) until it finishes, yielding its events as they come."""
        with self.lock:
            seq = self.add_request(prompt_ids, params)
        try:
            while True:
                while seq.events:
                    ev = seq.events.popleft()
                    yield ev
                    if ev.finish_reason is not None:
                        return
                if seq.finished:
                    return
                self.step()
        finally:
            with self.lock:
                self.abort(seq)  # a consumer that stops early frees the blocks

    def run_all(self, seqs: list[Sequence]) -> list[Sequence]:
        """Queues `seqs` and steps until every one, and every other choice of
        an n > 1 request (its forks, taken now: the head hands them to the
        running batch at its first token), has finished."""
        members = [m for s in seqs for m in (s, *s.forks)]
        with self.lock:
            for s in seqs:
                self.add_request(s)
        try:
            while any(not m.finished for m in members):
                self.step()
        finally:
            with self.lock:
                for m in members:
                    self.abort(m)
        return seqs

    # ------------------------------------------------------------ scoring

    def logits(self, ids: list[int]) -> np.ndarray:
        """Full-sequence logits [len(ids), vocab] (for scoring). Runs alone,
        between steps, in blocks of its own (no prefix cache: every row is
        computed). Holds `lock` throughout."""
        if len(ids) == 0:
            raise RequestError("empty token list")
        if len(ids) > self.max_model_len:
            raise RequestError(f"{len(ids)} tokens exceed the context of {self.max_model_len}")
        vocab = self.runner.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise RequestError(f"token ids must lie in 0..{vocab - 1}")
        with self.lock:
            return self._logits(ids, vocab)

    def _logits(self, ids: list[int], vocab: int) -> np.ndarray:
        seq = Sequence(list(ids), SamplingParams(max_tokens=1))
        if self.blocks.blocks_for(len(ids)) > self.blocks.num_blocks:
            raise RequestError(f"{len(ids)} tokens exceed the KV pool of "
                               f"{self.blocks.num_blocks * self.blocks.block_size} (raise kv_cache_tokens)")
        if not self.blocks.allocate_slots(seq, 0, len(ids)):
            raise RequestError(f"KV cache busy: {len(ids)} tokens need {self.blocks.blocks_for(len(ids))} "
                               f"blocks, {self.blocks.num_free} free")
        out = np.empty((len(ids), vocab), dtype=np.float32)
        step = self.runner.max_out  # every row is an output row
        bs = self.blocks.block_size
        table = np.asarray(seq.block_table, dtype=np.int32)
        bt = table[None, :]
        try:
            for s in range(0, len(ids), step):
                n = min(step, len(ids) - s)
                pos = np.arange(s, s + n, dtype=np.int32)
                slots = kv_slot(table, pos, bs).astype(np.int32)
                batch = StepBatch(np.asarray(ids[s : s + n], dtype=np.int32), pos, slots,
                                  np.zeros(n, dtype=np.int32), bt, self._all_rows[:n])
                out[s : s + n] = self.runner.execute(batch)
        finally:
            self.blocks.free(seq)
        return out
