"""Embedder: texts in, pooled final hidden states out, from a program of its own.

An embedding of a text is the model's last hidden states after the final
RMSNorm (what HF's ``LlamaModel.last_hidden_state`` holds), pooled over the
text's tokens — the mean (default) or the last token's state — and
L2-normalized unless asked not to be.

Why a second program, and why it costs no weights. Generation's graph folds
the final norm into the LM head's prologue and computes only the rows whose
logits are wanted, so no hidden state of every token exists in it. The
embedding graph is cut from that same fused graph (`hidden_state_graph`): the
nodes the last residual stream depends on, unchanged, then a plain RMSNorm of
every token as the output. Its weights are the generation graph's Weight
objects themselves (the stacked Q/K/V and gate/up, the file-mapped norms, the
RoPE tables), lowered by reference (`ops.Ref.from_array` keeps a pointer,
never a copy), so the second Program adds only its executor: an arena for one
step, a KV pool for the longest text, and a thread pool.

Steps. Whole texts are packed into a step up to the generation step's token
and sequence budgets; a text longer than a step runs alone, in chunks of the
step budget from position 0. Either way the rows a text computes, and the
chunks they come in, do not depend on the texts beside it, and the kernels
make a row's bits independent of the step's other rows: an embedding is the
same bits batched or alone. Pooling runs per text in token order (float64
sums chunk by chunk, then the chunk sums in order).

Threads: one embed call at a time uses the arena and KV pool (`_busy`); each
step runs under the engine's step lock, so embedding steps interleave with
generation steps instead of two programs fighting over the same cores.
"""

from __future__ import annotations

import math
import threading
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from llamajet import ops
from llamajet.engine.runner import ModelRunner
from llamajet.errors import RequestError
from llamajet.graph.ir import Graph, Node
from llamajet.graph.lower import KVLayout, lower
from llamajet.graph.planner import MemoryPlan, plan_memory

POOLINGS = ("mean", "last")
HIDDEN = "output_norm.out"  # the embedding program's output: [T, hidden] float32, every token


@dataclass(frozen=True)
class Embeddings:
    """One embed call's result: a vector per text, in input order, and the
    tokens each text ran as (after tokenization: BOS included where the
    tokenizer adds one). `prompt_tokens` is what a server reports as usage."""

    vectors: np.ndarray              # float32 [n_texts, hidden]
    token_counts: tuple[int, ...]    # tokens per text

    @property
    def prompt_tokens(self) -> int:
        return sum(self.token_counts)


def hidden_state_graph(gen: Graph, eps: float) -> Graph:
    """The generation graph without its head, ending in the final RMSNorm of
    every token (tensor HIDDEN, [T, hidden]).

    `gen` is the fused generation graph, lowered already (so its weights are
    the contiguous arrays its Program reads). Kept: every node the head's
    input (``output_gather``'s x, the last residual stream) depends on, in
    order, through state tensors too (each layer's kv_write orders before its
    attention); nodes are copied, tensor specs and Weight objects shared."""
    x = gen.node("output_gather").inputs["x"]
    needed, keep = {x}, []
    for n in reversed(gen.nodes):
        if needed.intersection(n.writes()):
            keep.append(n)
            needed.update(n.reads())
    g = Graph()
    for n in reversed(keep):
        g.nodes.append(Node(n.name, n.op, dict(n.inputs), dict(n.outputs), dict(n.attrs)))
    used = {t for n in g.nodes for t in n.reads() + n.writes()}
    g.tensors = {t: spec for t, spec in gen.tensors.items() if t in used}
    g.weights = {t: w for t, w in gen.weights.items() if t in used}
    # the final norm's weight: read by the fused head (norm_head's prologue, or the norm that
    # quantizes the head's input), present in every form of the generation graph
    norm_w = g.weight("output_norm", gen.weights["output_norm"])
    out = g.tensor(HIDDEN, ("T", gen.tensors[x].shape[-1]))
    g.add("output_norm", "rmsnorm", {"x": x, "w": norm_w}, {"out": out}, eps=eps)
    g.outputs.append(out)
    g.verify()
    return g


