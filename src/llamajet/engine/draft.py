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
from dataclasses import replace
from pathlib import Path

import numpy as np

from llamajet.engine.block_manager import kv_slot
from llamajet.engine.runner import ModelRunner, StepBatch
from llamajet.engine.speculative import SpecState
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
    return dataclasses.replace(model, config=replace(model.config, num_layers=n), weights=keep,
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


class DraftProposer:
    def __init__(self, k: int, spec: str, runner: ModelRunner, blocks) -> None:
        self.k, self.blocks = k, blocks
        model = draft_model(spec, runner.model)
        rt = replace(runner.runtime, speculative=None, kv_cache_memory=None,
                     kv_cache_tokens=runner.num_blocks * runner.block_size)
        self.runner = ModelRunner(model, rt)
        assert self.runner.num_blocks == runner.num_blocks and self.runner.block_size == runner.block_size
        self.version = np.zeros(runner.num_blocks, np.int64)  # draft steps that wrote each block
        self.steps = 0     # draft steps run
        self.tokens = 0    # tokens the draft computed (catch-up and proposed)
        self.proposed = 0  # tokens it proposed

    def propose(self, seq) -> list[int]:
        return self.propose_many([(seq, self.runner.max_model_len - seq.num_tokens)])[0]

    def state(self, seq) -> SpecState:
        if seq.spec is None:
            seq.spec = SpecState(self.k)
        return seq.spec

    def length(self, seq, room: int) -> int:
        """How many tokens seq would propose now: its adaptive length, within max_tokens and the context."""
        return max(0, min(self.state(seq).k, seq.params.max_tokens - seq.num_output - 1, room))

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
            tokens, positions, slots, seq_of, out_rows = [], [], [], [], []
            budget, rows = self.runner.max_tokens, self.runner.max_out
            step = []  # (work item, tokens computed for it, whether it gets a logits row)
            for w in active:
                i, seq, pos, k = w
                n = seq.num_tokens
                if budget <= 0 or rows <= 0 or len(step) >= self.runner.max_seqs:
                    break
                if pos < n:  # catch-up: the known tokens the draft has not computed
                    c = min(n - pos, budget)
                    toks = seq.token_ids[pos : pos + c]
                else:  # the last proposal, at its position
                    c, toks = 1, out[i][-1:]
                j = len(step)
                row = pos + c >= n  # reaches the last known token (or is a proposal): a logits row
                if row and rows <= 0:
                    break
                table = seq.block_table
                tokens.extend(toks)
                p = np.arange(pos, pos + c)
                positions.extend(p.tolist())
                slots.extend(kv_slot(table, p, bs).tolist())
                seq_of.extend([j] * c)
                written.update(table[q] for q in range(pos // bs, (pos + c - 1) // bs + 1))
                budget -= c
                if row:
                    out_rows.append(len(tokens) - 1)
                    rows -= 1
                step.append((w, c, row))
            width = max(len(w[1].block_table) for w, _, _ in step)
            tables = np.zeros((len(step), width), dtype=np.int32)
            for j, (w, _, _) in enumerate(step):
                tables[j, : len(w[1].block_table)] = w[1].block_table
            i32 = lambda a: np.asarray(a, dtype=np.int32)  # noqa: E731
            self.runner.execute(StepBatch(i32(tokens), i32(positions), i32(slots), i32(seq_of), tables,
                                          i32(out_rows)))
            greedy = self.runner.greedy_ids(len(out_rows))
            self.steps += 1
            self.tokens += len(tokens)
            r = 0
            for w, c, row in step:
                w[2] += c
                if row:
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
