"""Draft-model proposals for speculative decoding: a smaller model with the
same vocabulary (speculative="draft:PATH"), or the model's own first N
layers with its final norm and head (speculative="layers:N"), proposes each
sequence's next k tokens greedily; the target verifies them in one step
(engine.Engine._verify), so the output is the target's whatever the draft
says (engine/speculative.py).

The draft runs on its own ModelRunner: its own executor, weights and KV
pool, with as many blocks as the target's, addressed by the target's block
tables (one block id holds a sequence's K/V in both pools). Its steps are
batched across the proposing sequences: a first step computes each
sequence's tokens that the draft has not seen (its whole prompt the first
time, afterwards the tokens accepted since) and gives its first proposal;
each further step adds one proposed token per sequence.

Which of a sequence's positions hold valid draft K/V: those whose tokens
equal what the draft computed there (SpecState.dtoks) in blocks that are
still the sequence's and that no other sequence's draft step wrote since
(DraftProposer.version counts the draft's writes per block). Everything
else is recomputed: after a rejection (the proposed tokens past the
accepted ones), a preemption, a copy-on-write, a block freed and reused. The
target's writes never touch the draft's pool. Blocks for the proposed
tokens come from the target's pool before the step (allocate_slots, whose
copy-on-write copies the draft applies to its own pool at once); the engine
gives back what the plan then drops (BlockManager.truncate)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from llamajet.engine.runner import ModelRunner
from llamajet.engine.scheduler import ScheduledSeq
from llamajet.engine.speculative import Proposer
from llamajet.errors import RequestError
from llamajet.loaders.base import LoadedModel


def first_layers(model: LoadedModel, n: int) -> LoadedModel:
    """The model's first n layers, with its embedding, final norm and head
    (the same mapped weights, no copy)."""
    total = model.config.num_layers
    if not 1 <= n < total:
        raise RequestError(f"speculative=layers:{n}: the draft takes 1..{total - 1} of the model's {total} layers")
    keep = {k: v for k, v in model.weights.items()
            if not (k.startswith("blk.") and int(k.split(".")[1]) >= n)}
    return dataclasses.replace(model, config=dataclasses.replace(model.config, num_layers=n), weights=keep,
                               gguf_reader=None, keepalive=[model])


def draft_model(spec: str, target: LoadedModel) -> LoadedModel:
    """The draft model of speculative="draft:PATH" or "layers:N"."""
    kind, _, arg = spec.partition(":")
    if kind == "layers":
        return first_layers(target, int(arg))
    from llamajet.loaders import load_model

    m = load_model(Path(arg).expanduser())
    if m.config.vocab_size != target.config.vocab_size:
        raise RequestError(f"speculative=draft:{arg}: the draft's vocabulary has {m.config.vocab_size} ids, the "
                           f"model's {target.config.vocab_size}; a draft must share the model's tokenizer")
    return m


class _Proposed:
    """A sequence as a draft step sees it: its tokens with the proposals so
    far appended (the fields ModelRunner.prepare reads)."""

    __slots__ = ("token_ids", "block_table")

    def __init__(self, seq, proposed: list[int]) -> None:
        self.token_ids = seq.token_ids + proposed
        self.block_table = seq.block_table


class DraftProposer(Proposer):
    def __init__(self, k: int, spec: str, runner: ModelRunner, blocks) -> None:
        super().__init__(k)
        self.blocks = blocks
        model = draft_model(spec, runner.model)
        rt = dataclasses.replace(runner.runtime, speculative=None, kv_cache_memory=None,
                                 kv_cache_tokens=runner.num_blocks * runner.block_size)
        self.runner = ModelRunner(model, rt)
        assert self.runner.num_blocks == runner.num_blocks and self.runner.block_size == runner.block_size
        self.version = np.zeros(runner.num_blocks, np.int64)  # draft steps that wrote each block
        self.steps = 0     # draft steps run
        self.tokens = 0    # tokens the draft computed (catch-up and proposed)
        self.proposed = 0  # tokens it proposed

    def propose(self, seq) -> list[int]:
        return self.propose_many([(seq, self.runner.max_model_len - seq.num_tokens)])[0]

    def _valid(self, seq, st) -> int:
        """Positions [0, L) whose draft K/V is valid (see the module docstring), L <= num_tokens - 1."""
        ids, bs = seq.token_ids, self.blocks.block_size
        n = min(len(st.dtoks), seq.num_tokens - 1)
        L = 0
        while L < n and st.dtoks[L] == ids[L]:
            L += 1
        table = seq.block_table
        for i in range(-(-L // bs)):
            if (i >= len(st.dtable) or i >= len(table) or st.dtable[i] != table[i]
                    or st.dvers[i] != self.version[table[i]]):
                return i * bs
        return L

    def propose_many(self, items, limits: list[int] | None = None) -> list[list[int]]:
        """Proposals for (sequence, room) pairs: room = the positions left in
        the context after the sequence's tokens; limits: at most that many
        for each (the engine's plan)."""
        blocks, bs = self.blocks, self.blocks.block_size
        out: list[list[int]] = [[] for _ in items]
        work = []  # [index, seq, next position to compute, k]
        for i, (seq, room) in enumerate(items):
            st = self.state(seq)
            n = seq.num_tokens
            k = self.length(seq, room)
            if limits is not None:
                k = min(k, limits[i])
            if k <= 0:
                continue
            ncopies = len(blocks.pending_copies)
            if not blocks.allocate_slots(seq, n - 1, n + k - 1):  # K/V slots up to the (k-1)th proposal
                continue
            if len(blocks.pending_copies) > ncopies:  # a copy-on-write: the draft's pool copies too
                self.runner.copy_blocks(blocks.pending_copies[ncopies:])
            work.append([i, seq, self._valid(seq, st), k])
        written: set[int] = set()
        active = work
        while active:
            budget, rows = self.runner.max_tokens, self.runner.max_out
            step = []  # (work item, what the step computes for it)
            for w in active:
                i, seq, pos, k = w
                if budget <= 0 or rows <= 0 or len(step) >= self.runner.max_seqs:
                    break
                n = seq.num_tokens
                if pos < n:  # catch-up: the known tokens the draft has not computed
                    c, view = min(n - pos, budget), seq
                else:  # the last proposal, at its position
                    c, view = 1, _Proposed(seq, out[i])
                row = pos + c >= n  # reaches the last known token (or is a proposal): a logits row
                step.append((w, ScheduledSeq(view, pos, c, logits=row)))
                table = seq.block_table
                written.update(table[q] for q in range(pos // bs, (pos + c - 1) // bs + 1))
                budget -= c
                rows -= row
            self.runner.execute(self.runner.prepare([s for _, s in step]))
            greedy = self.runner.greedy_ids(sum(s.logits for _, s in step))
            self.steps += 1
            r = 0
            for w, s in step:
                w[2] += s.num_tokens
                self.tokens += s.num_tokens
                if s.logits:
                    out[w[0]].append(int(greedy[r]))
                    r += 1
            active = [w for w in active if len(out[w[0]]) < w[3]]
        for b in written:
            self.version[b] += 1
        for i, seq, _, k in work:
            st = seq.spec
            n = seq.num_tokens
            st.dtoks = list(seq.token_ids[:n]) + out[i][: k - 1]  # the draft's K/V holds these positions
            st.dtable = list(seq.block_table[: blocks.blocks_for(n + k - 1)])
            st.dvers = [int(self.version[b]) for b in st.dtable]
            self.proposed += len(out[i])
        return out
