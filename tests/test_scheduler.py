"""Continuous batching end to end: the Scheduler, preemption, prefix caching
and the async stream, on real models.

The reference for batching is the engine itself running each request alone
(one sequence in flight, no prefix cache): greedy ids must be *equal*, not
close. Every kernel computes a token's row from that row alone (matmul rows,
per-token activation quantization, attention over its own sequence's block
table), so which other sequences share a step, how a prompt is chunked and
whether its prefix came from the cache change nothing in its logits.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest

from llamajet import LLM, RequestError, SamplingParams


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, **kw)


PROMPTS = [
    "Once upon a time",
    "Lily and Tom went to the park. They saw a big dog. The dog was brown and it wanted to play with a ball",
    "The cat",
    "One day, a little bird",
    "Tim had a red car. He liked to drive it around the house every day after school, and his mom",
    "A",
]
FULL_STOP = 426  # "." in stories260K's vocabulary
# Different lengths; two requests end at their first full stop, before max_tokens.
PARAMS = [greedy(40, ignore_eos=True), greedy(12, ignore_eos=True), greedy(60, stop_token_ids=(FULL_STOP,)),
          greedy(25, ignore_eos=True), greedy(3, ignore_eos=True), greedy(50, stop_token_ids=(FULL_STOP,))]


@pytest.fixture(scope="module")
def alone(stories_hf):
    """Each request run by itself: one sequence per step, nothing cached."""
    llm = LLM(stories_hf, max_model_len=256, max_num_seqs=1, enable_prefix_caching=False)
    return [llm.generate(p, q)[0] for p, q in zip(PROMPTS, PARAMS)]


def same(outs, refs):
    for o, r in zip(outs, refs):
        assert o.token_ids == r.token_ids
        assert o.text == r.text and o.finish_reason == r.finish_reason


@pytest.mark.parametrize("budget", [256, 16], ids=["budget256", "budget16-chunked"])
def test_batched_greedy_ids_equal_alone(stories_hf, alone, budget):
    llm = LLM(stories_hf, max_model_len=256, max_tokens_per_step=budget)
    outs = llm.generate(PROMPTS, PARAMS)
    same(outs, alone)
    assert [o.finish_reason for o in outs].count("stop") == 2  # ended early, at a stop token
    eng = llm.engine
    assert eng.stats.steps < sum(len(o.token_ids) for o in outs)  # really batched
    assert eng.blocks.num_used == 0 and not eng.has_unfinished()


def test_batched_equals_alone_on_the_default_model(smollm2_gguf):
    llm = LLM(smollm2_gguf, max_model_len=256)
    prompts = ["The capital of France is", "def add(a, b):", "Three colors: red,",
               "In 1969, Apollo 11 landed on the Moon, and the world watched as Neil Armstrong stepped"]
    params = [greedy(n, ignore_eos=True) for n in (12, 6, 16, 9)]
    ref = [llm.generate(p, q)[0] for p, q in zip(prompts, params)]
    llm.engine.blocks.reset_cache()
    same(llm.generate(prompts, params), ref)


def test_token_budget_mixes_prefill_chunks_and_decodes(stories_hf, alone):
    """A long prompt is computed in chunks, in the same steps as the other
    sequences' decode tokens; no step exceeds the budget."""
    llm = LLM(stories_hf, max_model_len=256, max_tokens_per_step=8)
    eng = llm.engine
    seqs = [eng.new_sequence(llm.tokenizer.encode(p), q) for p, q in zip(PROMPTS, PARAMS)]
    for s in seqs:
        eng.add_request(s)
    mixed = False
    while eng.has_unfinished():
        eng.step()
        sched = eng.last_schedule.scheduled
        assert sum(s.num_tokens for s in sched) <= 8
        kinds = {s.num_tokens > 1 or not s.logits for s in sched}  # prefill chunk vs decode
        mixed |= kinds == {True, False}
    assert mixed
    same([llm._output(p, [s]) for p, s in zip(PROMPTS, seqs)], alone)


