"""Cost of a speculative verification step: the time of a step in which each
of B sequences computes its last token and k proposed ones, over the time of
a 1-token-per-sequence step (ModelRunner.run directly, medians), for k = 1 ...
8 and batch sizes B; and the speedup each acceptance rate would give at that
cost (expected tokens per step (1 - a^(k+1)) / (1 - a), a the per-token
acceptance, over the step's cost: what speculation can buy on this machine,
not a measured speedup). With --draft, the draft model's time per proposed
token (a batched 1-token step of the draft) over the target's 1-token step.
Verification pays only where 1 + accepted tokens outweigh the ratio (issue 43).

    python benchmarks/spec_step_cost.py [--model PATH] [--batch 1,4,16] [--ks 1,2,4,8] [--draft PATH]

The 8B shape: `python benchmarks/make_random_gguf.py` writes random-weight
GGUFs of real shapes into a temporary folder (acceptance means nothing
there, only the step costs do).

Measured 2026-12-06 on a quiet 2-core AVX2 EPYC (Zen 1), default model,
batch 1: 8.16 ms for one token; 1.66x, 2.33x, 3.75x, 6.72x for 1+1, 1+2,
1+4, 1+8 tokens. After the AVX2 int16 partial sums (2026-12-07): 6.90 ms;
1.46x, 2.19x, 3.41x, 6.02x.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from llamajet import LLM, SamplingParams
from llamajet.engine.scheduler import ScheduledSeq


def sequences(llm, batch: int, ctx: int):
    """`batch` sequences with `ctx` known tokens each, their K/V computed, with blocks for 9 more."""
    eng = llm.engine
    seqs = []
    for b in range(batch):
        ids = llm.tokenizer.encode(f"Sequence {b}: the history of the city begins with " * 40)[:ctx]
        seq = eng.new_sequence(ids, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
        eng.add_request(seq)
        seqs.append(seq)
    while any(s.num_computed < len(s.token_ids) - 1 for s in seqs):
        eng.step()
    for s in seqs:
        eng.blocks.allocate_slots(s, s.num_computed, s.num_computed + 9)
    return seqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model path (default: the default model)")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--ctx", type=int, default=200, help="known tokens per sequence")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--draft", default=None, help="a draft model path: its cost per proposed token")
    a = ap.parse_args()
    batches, ks = [int(v) for v in a.batch.split(",")], [int(v) for v in a.ks.split(",")]
    # rows: a step of B sequences with k proposals each returns B (1 + k) logits rows (max_out follows
    # max_num_seqs up to the step's token budget)
    rows = max(batches) * (1 + max(ks))
    llm = LLM(a.model, max_model_len=1024, enable_prefix_caching=False, max_num_seqs=max(64, rows),
              max_tokens_per_step=max(256, rows))
    r = llm.engine.runner
    load0 = os.getloadavg()[0]
    print(f"model {llm.path.name}, isa {r.isa}, threads {r.n_threads}, {a.ctx} known tokens per sequence, "
          f"medians of {a.reps}")
    print("| batch | k | step ms | x a 1-token step | speedup at acceptance 0.5 / 0.7 / 0.9 (expected, not measured) |")
    print("|---|---|---|---|---|")
    base_ms = {}
    for batch in batches:
        seqs = sequences(llm, batch, a.ctx)
        res: dict[int, list[float]] = {}
        for _ in range(a.reps):
            for k in [0] + ks:
                step = [ScheduledSeq(s, s.num_computed, 1 + k, True, draft=tuple([s.token_ids[-1]] * k))
                        for s in seqs]
                t = time.perf_counter()
                r.run(step)
                res.setdefault(k, []).append(time.perf_counter() - t)
        base = statistics.median(res[0])
        base_ms[batch] = base * 1e3
        print(f"| {batch} | 0 | {base * 1e3:.2f} | 1.00x | |")
        for k in ks:
            ratio = statistics.median(res[k]) / base
            gain = " / ".join(f"{(1 - al ** (k + 1)) / (1 - al) / ratio:.2f}x" for al in (0.5, 0.7, 0.9))
            print(f"| {batch} | {k} | {statistics.median(res[k]) * 1e3:.2f} | {ratio:.2f}x | {gain} |")
        for s in seqs:
            llm.engine.abort(s)
        llm.engine.step()
    if a.draft:
        d = LLM(a.draft, max_model_len=1024, enable_prefix_caching=False, max_num_seqs=max(batches))
        dr = d.engine.runner
        print("\n| batch | draft 1-token step ms | x the target's 1-token step (cost per proposed token) |")
        print("|---|---|---|")
        for batch in batches:
            seqs = sequences(d, batch, a.ctx)
            times = []
            for _ in range(a.reps):
                step = [ScheduledSeq(s, s.num_computed, 1, True) for s in seqs]
                t = time.perf_counter()
                dr.run(step)
                times.append(time.perf_counter() - t)
            ms = statistics.median(times) * 1e3
            print(f"| {batch} | {ms:.2f} | {ms / base_ms[batch]:.3f}x |")
    load1 = os.getloadavg()[0]
    busy = max(load0, load1) > 0.75 * (os.cpu_count() or 1)
    print(f"\nload average (1 min) {load0:.2f} at start, {load1:.2f} at end{' (busy machine)' if busy else ''}")


if __name__ == "__main__":
    main()
