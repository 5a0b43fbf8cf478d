"""BlockManager: free list, reference counts, prefix sharing, copy-on-write,
LRU eviction — unit tests and a property-based state machine.

The state machine drives the BlockManager the way the Scheduler does
(admission with prefix hits, chunked prefill, decode, fork, preemption,
finish) on a small pool, and simulates the KV pool's contents: computing
position p of a sequence writes "the K/V of tokens[:p+1]" (here: that prefix
itself) into its slot, and pending copy-on-write copies are done before each
write, as the runner does. After every operation it checks the invariants
(`BlockManager.check`: ref counts equal the number of tables holding a block,
free list = blocks with ref 0, cache index consistent) and that every
sequence reads back, through its block table, exactly its own prefixes at
every computed position — so no block was handed out while in use, shared
wrongly, or overwritten while shared. At the end every sequence is freed and
all counts must be back to zero.
"""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, settings, strategies as st  # noqa: E402
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,  # noqa: E402
                                 rule)

from llamajet.engine.block_manager import BlockManager, block_hash  # noqa: E402
from llamajet.engine.sampling import SamplingParams  # noqa: E402
from llamajet.engine.sequence import Sequence  # noqa: E402
from llamajet.errors import RequestError  # noqa: E402

P = SamplingParams(max_tokens=1)


def seq(tokens) -> Sequence:
    return Sequence(list(tokens), P)


def admit(bm: BlockManager, s: Sequence, chunk: int | None = None) -> bool:
    """What the Scheduler does for a waiting sequence."""
    hits = bm.match_prefix(s)
    start = min(len(hits) * bm.block_size, s.num_tokens - 1)
    end = s.num_tokens if chunk is None else min(s.num_tokens, start + chunk)
    if not bm.allocate_slots(s, start, end, hits):
        return False
    s.num_computed = end
    bm.cache_blocks(s)
    return True


# ------------------------------------------------------------------ unit tests


def test_allocate_free_and_slots():
    bm = BlockManager(8, 4)
    a = seq(range(10))
    assert bm.allocate_slots(a, 0, 10)
    assert len(a.block_table) == 3 and bm.num_free == 5
    assert [bm.slot(a.block_table, p) for p in (0, 3, 4, 9)] == [
        a.block_table[0] * 4, a.block_table[0] * 4 + 3, a.block_table[1] * 4, a.block_table[2] * 4 + 1]
    bm.check([a.block_table])
    bm.free(a)
    assert a.block_table == [] and bm.num_free == 8
    bm.check()


def test_allocation_is_all_or_nothing():
    bm = BlockManager(4, 4)
    a, b = seq(range(12)), seq(range(100, 108))
    assert bm.allocate_slots(a, 0, 12)
    assert not bm.allocate_slots(b, 0, 8)  # needs 2, 1 free
    assert b.block_table == [] and bm.num_free == 1
    bm.check([a.block_table])


def test_chained_hash_names_the_whole_prefix():
    # the same 4 tokens after different prefixes are different blocks
    assert block_hash(block_hash(None, [1, 2, 3, 4]), [5, 6, 7, 8]) != block_hash(
        block_hash(None, [9, 2, 3, 4]), [5, 6, 7, 8])
    assert block_hash(None, [1, 2, 3, 4]) == block_hash(None, (1, 2, 3, 4))