def test_requests_join_the_running_batch_between_steps(stories_hf, alone):
    llm = LLM(stories_hf, max_model_len=256)
    eng = llm.engine
    ids = [llm.tokenizer.encode(p) for p in PROMPTS[:2]]
    a = eng.add_request(ids[0], PARAMS[0])
    for _ in range(5):
        eng.step()
    b = eng.add_request(ids[1], PARAMS[1])
    eng.step()
    sched = {s.seq.id: s for s in eng.last_schedule.scheduled}
    assert sched[a.id].num_tokens == 1 and sched[b.id].num_tokens == len(ids[1])  # one step: a decodes, b prefills
    while eng.has_unfinished():
        eng.step()
    same([llm._output(PROMPTS[0], [a]), llm._output(PROMPTS[1], [b])], alone[:2])


def test_pool_exhaustion_preempts_and_every_request_completes(stories_hf, alone):
    """A pool of 8 blocks (128 tokens) holds any one request but not all six
    at once: the newest sequences are preempted, recomputed later, and every
    output equals the one computed alone."""
    llm = LLM(stories_hf, max_model_len=256, kv_cache_tokens=128)
    outs = llm.generate(PROMPTS, PARAMS)
    same(outs, alone)
    eng = llm.engine
    assert eng.scheduler.num_preemptions > 0 and sum(o.metrics.preemptions for o in outs) > 0
    assert eng.blocks.num_used == 0
    eng.blocks.check()


def test_requests_that_can_never_fit_are_refused_at_admission(stories_hf):
    llm = LLM(stories_hf, max_model_len=256, kv_cache_tokens=64)
    with pytest.raises(RequestError, match="pool holds 64"):
        llm.generate("Once upon a time", greedy(100))
    with pytest.raises(RequestError, match="context holds 256"):
        llm.generate([[1] + [403] * 300], greedy(1))
    # one impossible request fails the whole call before anything runs
    steps = llm.engine.stats.steps
    with pytest.raises(RequestError, match="pool holds"):
        llm.generate(["Once upon a time", "The cat"], [greedy(10), greedy(100)])
    assert llm.engine.stats.steps == steps and not llm.engine.has_unfinished()
    assert llm.generate("Once upon a time", greedy(10))[0].token_ids


