"""ModelRunner: owns the executor, its arena and KV pool, and runs steps.

One runner = one compiled Program for steps of up to `step_tokens` tokens
(any mix of prefill chunks and decode tokens), from up to `step_seqs`
sequences, asking for up to `max_out` rows of logits, as the RuntimeConfig
says. Every matmul of a step runs with M = the step's token count, whatever
sequences they belong to; only attention looks at which sequence a token is
from (its block table and position).

The KV pool holds `num_blocks` blocks of `block_size` token slots for every
layer, in storage type `kv_dtype` (f32, f16, bf16, or int8 with a scale per
token and head). Which blocks a sequence uses is the BlockManager's business;
the runner turns a schedule into the step's arrays and does the block copies
copy-on-write asked for.

The pipeline weights -> graph -> fusion is `compile_graph`, which `llamajet
graph` runs too, so what it shows is what the runner runs.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from llamajet import ops
from llamajet.config import RuntimeConfig
from llamajet.engine.block_manager import kv_slot
from llamajet.errors import LlamajetError
from llamajet.formats.convert import prepare_weights
from llamajet.formats.pending import materialize
from llamajet.graph.ir import Graph
from llamajet.graph.lower import KVLayout, lower
from llamajet.engine import outliers as find_outliers
from llamajet.graph.passes import FusionContext
from llamajet.graph.passes import outliers as outlier_pass
from llamajet.graph.passes import fuse as fuse_graph
from llamajet.graph.planner import MemoryPlan, plan_memory
from llamajet.loaders import LoadedModel, page_releaser
from llamajet.model import registry


@dataclass(frozen=True)
class StepBatch:
    """Inputs of one step; int32 arrays (see csrc/common.h StepCtx)."""

    tokens: np.ndarray        # [n] token ids
    positions: np.ndarray     # [n] position of each token in its sequence
    slots: np.ndarray         # [n] KV slot each token's K/V is written to
    seq_of_token: np.ndarray  # [n] row of block_tables for each token
    block_tables: np.ndarray  # [n_seqs, max_blocks] KV block ids
    out_rows: np.ndarray      # [n_out] tokens whose logits are returned


@dataclass
class CompiledGraph:
    graph: Graph            # the step graph, after the fusion passes when cfg.fuse
    fusion_log: list[str]   # what the passes rewrote


def compile_graph(model: LoadedModel, cfg: RuntimeConfig,
                  before_passes: Callable[[Graph], None] | None = None,
                  probe_ids: list[int] | None = None, outlier_plan: dict | None = None) -> CompiledGraph:
    """Weights as the kernels want them (formats/convert.py: GGUF blocks
    repacked, or RTN to cfg.quantize, on cfg's threads and tier), the
    architecture's graph (model/registry.py), and the fusion passes (fused
    weights stacked once, here; the parts no node reads are dropped).
    `before_passes` sees the graph as built (e.g. `llamajet graph`'s summary).
    With cfg.act_outliers (W*A8, fused), the fused graph first runs once over
    `probe_ids` (engine/outliers.py: the probe text's tokens; made with the
    model's tokenizer when not given) to find each int8 input's outlier
    channels, which graph/passes/outliers.py then wires in; `outlier_plan`
    (saved_outliers' dict, from a weight_cache entry) gives both instead."""
    release = page_releaser(model)
    weights = prepare_weights(model.weights, repack=cfg.repack, scheme=cfg.load_scheme,
                              float_scheme=cfg.float_scheme, isa=cfg.isa, release=release,
                              n_threads=cfg.n_threads)
    graph = registry.get(model.config.architecture).build(model.config, weights, cfg.max_model_len)
    if before_passes is not None:
        before_passes(graph)
    del weights  # the graph holds what it reads: the parts a pass stacked are dropped by it
    outliers = cfg.act_outliers if cfg.act_int8 and cfg.fuse else 0
    log = fuse_graph(graph, FusionContext(act_int8=cfg.act_int8, prequant_head=outliers > 0)) if cfg.fuse else []
    # the deferred GGUF repacks, each straight into its final (stacked) buffer,
    # the file's pages released tensor by tensor (formats/pending.py)
    graph.weights.update(materialize(graph.weights, cfg.n_threads, release=release))
    if outliers:
        isa, nth = ops.resolve_isa(cfg.isa), cfg.n_threads or ops.default_threads()  # (resolved by ModelRunner)
        if outlier_plan is not None:  # kept by a weight_cache entry: no probe
            channels, tiled = outlier_plan["ocols"], outlier_plan["ow"]
        else:
            # at most one context of the probe text (the RoPE tables hold max_model_len positions)
            ids = (probe_ids or find_outliers.model_probe_ids(model))[:cfg.max_model_len]
            absmax = find_outliers.input_absmax(graph, ids, isa=isa, n_threads=nth, max_pos=cfg.max_model_len,
                                                block_size=cfg.block_size)
            channels, tiled = find_outliers.choose(absmax, outliers), None
        log += outlier_pass.apply(graph, channels, columns=find_outliers.kernel_columns(isa, nth), tiled=tiled)
    return CompiledGraph(graph, log)


class ModelRunner:
    def __init__(self, model: LoadedModel, cfg: RuntimeConfig, probe_ids: list[int] | None = None,
                 outlier_plan: dict | None = None) -> None:
        cfg = cfg.for_model(model.config)  # max_model_len resolved, and within the model's limit
        # threads resolved once (the usable cores; a request above them lowered, with one warning)
        cfg = replace(cfg, n_threads=ops.resolve_threads(cfg.n_threads, cfg.oversubscribe))
        self.model = model
        self.runtime = cfg
        self.config = model.config
        self.max_model_len = cfg.max_model_len
        self.max_tokens = cfg.step_tokens
        self.max_seqs = cfg.step_seqs
        # every sequence of a step may want its logits row; scoring (Engine.logits, and the
        # prompt chunks of prompt_logprobs requests) takes up to 64 rows a step
        self.max_out = min(max(64, self.max_seqs), self.max_tokens)
        self.block_size = cfg.block_size
        self.kv_dtype = cfg.kv_dtype
        self.kernels = cfg.kernels
        self.max_blocks = math.ceil(self.max_model_len / self.block_size)
        # sized (and a too-small kv_cache_memory refused) before any weight is repacked
        kv_row = KVLayout.row_bytes_of(cfg.kv_dtype, model.config.num_kv_heads, model.config.head_dim)
        self.num_blocks = cfg.kv_blocks(2 * model.config.num_layers * kv_row)
        compiled = compile_graph(model, cfg, probe_ids=probe_ids, outlier_plan=outlier_plan)
        self.graph, self.fusion_log = compiled.graph, compiled.fusion_log
        # What the Program reads (after fusion: the stacked matrices, not their parts).
        self.weights = dict(self.graph.weights)
        self.plan: MemoryPlan = plan_memory(self.graph, {"T": self.max_tokens, "O": self.max_out})
        self.exe = ops.Executor(
            isa=ops.resolve_isa(cfg.isa), n_threads=cfg.n_threads,
            max_tokens=self.max_tokens, max_out=self.max_out, max_seqs=self.max_seqs, max_blocks=self.max_blocks,
            kv_slots=self.num_blocks * self.block_size, block_size=self.block_size, max_pos=self.max_model_len,
            scratch_floats=0)  # the executor sizes per-thread scratch from the ops it is given
        # Backup copies of chunks a descheduled thread holds (executor.h):
        # off unless LLAMAJET_BACKUPS asks (experimental: CI's sanitized run
        # at 11009c8 once produced a NaN with them on, not yet explained). A
        # late copy may still read the weights after a step returns, so
        # __del__ quiesces the executor before this runner's arrays go.
        self.exe.backups = _backups_mode()
        self.arena = self.exe.alloc_buffer(self.plan.arena_bytes)
        mc = model.config
        num_slots = self.num_blocks * self.block_size
        # Not zeroed by the allocator, so committed lazily (an unused block
        # costs no RSS) unless kv_prefault: then written once here, so steps
        # never take page faults (RuntimeConfig.kv_prefault).
        kv_buf = self.exe.alloc_buffer(KVLayout.nbytes(mc.num_layers, num_slots, mc.num_kv_heads, mc.head_dim,
                                                       self.kv_dtype))
        if cfg.kv_prefault:
            self.exe.prefault_buffer(kv_buf)
        self.kv = KVLayout(kv_buf, num_slots, mc.num_kv_heads, mc.head_dim, self.block_size, self.kv_dtype)
        # packed matmuls run with float activations (W*A16) unless kernels="fast"
        lower(self.graph, self.plan, self.exe, self.arena, self.kv, defaults={"matmul": {"float_act": not cfg.act_int8}})
        # The logits region of the arena, viewed once (valid after each step).
        arena = self.exe.buffer(self.arena)
        off = self.plan.offsets["logits"]
        self._logits = arena[off : off + self.max_out * mc.vocab_size * 4].view(np.float32).reshape(
            self.max_out, mc.vocab_size)
        off = self.plan.offsets["greedy"]  # each logits row's argmax (int32)
        self._greedy = arena[off : off + self.max_out * 4].view(np.int32)
        # The KV pools as [2 * layers, num_blocks, bytes per block], for block copies.
        block_bytes = self.block_size * self.kv.row_bytes
        self._kv_blocks = self.exe.buffer(kv_buf)[: 2 * mc.num_layers * self.kv.pool_bytes].reshape(
            2 * mc.num_layers, self.kv.pool_bytes)[:, : self.num_blocks * block_bytes].reshape(
            2 * mc.num_layers, self.num_blocks, block_bytes)
        self.kv_bytes_per_block = 2 * mc.num_layers * block_bytes  # K and V, every layer

    @property
    def isa(self) -> str:
        return self.exe.isa

    def __del__(self) -> None:
        # before the instance's arrays are released (the finalizer runs first):
        # no thread of the executor may still read them
        exe = self.__dict__.get("exe")
        if exe is not None:
            exe.quiesce()

    @property
    def n_threads(self) -> int:
        return self.exe.n_threads

    @property
    def kv_pool_bytes(self) -> int:
        return self.num_blocks * self.kv_bytes_per_block

    def thread_stats(self) -> dict:
        """How the compute threads shared the steps since the last
        reset_thread_stats(): per thread the chunks run and stolen and the
        cycles inside kernels ("chunks", "stolen", "work_cycles"), the steps,
        the waits that slept, the last step's chunks per op per thread, the
        backup copies ("backups": chunks a thread committed for another that
        held them; "discarded": copies that lost the commit; "staged_steps"),
        and
        thread_idle_fraction: the share of the threads' time in the steps
        spent waiting rather than computing (1 - work / (threads x step
        wall)). A few percent on a quiet machine (the ops' imbalance and
        their ends); large when other programs hold the cores."""
        t = self.exe.thread_stats()
        wall = t["wall_cycles"] * self.n_threads
        t["thread_idle_fraction"] = max(0.0, 1.0 - sum(t["work_cycles"]) / wall) if wall else 0.0
        return t

    def reset_thread_stats(self) -> None:
        self.exe.reset_thread_stats()

    def execute(self, b: StepBatch) -> np.ndarray:
        """Runs one step; returns logits [n_out, vocab] as a view into the
        arena, valid until the next step (copy to keep)."""
        self.exe.run(b.tokens, b.positions, b.slots, b.seq_of_token, b.block_tables, b.out_rows)
        return self._logits[: len(b.out_rows)]

    def greedy_ids(self, n: int) -> np.ndarray:
        """The argmax of each of the last step's first n logits rows (numpy's
        rule: first index on ties), made by the step itself; a view valid
        until the next step."""
        return self._greedy[:n]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """KV block src -> dst for every layer's K and V (copy-on-write).
        All sources are read before any destination is written."""
        if copies:
            src, dst = (np.array(c, dtype=np.intp) for c in zip(*copies))
            self._kv_blocks[:, dst] = self._kv_blocks[:, src]

    def run(self, scheduled, copies: list[tuple[int, int]] = ()) -> np.ndarray:
        """Does the block copies, then computes every ScheduledSeq in one step.
        Returns logits [n, vocab] (a view, valid until the next step): per
        ScheduledSeq in schedule order, the rows of its `scored` positions,
        then its sampling row when .logits is set."""
        self.copy_blocks(copies)
        return self.execute(self.prepare(scheduled))

    def prepare(self, scheduled) -> StepBatch:
        """The step's arrays. Sequence i of the schedule is row i of
        block_tables; its tokens are consecutive, in position order."""
        bs = self.block_size
        tokens, positions, slots, seq_of, out_rows = [], [], [], [], []
        width = max(len(s.seq.block_table) for s in scheduled)
        tables = np.zeros((len(scheduled), width), dtype=np.int32)  # unused entries: block 0, never read
        for i, s in enumerate(scheduled):
            table, start, n = s.seq.block_table, s.start, s.num_tokens
            tables[i, : len(table)] = table
            if n == 1:  # decode: plain Python is faster than numpy for one token
                tokens.append(s.seq.token_ids[start])
                positions.append(start)
                slots.append(kv_slot(table, start, bs))
                seq_of.append(i)
            else:
                pos = np.arange(start, start + n)
                if s.draft:  # the known tokens, then the proposed ones after them
                    tokens.extend(s.seq.token_ids[start : start + n - len(s.draft)])
                    tokens.extend(s.draft)
                else:
                    tokens.extend(s.seq.token_ids[start : start + n])
                positions.extend(pos.tolist())
                slots.extend(kv_slot(table, pos, bs).tolist())
                seq_of.extend([i] * n)
            if s.scored:  # the batch index of position p is base + p
                base = len(tokens) - n - start
                out_rows.extend(range(base + s.scored.start, base + s.scored.stop))
            if s.logits:  # the last known token's row, then each proposed token's
                out_rows.extend(range(len(tokens) - 1 - len(s.draft), len(tokens)))
        i32 = ops.i32
        return StepBatch(i32(tokens), i32(positions), i32(slots), i32(seq_of), tables, i32(out_rows))


_BACKUPS = {"never": 0, "busy": 1, "always": 2}


def _backups_mode() -> int:
    """LLAMAJET_BACKUPS=never|busy|always (default never: experimental):
    when the executor runs a held matmul chunk again (executor.h)."""
    v = os.environ.get("LLAMAJET_BACKUPS", "never")
    if v not in _BACKUPS:
        raise LlamajetError(f"LLAMAJET_BACKUPS={v!r}: expected one of never, busy, always")
    return _BACKUPS[v]
