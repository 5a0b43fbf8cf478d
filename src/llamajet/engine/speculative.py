"""Speculative decoding's proposers: tokens a sequence will probably produce
next, which one step verifies together (engine.Engine._verify).

How a proposal is verified, and why the output does not change: the step
computes the sequence's last token and the k proposed tokens after it, and
returns the k + 1 logits rows. The engine then emits tokens exactly as plain
decoding would: for j = 0, 1, ... it draws token j from row j with the
sequence's own sampler (greedy, or seeded sampling with its RNG advancing one
draw per token as without speculation, penalties, grammar), and goes on to
row j + 1 only while the drawn token equals proposed token j (row j + 1 was
computed with that token in place). On a tier a row's bits do not depend on
how many rows or tokens a step holds, so every emitted token is the one plain
decoding emits: greedy and seeded outputs are identical with and without
speculation. For a model-free proposer (q one-hot on the proposal) this is
speculative sampling itself: accepting with probability min(1, p/q) = p(d)
and resampling from max(p - q, 0) is drawing from p and keeping a draw equal
to d.

Rejected tokens' K/V were written at positions past the accepted ones: the
sequence's computed count ends at its last accepted token, so they are never
read, later steps overwrite them, and blocks past the known tokens go back to
the pool (BlockManager.truncate); the prefix cache hashes only accepted
tokens (cache_blocks runs after the acceptance).

NgramProposer (prompt lookup): the longest suffix of the sequence's tokens
(max_n down to min_n tokens) that occurred before, in the prompt or the
output; proposes the tokens that followed its latest earlier occurrence. An
index of every n-gram's latest end position is extended by the tokens added
since the last proposal, so a proposal costs O(max_n) per new token, not a
scan of the history.

Proposal length adapts per sequence: one more than the tokens it accepted
last time, up to num_speculative_tokens, so a sequence whose proposals fail
spends one extra token per step at most, and only when a match exists; one
that accepts everything doubles its proposal length.
"""

from __future__ import annotations


class NgramProposer:
    def __init__(self, k: int, max_n: int = 4, min_n: int = 2) -> None:
        self.k, self.max_n, self.min_n = k, max_n, min_n

    def propose(self, seq) -> list[int]:
        st = seq.spec
        if st is None:
            st = seq.spec = SpecState(self.k)
        ids = seq.token_ids
        n_ids = len(ids)
        index, upto = st.index, st.upto
        # index n-grams ending at positions upto .. n_ids - 2 (not the last: its earlier occurrences are wanted)
        for p in range(upto, n_ids - 1):
            for n in range(self.min_n, self.max_n + 1):
                if p - n + 1 < 0:
                    break
                index[tuple(ids[p - n + 1 : p + 1])] = p
        st.upto = max(upto, n_ids - 1)
        k = min(st.k, seq.params.max_tokens - seq.num_output - 1)
        if k <= 0:
            return []
        for n in range(min(self.max_n, n_ids), self.min_n - 1, -1):
            p = index.get(tuple(ids[n_ids - n:]))
            if p is not None:
                return ids[p + 1 : p + 1 + k]
        return []


class SpecState:
    """A sequence's proposer state: its n-gram index and its current proposal length."""

    __slots__ = ("index", "upto", "k", "k_max")

    def __init__(self, k: int) -> None:
        self.index: dict[tuple[int, ...], int] = {}
        self.upto = 0
        self.k = self.k_max = k

    def update(self, proposed: int, accepted: int) -> None:
        """After a verification: propose one more than was accepted; twice as many when all were."""
        self.k = min(self.k_max, 2 * proposed if accepted == proposed else accepted + 1)


def make_proposer(name: str | None, k: int):
    if name is None:
        return None
    if name == "ngram":
        return NgramProposer(k)
    raise ValueError(f"unknown proposer {name!r}")