def test_prefix_cache_reuses_blocks_with_identical_output(stories_hf):
    llm = LLM(stories_hf, max_model_len=256)
    nocache = LLM(stories_hf, max_model_len=256, enable_prefix_caching=False)
    tok = llm.tokenizer
    prefix = tok.encode(PROMPTS[1] + " " + PROMPTS[4])
    prefix = prefix[: len(prefix) // 16 * 16]  # whole blocks
    a, b = prefix + tok.encode(" red", add_special_tokens=False), prefix + tok.encode(" Lily", add_special_tokens=False)
    p = greedy(20, ignore_eos=True)
    llm.generate([a], p)
    out = llm.generate([b], p)[0]
    assert out.metrics.cached_tokens == len(prefix)
    assert out.token_ids == nocache.generate([b], p)[0].token_ids
    # The same block-aligned prompt again: every block hits, the last token is
    # recomputed into a copy of its (cached, so immutable) block.
    copies = llm.engine.blocks.num_copies
    again = llm.generate([prefix], p)[0]
    assert again.metrics.cached_tokens == len(prefix) - 1
    assert llm.engine.blocks.num_copies == copies + 1
    assert again.token_ids == nocache.generate([prefix], p)[0].token_ids


def test_prefix_cache_computes_only_the_new_tokens(smollm2_gguf):
    """A second request sharing a 256-token prefix with a finished one computes
    only its own tokens (the 16 full blocks of the prefix come from the
    cache), with identical output; with the cache off it computes all of them.
    Counted in tokens the engine computed (EngineStats.tokens), not timed: the
    time to first token this saves is measured in benchmarks/prefix_cache_ttft.py."""
    llm = LLM(smollm2_gguf, max_model_len=512)
    tok = llm.tokenizer
    from conftest import SHARED_DATA

    ids = tok.encode((SHARED_DATA / "corpora" / "wikitext-2-raw-test.txt").read_text()[:40_000])
    assert len(ids) > 6008
    p = greedy(8, ignore_eos=True)
    prefix = ids[:256]
    a, b = prefix + ids[4000:4008], prefix + ids[6000:6008]
    stats = llm.engine.stats
    computed = []
    for req in (a, b):
        before = stats.tokens
        out = llm.generate([req], p)[0]
        computed.append(stats.tokens - before)
    assert out.metrics.cached_tokens == 256
    # a: its 264 prompt tokens, then 7 decode steps (the 8th token ends it unsampled
    # as input); b: only its 8 new prompt tokens, then the same 7 decode steps
    assert computed == [264 + 7, 8 + 7], computed
    llm.engine.blocks.reset_cache()
    before = stats.tokens
    again = llm.generate([b], p)[0]
    assert stats.tokens - before == 264 + 7 and again.metrics.cached_tokens == 0
    assert again.token_ids == out.token_ids  # same output computed from scratch


def test_async_streams_run_together(stories_hf, alone):
    llm = LLM(stories_hf, max_model_len=256)
    order = []

    async def consume(i):
        toks = []
        async for ev in llm.astream(PROMPTS[i], PARAMS[i]):
            order.append(i)
            if ev.token_id is not None:
                toks.append(ev.token_id)
        return toks

    async def main():
        return await asyncio.gather(*(consume(i) for i in (0, 2, 3)))

    got = asyncio.run(main())
    assert got == [alone[i].token_ids for i in (0, 2, 3)]
    # interleaved: request 2 produced tokens before request 0 finished
    assert order.index(2) < len(order) - 1 - order[::-1].index(0)

    async def leave_early():
        async with aclosing(llm.astream(PROMPTS[0], greedy(100, ignore_eos=True))) as s:
            n = 0
            async for _ in s:
                n += 1
                if n == 3:
                    break
        # the abort is taken in by the next step; another request drives it
        return await llm.agenerate(PROMPTS[2], PARAMS[2])

    out = asyncio.run(leave_early())
    assert out.token_ids == alone[2].token_ids
    assert llm.engine.blocks.num_used == 0 and not llm.engine.has_unfinished()


def test_stop_strings_end_sequences_inside_the_batch(stories_hf):
    llm = LLM(stories_hf, max_model_len=256)
    p = [greedy(40, stop=("Lily",)), greedy(30, ignore_eos=True), greedy(40, stop=(" the",))]
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]
    batch = llm.generate(prompts, p)
    for prompt, q, out in zip(prompts, p, batch):
        assert out.token_ids == llm.generate(prompt, q)[0].token_ids
        for s in q.stop:
            assert s not in out.text
    assert batch[0].finish_reason == "stop"
    assert llm.engine.blocks.num_used == 0


def test_cli_bench_runs_and_reports_kv_use(stories_hf, tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "llamajet.cli", "bench", "--model", str(stories_hf), "--batch", "1,3",
                        "--prompt-tokens", "20", "--max-tokens", "12", "--max-model-len", "64", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "decode tok/s" in r.stdout and "KV used" in r.stdout
    res = json.loads(out.read_text())
    assert [x["batch"] for x in res] == [1, 3]
    for x in res:
        # all prompts in the first step, then 11 decode-only steps in which every
        # sequence holds 21..31 tokens in 2 blocks of 16
        assert x["decode_tokens"] == x["batch"] * 11 and x["preemptions"] == 0
        assert 21 / 32 <= x["kv_utilization"] <= 1
