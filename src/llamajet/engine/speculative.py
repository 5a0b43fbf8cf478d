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

Whether a proposal is worth its step (StepCost, plan): a step of T tokens
takes t(T). Where decode streams the weights from memory, t(1 + k) is close
to t(1) and every accepted token is nearly free; where it is compute-bound (a
big batch, or a core without int8 dot products: on an AVX2-only Zen 1,
t(2) = 1.66 t(1)) the k proposed tokens cost nearly k steps, and verifying
them loses unless almost all are accepted. So before each step the engine
keeps only the proposed tokens that raise the expected tokens per second:
with a sequence's per-token acceptance a (its recent verifications, a
geometric model: token j is kept with probability a^j), its j-th proposed
token adds a^j expected tokens, and the step's proposals are taken best
first while (B + expected accepted) / t(B + taken) grows, B being the tokens
the step has without them. t(T) is measured at startup (a few step sizes),
then follows the step times observed (a busy machine changes it). A sequence
whose proposals the plan keeps dropping is tried now and then at the
acceptance it would need (a probe, backing off while probes fail), so a
change in what it writes, or in the machine, is seen. None of this changes
any output: only how many tokens a step verifies.
"""

from __future__ import annotations

import time
from collections import deque


class Proposer:
    """What every proposer shares (the small interface the engine calls):
    propose(seq) -> the tokens it proposes after seq's last token, its
    per-sequence SpecState made at its first proposal, and the proposal
    length rule."""

    def __init__(self, k: int) -> None:
        self.k = k

    def new_state(self) -> SpecState:
        return SpecState(self.k)

    def state(self, seq) -> SpecState:
        if seq.spec is None:
            seq.spec = self.new_state()
        return seq.spec

    def length(self, seq, room: int | None = None) -> int:
        """How many tokens seq would propose now: its adaptive length
        (SpecState.update), within max_tokens (the token the verification
        adds counts) and within `room` positions left in the context."""
        k = min(self.state(seq).k, seq.params.max_tokens - seq.num_output - 1)
        return max(0, k if room is None else min(k, room))


class NgramProposer(Proposer):
    def __init__(self, k: int, max_n: int = 4, min_n: int = 2) -> None:
        super().__init__(k)
        self.max_n, self.min_n = max_n, min_n

    def propose(self, seq) -> list[int]:
        st = self.state(seq)
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
        k = self.length(seq)
        if k <= 0:
            return []
        for n in range(min(self.max_n, n_ids), self.min_n - 1, -1):
            p = index.get(tuple(ids[n_ids - n:]))
            if p is not None:
                return ids[p + 1 : p + 1 + k]
        return []


class SpecState:
    """A sequence's proposer state: its n-gram index, its current proposal
    length, and its recent acceptance (decayed counts of accepted tokens and
    of verifications that ended in a rejection)."""

    __slots__ = ("index", "upto", "k", "k_max", "acc", "rej", "skipped", "probe_gap", "probing",
                 "dtoks", "dtable", "dvers")

    DECAY = 0.8  # weight of the verification before the latest: about the last 5 count
    PROBE_GAP, PROBE_GAP_MAX = 4, 64  # plan decisions dropping a proposal before a probe

    def __init__(self, k: int) -> None:
        self.index: dict[tuple[int, ...], int] = {}
        self.upto = 0
        self.k = self.k_max = k
        self.acc = self.rej = 0.0
        self.skipped = 0
        self.probe_gap = self.PROBE_GAP
        self.probing = False  # the proposal being verified is a probe (engine.Engine._plan_drafts)
        # a draft model's view (engine/draft.py): the tokens its K/V holds by position, the block
        # ids that held them and those blocks' write counts then
        self.dtoks: list[int] = []
        self.dtable: list[int] = []
        self.dvers: list[int] = []

    def update(self, proposed: int, accepted: int) -> None:
        """After a verification: propose one more than was accepted; twice as many when all were."""
        self.k = min(self.k_max, 2 * proposed if accepted == proposed else accepted + 1)
        self.acc = self.acc * self.DECAY + accepted
        self.rej = self.rej * self.DECAY + (accepted < proposed)
        if self.probing:  # probe again soon after one that paid, ever later after ones that did not
            self.probing = False
            self.probe_gap = self.PROBE_GAP if 2 * accepted >= proposed else min(2 * self.probe_gap, self.PROBE_GAP_MAX)

    def acceptance(self, prior: float, weight: float = 1.0) -> float:
        """Per-token acceptance: accepted tokens over accepted + rejections
        (the geometric model's estimate), with `prior` counted `weight` times."""
        return (self.acc + prior * weight) / (self.acc + self.rej + weight)


# The acceptance a probe assumes: a sequence whose proposals would not pay even
# at this rate is not probed (on a compute-bound machine, none is).
PROBE_ACCEPTANCE = 0.9


class StepCost:
    """t(T, B), the seconds of a step of T tokens over B sequences.

    Startup measures the shape, t(T) for one sequence (`t`: linear between
    points, along the last two beyond). A step of B sequences costs more than
    one sequence's step of as many tokens (attention over B contexts, B
    tables), so each batch size B has a factor, the exponential average (EMA
    of the latest) of observed time over the shape's: an unobserved (T, B)
    is predicted as shape(T) x factor(B), and a (T, B) observed has its own
    average, started from that prediction (one slow step moves it by EMA of
    the difference). The baseline of a decision (B tokens, the B sequences'
    last ones) and the candidates (B + k tokens) are then predicted alike,
    with no bias between a cell seen every step and cells seen seldom; and a
    busy machine, which may change the ratios themselves, moves the cells
    it is observed in."""

    EMA = 0.1

    def __init__(self, points: dict[int, float]) -> None:
        if not points or min(points.values()) <= 0:
            raise ValueError("StepCost needs at least one positive step time")
        self.t = dict(points)
        self._keys = sorted(self.t)
        self.cells: dict[tuple[int, int], float] = {}  # (T, B) -> observed seconds (EMA)
        self.factor: dict[int, float] = {}  # B -> observed / shape (EMA)

    def shape(self, n: int) -> float:
        t, ks = self.t, self._keys
        if n in t:
            return t[n]
        if len(ks) == 1:
            return t[ks[0]] * n / ks[0]
        i = next((i for i, k in enumerate(ks) if k > n), len(ks))
        a, b = (ks[0], ks[1]) if i == 0 else (ks[-2], ks[-1]) if i == len(ks) else (ks[i - 1], ks[i])
        return max(t[a] + (t[b] - t[a]) * (n - a) / (b - a), 1e-9)

    def __call__(self, n: int, batch: int = 1) -> float:
        c = self.cells.get((n, batch))
        return c if c is not None else self.shape(n) * self.factor.get(batch, 1.0)

    def observe(self, n: int, seconds: float, batch: int = 1) -> None:
        prev = self(n, batch)
        f = self.factor.get(batch, 1.0)
        self.factor[batch] = f + self.EMA * (seconds / self.shape(n) - f)
        self.cells[(n, batch)] = prev + self.EMA * (seconds - prev)

    def ratio(self, base: int, extra: int, batch: int = 1) -> float:
        """t(base + extra) / t(base) at `batch` sequences: what `extra` proposed tokens cost a step."""
        return self(base + extra, batch) / self(base, batch)


def plan(base: int, cands: list[tuple[float, int]], cost) -> list[int]:
    """How many of each sequence's proposed tokens to verify: cands holds
    (acceptance a, tokens proposed k) per sequence; proposed token j of a
    sequence is worth a^j expected tokens. Tokens are taken in order of worth
    (a sequence's in order, since a^j falls with j) for as long as the
    expected tokens per second, (base + worth taken) / cost(base + taken),
    is the best so far; returns the count per sequence (0: not verified)."""
    worth = []
    for i, (a, k) in enumerate(cands):
        w = 1.0
        for _ in range(k):
            w *= a
            worth.append((w, i))
    worth.sort(key=lambda x: -x[0])  # stable: a sequence's tokens stay in order when a = 1
    best, best_n, total = base / cost(base), 0, float(base)
    for n, (w, _) in enumerate(worth, 1):
        total += w
        rate = total / cost(base + n)
        if rate > best:
            best, best_n = rate, n
    ks = [0] * len(cands)
    for _, i in worth[:best_n]:
        ks[i] += 1
    return ks


def measure_step_cost(run_step, sizes, reps: int = 2) -> StepCost:
    """StepCost from run_step(T) (one step of T tokens; warmed up by the
    caller) timed for each size: the least of `reps` times each."""
    pts = {}
    for n in sizes:
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            run_step(n)
            best = min(best, time.perf_counter() - t0)
        pts[n] = best
    return StepCost(pts)


class SuffixIndex:
    """Counts of what followed each context: for every position p of the
    token lists added and every n in 1..depth, the context ids[p - n : p]
    maps to {ids[p]: times seen}. Adding with sign -1 takes a list back out
    (the recent-outputs cache evicts that way)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.next: dict[tuple[int, ...], dict[int, int]] = {}

    def add(self, ids: list[int], start: int, stop: int | None = None, sign: int = 1) -> None:
        """Counts the tokens at positions [start, stop) after their contexts."""
        nxt, depth = self.next, self.depth
        for p in range(max(start, 1), len(ids) if stop is None else stop):
            tok = ids[p]
            for n in range(1, min(depth, p) + 1):
                ctx = tuple(ids[p - n : p])
                d = nxt.get(ctx)
                if d is None:
                    d = nxt[ctx] = {}
                c = d.get(tok, 0) + sign
                if c > 0:
                    d[tok] = c
                else:
                    d.pop(tok, None)
                    if not d:
                        del nxt[ctx]

    def longest(self, ids: list[int]) -> tuple[int, dict[int, int] | None]:
        """The longest suffix of ids (at most depth tokens) seen as a context, and its counts."""
        for n in range(min(self.depth, len(ids)), 0, -1):
            d = self.next.get(tuple(ids[len(ids) - n:]))
            if d:
                return n, d
        return 0, None


class SuffixProposer(Proposer):
    """Suffix decoding (as vLLM's, after Arctic Inference's): the sequence's
    own tokens (prompt and output) and the outputs of recent requests (agent
    loops and repeated tasks write the same things again) are indexed by
    context (SuffixIndex, contexts up to `depth` tokens). A proposal follows
    the most frequent continuation of the longest context that matches the
    sequence's last tokens, token after token (each step matching again with
    the proposed tokens appended), while the product of the continuations'
    frequencies — the proposal's confidence — stays at least `min_prob`.
    Where both indexes match, the longer context wins, then the more
    frequent continuation; ties go to the lower token id (a proposal is a
    function of what was indexed). The recent outputs are bounded by
    `max_cached_tokens`, oldest taken back out first."""

    # depth 8: indexing costs `depth` dict updates per token in Python (a 2000-token prompt: ~20 ms)
    def __init__(self, k: int, depth: int = 8, min_prob: float = 0.1, max_cached_tokens: int = 1 << 16) -> None:
        super().__init__(k)
        self.depth, self.min_prob = depth, min_prob
        self.max_cached_tokens = max_cached_tokens
        self.recent = SuffixIndex(depth)
        self._cached: deque[tuple[list[int], int]] = deque()  # (tokens, first output position)
        self._cached_tokens = 0

    def new_state(self) -> SpecState:
        st = SpecState(self.k)
        st.index = SuffixIndex(self.depth)
        return st

    def propose(self, seq) -> list[int]:
        st = self.state(seq)
        ids = seq.token_ids
        st.index.add(ids, st.upto, len(ids))
        st.upto = len(ids)
        k = self.length(seq)
        out: list[int] = []
        conf = 1.0
        ctx = ids[-self.depth:]
        while len(out) < k:
            best = None
            for n, d in (st.index.longest(ctx), self.recent.longest(ctx)):
                if d:
                    tok, c = min(d.items(), key=lambda kv: (-kv[1], kv[0]))
                    key = (n, c / sum(d.values()))
                    if best is None or key > best[0]:
                        best = (key, tok)
            if best is None:
                break
            conf *= best[0][1]
            if conf < self.min_prob:
                break
            out.append(best[1])
            ctx = (ctx + [best[1]])[-self.depth:]
        return out

    def finished(self, seq) -> None:
        """A finished sequence's output joins the recent outputs (contexts may reach into its prompt)."""
        ids, start = list(seq.token_ids), seq.num_prompt
        if len(ids) <= start:
            return
        self.recent.add(ids, start)
        self._cached.append((ids, start))
        self._cached_tokens += len(ids) - start
        while self._cached_tokens > self.max_cached_tokens and self._cached:
            old, s0 = self._cached.popleft()
            self.recent.add(old, s0, sign=-1)
            self._cached_tokens -= len(old) - s0


def make_proposer(name: str | None, k: int, runner=None, blocks=None):
    """The proposer of RuntimeConfig.speculative; a draft model (draft:PATH,
    layers:N) needs the target's runner and block manager."""
    if name is None:
        return None
    if name == "ngram":
        return NgramProposer(k)
    if name == "suffix":
        return SuffixProposer(k)
    if name.startswith(("draft:", "layers:")):
        from llamajet.engine.draft import DraftProposer

        return DraftProposer(k, name, runner, blocks)
    raise ValueError(f"unknown proposer {name!r}")
