"""Cost of a speculative verification step: the time of a (1 + k)-token step over a 1-token step for
one sequence of the default model (ModelRunner.run directly, medians of 7, k = 0, 1, 2, 4, 8).
Verification pays only where 1 + accepted tokens outweigh this ratio (issue 43).

    python benchmarks/spec_step_cost.py

Measured 2026-12-06 on a quiet 2-core AVX2 EPYC: 8.16 ms for one token; 1.66x, 2.33x, 3.75x, 6.72x
for 1+1, 1+2, 1+4, 1+8 tokens (batch 1 only; batches 4 and 16 and the 8B shape are not here yet).
"""
import time, statistics
from llamajet import LLM, SamplingParams
from llamajet.engine.scheduler import ScheduledSeq
llm = LLM(max_model_len=1024, enable_prefix_caching=False)
eng = llm.engine
ids = llm.tokenizer.encode("The history of the city begins with " * 20)
seq = eng.new_sequence(ids, SamplingParams(max_tokens=400, temperature=0))
eng.add_request(seq)
while seq.num_computed < len(ids) - 1 or not seq.token_ids[len(ids):]:
    eng.step()
r = eng.runner
eng.blocks.allocate_slots(seq, seq.num_computed, seq.num_computed + 9)
res = {}
for rep in range(7):
    for k in (0, 1, 2, 4, 8):
        s = ScheduledSeq(seq, seq.num_computed, 1 + k, True, draft=tuple([seq.token_ids[-1]] * k))
        t = time.perf_counter(); r.run([s]); res.setdefault(k, []).append(time.perf_counter() - t)
base = statistics.median(res[0])
for k, v in res.items():
    print(f"1+{k} tokens: {statistics.median(v)*1e3:.2f} ms = {statistics.median(v)/base:.2f}x of a 1-token step")