def test_prefix_hit_reuses_full_blocks_only():
    bm = BlockManager(16, 4)
    a = seq(range(10))  # blocks: [0..3] [4..7] [8, 9]
    assert admit(bm, a)
    assert bm.num_cached == 2  # the partial block is not cached
    b = seq(list(range(8)) + [50, 51, 52])
    hits = bm.match_prefix(b)
    assert [h.id for h in hits] == a.block_table[:2]
    assert admit(bm, b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.num_computed == 11
    for bid in a.block_table[:2]:
        assert bm.blocks[bid].ref_count == 2
    bm.check([a.block_table, b.block_table])
    # a different first block: no hit at all, even if later tokens agree
    c = seq([99] + list(range(1, 10)))
    assert bm.match_prefix(c) == []


def test_full_hit_recomputes_last_token_into_a_copy():
    """A prompt whose every block is cached still computes its last token (its
    logits give the next token); that write goes to a copy of the cached block."""
    bm = BlockManager(8, 4)
    a = seq(range(8))
    assert admit(bm, a)
    bm.free(a)
    assert bm.num_cached == 2 and bm.num_free == 8  # cached blocks are free, reusable
    b = seq(range(8))
    assert admit(bm, b)
    copies = bm.take_copies()
    assert len(copies) == 1
    src, dst = copies[0]
    assert b.block_table[1] == dst and b.block_table[0] != dst
    assert bm.blocks[src].hash is not None and bm.blocks[src].ref_count == 0  # still cached
    assert bm.blocks[dst].hash is None
    bm.check([b.block_table])


def test_fork_shares_then_copies_on_write():
    bm = BlockManager(8, 4)
    a = seq(range(6))
    assert admit(bm, a)
    b = seq(range(6))
    bm.fork(a, b)
    assert b.block_table == a.block_table and all(bm.blocks[i].ref_count == 2 for i in a.block_table)
    bm.check([a.block_table, b.block_table])
    # b appends a token: its write into the shared partial block copies it
    b.token_ids.append(7)
    assert bm.allocate_slots(b, 6, 7)
    (src, dst), = bm.take_copies()
    assert src == a.block_table[1] and b.block_table == [a.block_table[0], dst]
    assert bm.blocks[src].ref_count == 1  # a alone now: a writes in place
    a.token_ids.append(8)
    assert bm.allocate_slots(a, 6, 7) and bm.take_copies() == []
    bm.check([a.block_table, b.block_table])


def test_lru_eviction_keeps_recent_and_head_blocks():
    bm = BlockManager(6, 4)
    a, b = seq(range(8)), seq(range(100, 108))
    assert admit(bm, a) and admit(bm, b)
    bm.free(a)          # a's blocks freed first: least recent
    bm.free(b)
    assert bm.num_cached == 4
    c = seq(range(200, 216))  # 4 fresh blocks: 2 never-used ones, then a's (oldest) two
    assert admit(bm, c)
    assert bm.num_evictions == 2
    assert bm.match_prefix(seq(range(8))) == []                 # a evicted
    assert len(bm.match_prefix(seq(range(100, 108)))) == 2      # b still cached
    bm.check([c.block_table])


def test_freed_tail_is_evicted_before_head():
    """A sequence's blocks are freed last-first, so under pressure its tail
    goes before its more shareable head."""
    bm = BlockManager(3, 2)
    a = seq(range(6))
    assert admit(bm, a)
    bm.free(a)
    b = seq([9, 9])
    assert admit(bm, b)  # takes one block: must be a's last
    assert len(bm.match_prefix(seq(range(6)))) == 2


def test_uncached_free_blocks_are_reused_before_cached_ones():
    bm = BlockManager(2, 4)
    x, y = seq(range(4)), seq([7, 7])  # x: one full (cached) block; y: one partial block
    assert admit(bm, x) and admit(bm, y)
    bm.free(x)
    bm.free(y)  # freed later, but holds nothing reusable: handed out first
    z = seq([8, 8])
    assert admit(bm, z)
    assert len(bm.match_prefix(seq(range(4)))) == 1  # x's cached block survived


def test_caching_off_shares_nothing():
    bm = BlockManager(8, 4, enable_caching=False)
    a, b = seq(range(8)), seq(range(8))
    assert admit(bm, a) and admit(bm, b)
    assert set(a.block_table).isdisjoint(b.block_table) and bm.num_cached == 0


def test_ensure_grows_a_bare_table():
    bm = BlockManager(3, 4)
    t: list[int] = []
    bm.ensure(t, 5)
    assert len(t) == 2
    with pytest.raises(RequestError, match="KV cache full"):
        bm.ensure(t, 20)


# ------------------------------------------------------------------ the state machine


ALPHABET = st.integers(0, 3)  # few symbols: prefixes collide often, so blocks get shared


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 14), block_size=st.sampled_from([1, 2, 4]),
                caching=st.booleans())
    def setup(self, num_blocks, block_size, caching):
        self.bm = BlockManager(num_blocks, block_size, enable_caching=caching)
        self.pool: dict[int, tuple] = {}   # slot -> the prefix whose K/V it holds
        self.live: list[Sequence] = []     # sequences holding blocks
        self.waiting: list[Sequence] = []  # preempted: hold nothing, keep their tokens

    # -- the simulated runner

    def compute(self, s: Sequence, start: int, end: int) -> None:
        for src, dst in self.bm.take_copies():  # before any write, as the runner does
            bs = self.bm.block_size
            for o in range(bs):
                if src * bs + o in self.pool:
                    self.pool[dst * bs + o] = self.pool[src * bs + o]
                else:
                    self.pool.pop(dst * bs + o, None)
        for p in range(start, end):
            b = self.bm.blocks[s.block_table[p // self.bm.block_size]]
            # NOTE invariant: a write only ever goes to a private, uncached block
            assert b.ref_count == 1 and b.hash is None, f"write into {b}"
            self.pool[self.bm.slot(s.block_table, p)] = tuple(s.token_ids[: p + 1])
        s.num_computed = end
        self.bm.cache_blocks(s)

    def snapshot(self):
        return ([b.ref_count for b in self.bm.blocks], list(self.bm._free), dict(self.bm._cached),
                [list(s.block_table) for s in self.live])

    def try_admit(self, s: Sequence, chunk: int) -> bool:
        before = self.snapshot()
        hits = self.bm.match_prefix(s)
        start = min(len(hits) * self.bm.block_size, s.num_tokens - 1)
        end = min(s.num_tokens, start + chunk)
        if not self.bm.allocate_slots(s, start, end, hits):
            assert self.snapshot() == before and s.block_table == []  # all or nothing
            return False
        self.compute(s, start, end)
        return True

    # -- rules

    @rule(prefix=st.lists(ALPHABET, min_size=1, max_size=20), chunk=st.integers(1, 12))
    def admit_new(self, prefix, chunk):
        s = seq(prefix)
        if self.try_admit(s, chunk):
            self.live.append(s)

    @precondition(lambda self: self.waiting)
    @rule(i=st.integers(0, 50), chunk=st.integers(1, 12))
    def readmit(self, i, chunk):
        s = self.waiting[i % len(self.waiting)]
        if self.try_admit(s, chunk):
            self.waiting.remove(s)
            self.live.append(s)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 50), tok=ALPHABET, chunk=st.integers(1, 12))
    def advance(self, i, tok, chunk):
        """A prefill chunk if the sequence lags its tokens, else one decode token."""
        s = self.live[i % len(self.live)]
        if s.num_computed == s.num_tokens:
            s.token_ids.append(tok)
        start = s.num_computed
        end = min(s.num_tokens, start + chunk)
        before = self.snapshot()
        if self.bm.allocate_slots(s, start, end):
            self.compute(s, start, end)
        else:
            assert self.snapshot() == before

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 50), tok=ALPHABET)
    def fork(self, i, tok):
        parent = self.live[i % len(self.live)]
        child = seq(parent.token_ids[: parent.num_computed])
        self.bm.fork(parent, child)
        assert child.num_computed == parent.num_computed
        self.live.append(child)
        child.token_ids.append(tok)  # the child diverges: its next write must not touch the parent's blocks

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 50))
    def finish(self, i):
        s = self.live.pop(i % len(self.live))
        self.bm.free(s)
        assert s.block_table == []

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 50))
    def preempt(self, i):
        s = self.live.pop(i % len(self.live))
        self.bm.free(s)
        s.num_computed = 0
        self.waiting.append(s)

    # -- invariants

    @invariant()
    def counts_and_lists_agree(self):
        if hasattr(self, "bm"):
            self.bm.check([s.block_table for s in self.live])

    @invariant()
    def every_sequence_reads_its_own_kv(self):
        if not hasattr(self, "bm"):
            return
        bs = self.bm.block_size
        for s in self.live:
            assert len(s.block_table) * bs >= s.num_computed
            for p in range(s.num_computed):
                got = self.pool.get(self.bm.slot(s.block_table, p))
                assert got == tuple(s.token_ids[: p + 1]), f"{s}: position {p} holds {got}"

    @invariant()
    def cached_blocks_hold_what_their_hash_says(self):
        if not hasattr(self, "bm"):
            return
        # a cached block's slots hold the prefix its chained hash names
        bs = self.bm.block_size
        for h, b in self.bm._cached.items():
            prefix = self.pool.get(b.id * bs + bs - 1)
            assert prefix is not None and len(prefix) % bs == 0
            hh = None
            for k in range(0, len(prefix), bs):
                hh = block_hash(hh, prefix[k : k + bs])
            assert hh == h

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for s in self.live:
            self.bm.free(s)
        assert all(b.ref_count == 0 for b in self.bm.blocks)
        assert self.bm.num_free == self.bm.num_blocks
        self.bm.check()


TestBlockManagerMachine = BlockManagerMachine.TestCase
# 300 runs of up to 50 steps: ~10 s here.
TestBlockManagerMachine.settings = settings(max_examples=300, stateful_step_count=50, deadline=None, database=None,
                                            suppress_health_check=[HealthCheck.too_slow])


def test_kv_slot_is_one_formula_for_ints_and_arrays():
    """kv_slot (the one place Python writes the slot layout the C++ core reads):
    block = table[p // bs], slot = block * bs + p % bs, for one position and
    for many, and BlockManager.slot is it."""
    import numpy as np

    from llamajet.engine.block_manager import BlockManager, kv_slot

    table, bs = [7, 2, 9], 4
    pos = np.arange(12)
    want = [7 * 4 + 0, 29, 30, 31, 8, 9, 10, 11, 36, 37, 38, 39]
    assert kv_slot(table, pos, bs).tolist() == want
    assert [kv_slot(table, int(p), bs) for p in pos] == want
    assert [BlockManager(16, bs).slot(table, int(p)) for p in pos] == want
