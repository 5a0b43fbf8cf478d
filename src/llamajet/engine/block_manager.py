"""BlockManager: bookkeeping of the paged KV cache (which block holds what).

The runner owns one pool of `num_blocks` blocks; a block is `block_size`
token slots of every layer's K and V. A sequence's K/V live in the blocks its
block table lists, in position order, and the attention kernel reads them
through that table. So a sequence's blocks need not be contiguous, memory
is committed block by block as sequences grow (at most block_size - 1 slots
per sequence unused), and a block can appear in several tables at once.

That last point gives prefix caching: a full block is named by a chained
content hash (its tokens and the hash of the block before it, so equal hashes
mean equal whole prefixes), and a later sequence whose leading blocks hash the
same reuses them instead of recomputing their K/V. Finished sequences leave
their full blocks in the pool, reusable, until the space is needed: they are
evicted least recently freed first.

Structures, and why:
- `Block` (id, ref_count, hash): ref_count counts the block tables that list
  the block; a block is free exactly when it is 0.
- `_free`: an OrderedDict used as a doubly linked list of free blocks, oldest
  first. Taking the head (allocate / evict), appending at the tail (free) and
  unlinking from the middle (a prefix hit on a block nobody holds) are all
  O(1); with a deque the last would be O(n). Freed blocks with no hash go to
  the head (nothing in them is worth keeping, reuse them first), freed cached
  blocks to the tail, so the head is always the best block to give away.
- `_cached`: hash -> Block, the prefix cache. A hit is one dict lookup per
  block; a block leaves it only when it is handed out again (eviction).
- Copy-on-write: a block listed by another table, or one in the cache (its
  contents are what its hash promises), is never written. A write into such a
  block goes to a fresh copy; the copy (src, dst) is queued in
  `pending_copies` for the runner to do before the step's kernels run.

NOTE invariants (`check()` asserts them; the property tests run it after
every operation):
- every block is either free (ref_count 0, in `_free` once) or held
  (ref_count = number of its occurrences in live block tables, not in `_free`);
- `_cached[h].hash == h`, and a block with a hash is in `_cached`;
- a block with a hash or ref_count > 1 is never written (copy-on-write).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Iterable

import numpy as np

from llamajet.errors import RequestError



def kv_slot(table, pos, block_size: int):
    """The KV slot of the token at position `pos` (an int, or an int array of
    positions) of a sequence with block table `table`: block table[pos //
    block_size], offset pos % block_size, slot = block * block_size + offset,
    the layout of the C++ core's StepCtx.slots (csrc/common.h). The one place
    Python writes it."""
    if isinstance(pos, int):
        return table[pos // block_size] * block_size + pos % block_size
    return np.asarray(table)[pos // block_size] * block_size + pos % block_size

class Block:
    __slots__ = ("id", "ref_count", "hash")

    def __init__(self, block_id: int) -> None:
        self.id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None  # set while the block is in the prefix cache

    def __repr__(self) -> str:
        return f"Block({self.id}, ref={self.ref_count}, {'cached' if self.hash else 'uncached'})"


def block_hash(parent: bytes | None, tokens: Iterable[int]) -> bytes:
    """Chained content hash of one full block: sha256(parent hash, token ids).
    A cryptographic hash, so two different prefixes never share blocks (a
    64-bit `hash()` could collide, by accident or by a crafted prompt)."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("BlockManager needs at least one block of at least one slot")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict((b.id, b) for b in self.blocks)
        self._cached: dict[bytes, Block] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block copies before the next step
        # counters (for stats and tests)
        self.num_evictions = 0
        self.num_copies = 0

    # ------------------------------------------------------------ queries

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free, cached ones included)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def slot(self, table: list[int], pos: int) -> int:
        """KV slot of the token at position `pos` of a sequence with block table `table`."""
        return kv_slot(table, pos, self.block_size)

    # ------------------------------------------------------------ prefix cache

    def hashes(self, seq, num_full: int) -> list[bytes]:
        """seq.block_hashes extended to its first `num_full` full blocks."""
        hs, bs, toks = seq.block_hashes, self.block_size, seq.token_ids
        while len(hs) < num_full:
            i = len(hs)
            hs.append(block_hash(hs[-1] if hs else None, toks[i * bs:(i + 1) * bs]))
        return hs[:num_full]

    def match_prefix(self, seq) -> list[Block]:
        """The cached blocks equal to seq's leading full blocks (longest run)."""
        if not self.enable_caching:
            return []
        hits = []
        for h in self.hashes(seq, seq.num_tokens // self.block_size):
            b = self._cached.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def cache_blocks(self, seq) -> None:
        """Offers seq's full, computed blocks to the prefix cache. A block
        whose content is already cached in another block stays private."""
        if not self.enable_caching:
            return
        n_full = seq.num_computed // self.block_size
        if n_full <= seq.num_cached_blocks:
            return
        hs = self.hashes(seq, n_full)
        for i in range(seq.num_cached_blocks, n_full):
            b = self.blocks[seq.block_table[i]]
            if b.hash is None and hs[i] not in self._cached:
                b.hash = hs[i]
                self._cached[hs[i]] = b
            # NOTE: a block that has a hash has exactly this one (same tokens, same prefix)
            assert b.hash is None or b.hash == hs[i]
        seq.num_cached_blocks = n_full

    # ------------------------------------------------------------ allocation

    def allocate_slots(self, seq, start: int, end: int, hits: list[Block] = ()) -> bool:
        """Makes seq's block table cover slots [0, end) with tokens [start, end)
        writable: new blocks at the end, copy-on-write for held-by-others or
        cached blocks in that range. `hits` (prefix-cache blocks from
        `match_prefix`, only for a sequence holding no blocks yet) become the
        head of the table. All or nothing: returns False, changing nothing,
        when the free blocks do not suffice."""
        bs = self.block_size
        if hits and seq.block_table:
            raise ValueError("prefix hits are only for a sequence that holds no blocks")
        table = [b.id for b in hits] if hits else seq.block_table
        first, last = start // bs, self.blocks_for(end)  # blocks written: [first, last)
        cow = [i for i in range(first, min(last, len(table))) if self._immutable(self.blocks[table[i]])]
        new = max(0, last - len(table))
        taken = sum(1 for b in hits if b.ref_count == 0)  # hits that leave the free list
        if new + len(cow) + taken > len(self._free):
            return False
        for b in hits:
            self._hold(b)
        if hits:
            seq.block_table = table
            seq.num_cached_blocks = len(hits)
        for i in cow:
            old = self.blocks[table[i]]
            dst = self._take()
            self.pending_copies.append((old.id, dst.id))
            self.num_copies += 1
            table[i] = dst.id
            self._release(old)
        for _ in range(new):
            table.append(self._take().id)
        return True

    def ensure(self, table: list[int], num_tokens: int) -> None:
        """Grows a bare block table (one private sequence, no sharing) to
        hold `num_tokens` slots; for callers driving the runner directly."""
        need = self.blocks_for(num_tokens) - len(table)
        if need > len(self._free):
            raise RequestError(f"KV cache full: need {need} more blocks, {len(self._free)} free of {self.num_blocks}")
        for _ in range(max(need, 0)):
            table.append(self._take().id)

    def fork(self, parent, child) -> None:
        """child (whose tokens start with parent's computed ones) shares all of
        parent's blocks and computed tokens; the first write of either into a
        shared block copies it."""
        if child.block_table:
            raise ValueError("fork: the child already holds blocks")
        for bid in parent.block_table:
            self._hold(self.blocks[bid])
        child.block_table = list(parent.block_table)
        child.num_computed = parent.num_computed
        # Only hashes of computed full blocks carry over: the parent's later
        # tokens need not be the child's.
        n_full = parent.num_computed // self.block_size
        child.block_hashes = parent.block_hashes[:n_full]
        child.num_cached_blocks = min(parent.num_cached_blocks, n_full)

    def free(self, seq) -> None:
        """Returns seq's blocks (last first, so a sequence's tail is evicted
        before its more shareable head); cached ones stay reusable."""
        for bid in reversed(seq.block_table):
            self._release(self.blocks[bid])
        seq.block_table = []
        seq.num_cached_blocks = 0

    def truncate(self, seq, num_tokens: int) -> None:
        """Gives back seq's blocks past those that hold its first `num_tokens`
        slots (last first, as free does): blocks taken for proposed tokens
        that were rejected (speculative decoding). Their K/V is never read:
        seq.num_computed ends before them."""
        keep = self.blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            self._release(self.blocks[seq.block_table.pop()])
        seq.num_cached_blocks = min(seq.num_cached_blocks, keep)

    def take_copies(self) -> list[tuple[int, int]]:
        out, self.pending_copies = self.pending_copies, []
        return out

    def reset_cache(self) -> int:
        """Forgets every cached block nobody holds (e.g. for cold-start
        measurements); returns how many were dropped."""
        n = 0
        for b in list(self._free.values()):
            if b.hash is not None:
                del self._cached[b.hash]
                b.hash = None
                self._free.move_to_end(b.id, last=False)
                n += 1
        return n

    # ------------------------------------------------------------ internals

    @staticmethod
    def _immutable(b: Block) -> bool:
        """Whether a write into b (held by the writer) must copy it first:
        another table lists it, or it is cached (prefix hits always are)."""
        return b.hash is not None or b.ref_count > 1

    def _take(self) -> Block:
        """The head of the free list, evicted from the cache if it was cached."""
        _, b = self._free.popitem(last=False)
        if b.hash is not None:
            del self._cached[b.hash]
            b.hash = None
            self.num_evictions += 1
        b.ref_count = 1
        return b

    def _hold(self, b: Block) -> None:
        if b.ref_count == 0:
            del self._free[b.id]  # O(1) unlink from the middle
        b.ref_count += 1

    def _release(self, b: Block) -> None:
        assert b.ref_count > 0, f"{b} released more times than held"
        b.ref_count -= 1
        if b.ref_count == 0:
            self._free[b.id] = b
            if b.hash is None:
                self._free.move_to_end(b.id, last=False)

    # ------------------------------------------------------------ checking

    def check(self, tables: Iterable[list[int]] = ()) -> None:
        """Asserts the invariants in the module docstring; `tables` are all
        live block tables (their counts must equal the ref counts)."""
        counts = [0] * self.num_blocks
        for t in tables:
            for bid in t:
                counts[bid] += 1
        for b in self.blocks:
            assert b.ref_count == counts[b.id], f"{b}: held by {counts[b.id]} tables"
            assert (b.id in self._free) == (b.ref_count == 0), f"{b}: free list disagrees"
            if b.hash is not None:
                assert self._cached.get(b.hash) is b, f"{b}: hash not in the cache"
        for h, b in self._cached.items():
            assert b.hash == h
        assert len(self._free) + sum(1 for b in self.blocks if b.ref_count) == self.num_blocks
