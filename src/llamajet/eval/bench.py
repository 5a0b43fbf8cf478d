"""Throughput benchmark: continuous batching at several batch sizes.

    llamajet bench --batch 1,4,16,64

For each batch size B, B requests with different prompts (seeded draws
from the model's vocabulary, or consecutive windows of --corpus) of
`prompt_tokens` tokens each generate `max_tokens` tokens greedily (EOS
ignored, so every sequence runs the full length). The engine is stepped
directly and every step is timed:
- decode tok/s: tokens of the decode-only steps (every running sequence
  computes one token) over their time — the throughput the batch sustains;
- prefill tok/s: prompt tokens over the time of the steps that held any;
- KV use, averaged over decode steps: token slots in the blocks the running
  sequences hold vs the tokens they hold (the rest is each sequence's
  partly filled last block), and the bytes of those blocks.
One engine serves every batch size (one Program, one pool sized for the
largest); the prefix cache is cleared between runs so no run reuses
another's prompts. `--rounds` rounds alternate over the batch sizes and
each size reports its median round (ratios are then measured side by side).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from llamajet.engine.sampling import SamplingParams


@dataclass
class BatchResult:
    batch: int
    decode_tokens: int = 0
    decode_s: float = 0.0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    steps: int = 0
    kv_slots: int = 0         # sum over decode steps of slots in held blocks
    kv_tokens: int = 0        # sum over decode steps of tokens held
    kv_bytes_peak: int = 0    # bytes of the blocks held, at the largest
    preemptions: int = 0
    idle: float = 0.0         # thread_idle_fraction over the run's steps (ModelRunner.thread_stats)

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else float("nan")

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s else float("nan")

    @property
    def kv_utilization(self) -> float:
        return self.kv_tokens / self.kv_slots if self.kv_slots else float("nan")


def prompt_ids(tokenizer, vocab: int, need: int, corpus: Path | None = None, seed: int = 0) -> list[int]:
    """At least `need` token ids for timing runs.

    Without a corpus: seeded draws from the model's own vocabulary, its added
    and special tokens left out, so the bench needs no file beside the model
    (an installed wheel has no corpus; speed does not depend on which ordinary
    tokens a prompt holds). With one: the text's tokens, from the start.
    """
    if corpus is None:
        skip = np.fromiter(tokenizer.added_ids, dtype=np.int64) if tokenizer.added_ids else np.empty(0, np.int64)
        ordinary = np.setdiff1d(np.arange(vocab, dtype=np.int64), skip)
        return np.random.default_rng(seed).choice(ordinary, size=need).tolist()
    if not corpus.is_file():
        raise SystemExit(f"llamajet bench: --corpus {corpus}: no such file")
    text = corpus.read_text(encoding="utf-8")
    chars = need * 8
    while True:
        ids = tokenizer.encode(text[:chars], add_special_tokens=False)
        if len(ids) >= need:
            return ids
        if chars >= len(text):
            raise SystemExit(f"llamajet bench: --corpus {corpus} has {len(ids)} tokens; this bench needs {need}")
        chars *= 2


def bench_prompts(tokenizer, n: int, length: int, corpus: Path | None, vocab: int) -> list[list[int]]:
    """n different prompts of `length` tokens (prompt_ids cut in windows)."""
    ids = prompt_ids(tokenizer, vocab, n * length, corpus)
    return [ids[i * length : (i + 1) * length] for i in range(n)]


def run_batch(llm, prompts: list[list[int]], max_tokens: int) -> BatchResult:
    eng = llm.engine
    eng.blocks.reset_cache()
    eng.runner.reset_thread_stats()
    res = BatchResult(batch=len(prompts))
    pre0 = eng.scheduler.num_preemptions
    p = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    seqs = [eng.new_sequence(ids, p) for ids in prompts]
    for s in seqs:
        eng.add_request(s)
    bs, block_bytes = eng.blocks.block_size, eng.runner.kv_bytes_per_block
    while eng.has_unfinished():
        t0 = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t0
        sched = eng.last_schedule.scheduled
        n = sum(s.num_tokens for s in sched)
        res.steps += 1
        if all(s.num_tokens == 1 and s.logits for s in sched):
            res.decode_tokens += n
            res.decode_s += dt
            # KV held after the step; a sequence that finished in it counts
            # with the blocks it held until then
            seqs_now = [s.seq for s in sched]
            held = sum(eng.blocks.blocks_for(s.num_computed) if s.finished else len(s.block_table)
                       for s in seqs_now)
            res.kv_slots += held * bs
            res.kv_tokens += sum(s.num_computed for s in seqs_now)
            res.kv_bytes_peak = max(res.kv_bytes_peak, held * block_bytes)
        else:
            res.prefill_tokens += sum(s.num_tokens for s in sched if not (s.num_tokens == 1 and s.logits))
            res.prefill_s += dt
    res.preemptions = eng.scheduler.num_preemptions - pre0
    res.idle = eng.runner.thread_stats()["thread_idle_fraction"]
    for s in seqs:
        s.events.clear()
    return res


def format_results(results: list[BatchResult]) -> str:
    base = results[0].decode_tps if results and results[0].batch == 1 else float("nan")
    lines = [f"{'batch':>5} {'decode tok/s':>12} {'vs batch 1':>10} {'per seq':>8} {'prefill tok/s':>13} "
             f"{'KV slots':>9} {'tokens':>9} {'KV used':>8} {'KV MiB':>7} {'preempt':>7} {'idle':>5}"]
    for r in results:
        lines.append(
            f"{r.batch:>5} {r.decode_tps:>12.1f} {r.decode_tps / base:>9.2f}x {r.decode_tps / r.batch:>8.1f} "
            f"{r.prefill_tps:>13.1f} {r.kv_slots:>9} {r.kv_tokens:>9} {100 * r.kv_utilization:>7.1f}% "
            f"{r.kv_bytes_peak / 2**20:>7.1f} {r.preemptions:>7} {r.idle:>5.2f}")
    return "\n".join(lines)


def main(a) -> int:
    """`llamajet bench` (flags parsed in cli.py)."""
    from llamajet.api import LLM

    batches = sorted({int(b) for b in str(a.batch).split(",") if b.strip()})
    if not batches or batches[0] < 1:
        raise SystemExit("llamajet bench: --batch takes positive integers, e.g. 1,4,16,64")
    from llamajet.options import runtime_config

    length = a.prompt_tokens + a.max_tokens
    cfg = runtime_config(a)
    # a pool for every sequence at full length, and one step that can hold all of them
    cfg = cfg.with_options(max_model_len=cfg.max_model_len or length, max_num_seqs=max(batches),
                           kv_cache_tokens=max(batches) * (-(-length // cfg.block_size)) * cfg.block_size)
    llm = LLM(a.model, cfg)
    vocab = llm.config.vocab_size
    corpus = Path(a.corpus) if a.corpus else None
    prompts = bench_prompts(llm.tokenizer, max(batches), a.prompt_tokens, corpus, vocab)
    run_batch(llm, prompts[:1], 4)  # warm-up: code paths, thread pool
    print(f"model: {llm.path.name}  isa: {llm.isa}  threads: {llm.n_threads}  kv: {cfg.kv_dtype}, "
          f"block {cfg.block_size}  prompt {a.prompt_tokens} + {a.max_tokens} new tokens per sequence")
    # Rounds alternate over the batch sizes (this machine's speed drifts: every
    # size sees the same drift); each size reports its median-throughput round.
    rounds = max(1, a.rounds)
    runs: dict[int, list[BatchResult]] = {b: [] for b in batches}
    for i in range(rounds):
        for b in batches:
            runs[b].append(run_batch(llm, prompts[:b], a.max_tokens))
        print(f"round {i + 1}/{rounds}: " + "  ".join(f"{b}: {runs[b][-1].decode_tps:.1f}" for b in batches)
              + " decode tok/s", flush=True)
    results = [sorted(runs[b], key=lambda r: r.decode_tps)[(rounds - 1) // 2] for b in batches]
    print(format_results(results), flush=True)
    print("(idle: thread_idle_fraction, the share of the threads' step time spent waiting rather than computing; "
          "a few percent on a quiet machine, far more when other programs hold the cores)")
    pool = llm.engine.runner.kv_pool_bytes
    print(f"KV pool: {llm.engine.blocks.num_blocks} blocks x {cfg.block_size} slots = "
          f"{pool / 2**20:.1f} MiB allocated (committed at start); "
          f"{llm.engine.runner.kv_bytes_per_block // cfg.block_size} bytes per token")
    if a.json:
        Path(a.json).write_text(json.dumps([dict(asdict(r), decode_tps=r.decode_tps, prefill_tps=r.prefill_tps,
                                                 kv_utilization=r.kv_utilization) for r in results], indent=1))
    return 0