class Embedder:
    """The embedding Program beside `runner`'s generation Program: same
    weights, ISA, threads, step budget and KV storage type; its own arena and
    KV pool. `step_lock`: held around each step (the engine's lock)."""

    def __init__(self, runner: ModelRunner, step_lock: threading.Lock | None = None) -> None:
        self.runner = runner  # keeps the shared weights alive as long as this Program may run
        cfg = runner.config
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        self.max_len = runner.max_model_len
        self.max_tokens = runner.max_tokens
        self.max_seqs = runner.max_seqs
        self.block_size = bs = runner.block_size
        self.graph = hidden_state_graph(runner.graph, cfg.rms_norm_eps)
        # one step's packed texts take at most T/bs blocks plus one partial block per text; a long
        # text alone takes its whole context
        max_blocks = math.ceil(self.max_len / bs)
        self.num_blocks = max(max_blocks, math.ceil(self.max_tokens / bs) + self.max_seqs)
        self.plan: MemoryPlan = plan_memory(self.graph, {"T": self.max_tokens, "O": 0})
        self.exe = ops.Executor(
            isa=runner.isa, n_threads=runner.n_threads, max_tokens=self.max_tokens, max_out=0,
            max_seqs=self.max_seqs, max_blocks=max_blocks, kv_slots=self.num_blocks * bs, block_size=bs,
            max_pos=self.max_len, scratch_floats=0)
        self.arena = self.exe.alloc_buffer(self.plan.arena_bytes)
        # Not zeroed, never prefaulted: pages are committed as texts reach them (a pool
        # sized for the longest text costs only what the longest text so far touched).
        kv_buf = self.exe.alloc_buffer(KVLayout.nbytes(cfg.num_layers, self.num_blocks * bs, cfg.num_kv_heads,
                                                       cfg.head_dim, runner.kv_dtype))
        self.kv = KVLayout(kv_buf, self.num_blocks * bs, cfg.num_kv_heads, cfg.head_dim, bs, runner.kv_dtype)
        lower(self.graph, self.plan, self.exe, self.arena, self.kv,
              defaults={"matmul": {"float_act": not runner.runtime.act_int8}})
        off = self.plan.offsets[HIDDEN]
        self._hidden = self.exe.buffer(self.arena)[off : off + self.max_tokens * self.hidden_size * 4].view(
            np.float32).reshape(self.max_tokens, self.hidden_size)
        self._step_lock = step_lock
        self._busy = threading.Lock()
        self._no_out = np.zeros(0, dtype=np.int32)

    @property
    def arena_bytes(self) -> int:
        return self.plan.arena_bytes

    @property
    def kv_bytes(self) -> int:
        return KVLayout.nbytes(self.runner.config.num_layers, self.kv.num_slots, self.kv.kv_heads,
                               self.kv.head_dim, self.kv.dtype)

    def check(self, ids: list[int], i: int = 0) -> None:
        """Refuses text `i`'s token ids unless the program can run them."""
        if len(ids) == 0:
            raise RequestError(f"input {i} is empty: give at least one token")
        if len(ids) > self.max_len:
            raise RequestError(f"input {i} has {len(ids)} tokens but the context holds {self.max_len} "
                               "(max_model_len); shorten it")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(f"input {i}: token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")

    def embed(self, texts: list[list[int]], pooling: str = "mean", normalize: bool = True) -> Embeddings:
        """Pooled final hidden states of `texts` (token-id lists), float32
        [len(texts), hidden], in order. Every text is checked before any runs."""
        if pooling not in POOLINGS:
            raise RequestError(f"pooling={pooling!r}: use one of {', '.join(POOLINGS)}")
        if len(texts) == 0:
            raise RequestError("no inputs: give at least one text")
        for i, ids in enumerate(texts):
            self.check(ids, i)
        lengths = [len(ids) for ids in texts]
        pooled = np.zeros((len(texts), self.hidden_size), dtype=np.float64)
        with self._busy:
            for step in self._schedule(lengths):
                self._run(texts, step, pooled, pooling, lengths)
        if pooling == "mean":
            pooled /= np.asarray(lengths, dtype=np.float64)[:, None]
        if normalize:
            # a zero vector (all-zero hidden states) stays zero rather than becoming NaN
            pooled /= np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        return Embeddings(pooled.astype(np.float32), tuple(lengths))

    def _schedule(self, lengths: list[int]) -> Iterator[list[tuple[int, int, int]]]:
        """Steps as lists of (text, first position, tokens). Whole texts are
        packed in input order while they fit the token and sequence budgets; a
        text longer than a step runs alone, chunk after chunk from position 0.
        NOTE: a text's chunks depend only on its own length (the invariant
        that makes batched bits equal to alone)."""
        T, S = self.max_tokens, self.max_seqs
        step: list[tuple[int, int, int]] = []
        used = 0
        for i, n in enumerate(lengths):
            if n > T:
                if step:
                    yield step
                    step, used = [], 0
                for s in range(0, n, T):
                    yield [(i, s, min(T, n - s))]
                continue
            if used + n > T or len(step) == S:
                yield step
                step, used = [], 0
            step.append((i, 0, n))
            used += n
        if step:
            yield step

    def _run(self, texts: list[list[int]], step: list[tuple[int, int, int]], pooled: np.ndarray,
             pooling: str, lengths: list[int]) -> None:
        """One step: each text of it in its own run of blocks (from block 0
        for a long text's chunks, so its earlier chunks' K/V stay in place),
        then its rows pooled into `pooled`."""
        bs = self.block_size
        ends = [s + n for _, s, n in step]
        width = max(math.ceil(e / bs) for e in ends)
        tables = np.zeros((len(step), width), dtype=np.int32)  # unused entries: block 0, never read
        tokens, positions, slots, seq_of = [], [], [], []
        base = 0  # the first block of the row's text
        for r, (i, s, n) in enumerate(step):
            nb = math.ceil((s + n) / bs)
            tables[r, :nb] = np.arange(base, base + nb)
            pos = np.arange(s, s + n)
            tokens.append(texts[i][s : s + n])
            positions.append(pos)
            slots.append(base * bs + pos)
            seq_of.append(np.full(n, r))
            base += nb
        i32 = ops.i32
        with self._step_lock if self._step_lock is not None else nullcontext():
            self.exe.run(i32(np.concatenate(tokens)), i32(np.concatenate(positions)), i32(np.concatenate(slots)),
                         i32(np.concatenate(seq_of)), tables, self._no_out)
        row = 0
        for i, s, n in step:
            h = self._hidden[row : row + n]
            if pooling == "mean":
                pooled[i] += h.sum(axis=0, dtype=np.float64)
            elif s + n == lengths[i]:
                pooled[i] = h[-1]
            row += n
