"""ModelRunner: owns the executor, its arena and KV pool, and runs steps.

One runner = one compiled Program for steps of up to `max_tokens` tokens
(any mix of prefill and decode), from up to `max_seqs` sequences, asking for
up to `max_out` rows of logits. The KV pool holds `num_blocks` blocks of
`block_size` token slots for every layer; which blocks a sequence uses is the
caller's business (its block table).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from llamajet import ops
from llamajet.graph.lower import KVLayout, lower
from llamajet.graph.planner import MemoryPlan, plan_memory
from llamajet.loaders import LoadedModel
from llamajet.model.llama import build_graph


@dataclass(frozen=True)
class StepBatch:
    """Inputs of one step; int32 arrays (see csrc/common.h StepCtx)."""

    tokens: np.ndarray        # [n] token ids
    positions: np.ndarray     # [n] position of each token in its sequence
    slots: np.ndarray         # [n] KV slot each token's K/V is written to
    seq_of_token: np.ndarray  # [n] row of block_tables for each token
    block_tables: np.ndarray  # [n_seqs, max_blocks] KV block ids
    out_rows: np.ndarray      # [n_out] tokens whose logits are returned


class ModelRunner:
    def __init__(self, model: LoadedModel, *, max_model_len: int, max_tokens: int = 256,
                 max_out: int = 64, max_seqs: int = 1, block_size: int = 16,
                 num_blocks: int | None = None, n_threads: int | None = None,
                 isa: str | None = None) -> None:
        cfg = model.config
        self.model = model
        self.config = cfg
        self.max_model_len = max_model_len
        self.max_tokens = max_tokens
        self.max_out = min(max_out, max_tokens)
        self.block_size = block_size
        self.max_blocks = math.ceil(max_model_len / block_size)
        # Default pool: every sequence of the batch at full length.
        self.num_blocks = num_blocks if num_blocks is not None else self.max_blocks * max_seqs
        self.graph = build_graph(cfg, model.weights, max_model_len)
        self.plan: MemoryPlan = plan_memory(self.graph, {"T": max_tokens, "O": self.max_out})
        max_k = max(cfg.hidden_size, cfg.intermediate_size)
        self.exe = ops.Executor(
            isa=ops.resolve_isa(isa), n_threads=n_threads or ops.default_threads(),
            max_tokens=max_tokens, max_out=self.max_out, max_seqs=max_seqs, max_blocks=self.max_blocks,
            kv_slots=self.num_blocks * block_size, block_size=block_size, max_pos=max_model_len,
            scratch_floats=max(max_k, self.max_blocks * block_size))
        self.arena = self.exe.alloc_buffer(self.plan.arena_bytes)
        kv_dim = cfg.num_kv_heads * cfg.head_dim
        kv_buf = self.exe.alloc_buffer(KVLayout.nbytes(cfg.num_layers, self.num_blocks * block_size, kv_dim))
        self.kv = KVLayout(kv_buf, self.num_blocks * block_size, kv_dim, block_size)
        lower(self.graph, self.plan, self.exe, self.arena, self.kv)
        # The logits region of the arena, viewed once (valid after each step).
        arena = self.exe.buffer(self.arena)
        off = self.plan.offsets["logits"]
        self._logits = arena[off : off + self.max_out * cfg.vocab_size * 4].view(np.float32).reshape(
            self.max_out, cfg.vocab_size)

    @property
    def isa(self) -> str:
        return self.exe.isa

    @property
    def n_threads(self) -> int:
        return self.exe.n_threads

    def execute(self, b: StepBatch) -> np.ndarray:
        """Runs one step; returns logits [n_out, vocab] as a view into the
        arena, valid until the next step (copy to keep)."""
        self.exe.run(b.tokens, b.positions, b.slots, b.seq_of_token, b.block_tables, b.out_rows)
        return self._logits[: len(b.out_rows)]
