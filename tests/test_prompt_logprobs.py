"""Prompt logprobs (SamplingParams.prompt_logprobs) computed in the prompt's
own prefill, and score-only requests (max_tokens=0), on the default model.

The reference is `LLM.logits(ids)`: every row of the prompt computed by the
engine's separate scoring path (Engine.logits). Prompt logprobs are
log_softmax(row p - 1)[token p], from the same helpers as generated-token
logprobs, and on one kernel tier a row's bits depend only on its own token
and the K/V before it (see test_scheduler.py), not on the step's batch, its
chunking or how many rows the step returns. So the numbers must be *equal*;
the 1e-4 bound is what a scoring client (lm-eval) could tell apart.
"""

from __future__ import annotations

import numpy as np
import pytest

from llamajet import LLM, RequestError, SamplingParams
from llamajet.engine.sampling import log_softmax, top_logprobs
from llamajet.engine.sequence import StreamEvent

SHORT = "The capital of France is Paris, and the capital of Italy is"
LONG = ("The old lighthouse keeper climbed the spiral stairs every evening, counting the steps as his father had "
        "taught him. At the top he trimmed the wick, polished the great lens and watched the ships come home. "
        "Storms came in autumn, and the sea threw spray against the glass, but the light never failed. One night "
        "a small boat drifted toward the rocks with no lantern at all, and the keeper rang the bell until his arms "
        "ached. In the morning the fishermen brought him bread, salt fish and a letter from the harbour master, "
        "who thanked him in careful handwriting.")
OTHERS = ["def add(a, b):", "Three colors: red,", "Once upon a time, in a small village by the sea, there lived"]
K = 5


def score(k: int = K, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=0, prompt_logprobs=k, **kw)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def llm(smollm2_gguf):
    # the default step: 256 tokens but at most 64 logits rows (runner.max_out),
    # so a prompt longer than 64 tokens is scored in several chunks
    llm = LLM(smollm2_gguf, max_model_len=512)
    assert llm.engine.runner.max_out == 64 < llm.engine.runner.max_tokens
    assert len(llm.tokenizer.encode(SHORT)) < 64 < len(llm.tokenizer.encode(LONG))
    return llm


def assert_matches_reference(llm, ids: list[int], pl: list, k: int = K) -> None:
    """pl (a Sequence's prompt_logprobs) against the full-sequence logits."""
    ref = log_softmax(llm.logits(ids))
    assert len(pl) == len(ids) and pl[0] is None
    got = np.array([pl[p][0] for p in range(1, len(ids))])
    want = ref[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    np.testing.assert_array_equal(got, want)  # same rows, same bits (module docstring)
    for p in range(1, len(ids)):
        assert pl[p][1] == top_logprobs(ref[p - 1], k), p


def output(seq) -> tuple[list[int], str]:
    """A finished sequence's generated ids and text, from its events."""
    return [e.token_id for e in seq.events if e.token_id is not None], "".join(e.text for e in seq.events)


def run(llm, seqs) -> list[list]:
    """Steps the engine until `seqs` (queued in order) finish; the schedule of each step."""
    eng, steps = llm.engine, []
    for s in seqs:
        eng.add_request(s)
    while eng.has_unfinished():
        eng.step()
        steps.append(eng.last_schedule.scheduled)
    return steps


@pytest.mark.parametrize("text", [SHORT, LONG], ids=["short", "long-chunked"])
def test_score_only_request_matches_full_logits(llm, text):
    eng = llm.engine
    ids = llm.tokenizer.encode(text)
    seq = eng.new_sequence(ids, score())
    steps = run(llm, [seq])
    assert list(seq.events) == [StreamEvent(None, "", "length")]
    assert seq.finish_reason == "length" and seq.num_output == 0
    assert seq.num_tokens_run == len(ids)  # every prompt token computed once
    assert_matches_reference(llm, ids, seq.prompt_logprobs)
    # rows per step within the runner's max_out; the long prompt's chunks cut
    # at it; every position 0 .. P-2 scored once, in order
    max_out = eng.runner.max_out
    assert all(sum(s.num_rows for s in step) <= max_out for step in steps)
    scored = [q for step in steps for s in step for q in s.scored]
    assert scored == list(range(len(ids) - 1))
    chunks = [s.num_tokens for step in steps for s in step]
    assert sum(chunks) == len(ids) and all(n == max_out for n in chunks[:-1])
    assert len(chunks) == (1 if text is SHORT else 2)
    assert eng.blocks.num_used == 0 and not eng.has_unfinished()


def test_prompt_logprobs_then_generation(llm):
    """max_tokens >= 1: the last prompt row is also the first sampling row;
    the output is the one the same request gets without prompt_logprobs."""
    ids = llm.tokenizer.encode(LONG)
    plain = llm.generate([ids], greedy(8))[0]
    llm.engine.blocks.reset_cache()
    seq = llm.engine.new_sequence(ids, greedy(8, logprobs=2, prompt_logprobs=3))
    run(llm, [seq])
    toks, text = output(seq)
    assert toks == plain.token_ids and text == plain.text
    assert_matches_reference(llm, ids, seq.prompt_logprobs, 3)  # (not extended by the output)
    assert seq.num_tokens_run == len(ids) + len(toks) - 1
    last, first = log_softmax(llm.logits(ids)[-1]), seq.events[0]
    assert first.logprob == last[toks[0]] and first.top_logprobs == top_logprobs(last, 2)


def test_first_event_finds_prompt_logprobs_complete(llm):
    eng = llm.engine
    ids = llm.tokenizer.encode(LONG)
    seq = eng.add_request(ids, greedy(3, prompt_logprobs=1))
    while not seq.events:
        assert len(seq.prompt_logprobs) < len(ids)
        eng.step()
    assert len(seq.prompt_logprobs) == len(ids)
    run(llm, [])


def test_prefix_cache_hit_is_still_scored(llm):
    """A prompt whose blocks are all in the prefix cache is computed again
    (a cache hit has no logits): every row, each once."""
    eng = llm.engine
    ids = llm.tokenizer.encode(LONG)
    llm.generate([ids], greedy(1))
    warm = eng.new_sequence(ids, greedy(1))
    run(llm, [warm])
    assert warm.num_cached_tokens == len(ids) // eng.blocks.block_size * eng.blocks.block_size > 0
    seq = eng.new_sequence(ids, score())
    run(llm, [seq])
    assert seq.num_cached_tokens == 0 and seq.num_tokens_run == len(ids)
    assert_matches_reference(llm, ids, seq.prompt_logprobs)
    # its blocks were offered to the cache afterwards; the cached ones stayed
    again = eng.new_sequence(ids, greedy(1))
    run(llm, [again])
    assert again.num_cached_tokens == warm.num_cached_tokens


def test_batched_with_ordinary_requests(llm):
    """A scoring request queued first (so it is the oldest running sequence)
    shares steps with ordinary requests: their outputs are those they get
    alone, and no decoding sequence waits for a logits row."""
    eng = llm.engine
    tok = llm.tokenizer
    params = [greedy(n) for n in (12, 6, 16)]
    alone = [llm.generate(p, q)[0] for p, q in zip(OTHERS, params)]
    eng.blocks.reset_cache()
    ids = tok.encode(LONG)
    scoring = eng.new_sequence(ids, score())
    others = [eng.new_sequence(tok.encode(p), q) for p, q in zip(OTHERS, params)]
    for s in [scoring, *others]:
        eng.add_request(s)
    mixed, max_out = False, eng.runner.max_out
    while eng.has_unfinished():
        decoding = [s for s in eng.scheduler.running if s.num_tokens - s.num_computed == 1]
        eng.step()
        sched = {s.seq.id: s for s in eng.last_schedule.scheduled}
        assert sum(s.num_rows for s in sched.values()) <= max_out
        assert all(sched[s.id].logits for s in decoding)  # a decode always gets its row
        if scoring.id in sched and sched[scoring.id].scored:
            mixed |= any(s.logits for s in sched.values())
    assert mixed
    assert scoring.num_tokens_run == len(ids)
    assert_matches_reference(llm, ids, scoring.prompt_logprobs)
    for o, r in zip(others, alone):
        assert output(o) == (r.token_ids, r.text)


def test_choices_share_the_prompt_logprobs(llm):
    eng = llm.engine
    ids = llm.tokenizer.encode(SHORT)
    head = eng.new_sequence(ids, SamplingParams(max_tokens=4, temperature=1.0, seed=7, n=3, ignore_eos=True,
                                                prompt_logprobs=2))
    group = [head, *head.forks]
    run(llm, [head])
    assert all(s.finish_reason == "length" and s.num_output == 4 for s in group)
    assert all(s.prompt_logprobs is head.prompt_logprobs for s in group)
    assert_matches_reference(llm, ids, head.prompt_logprobs, 2)
    # the prompt computed once, by the head; then each choice's own tokens
    assert sum(s.num_tokens_run for s in group) == len(ids) + sum(s.num_output - 1 for s in group)

    head = eng.new_sequence(ids, score(2, n=2))
    group = [head, *head.forks]
    run(llm, [head])
    assert [list(s.events) for s in group] == [[StreamEvent(None, "", "length", i)] for i in range(2)]
    assert all(s.prompt_logprobs is head.prompt_logprobs for s in group)
    assert head.num_tokens_run == len(ids) and group[1].num_tokens_run == 0


def test_score_only_prompt_may_fill_the_context(smollm2_gguf):
    llm = LLM(smollm2_gguf, max_model_len=64)
    ids = (llm.tokenizer.encode(LONG) * 2)[:64]
    seq = llm.engine.new_sequence(ids, score())
    run(llm, [seq])
    assert seq.num_tokens_run == 64
    assert_matches_reference(llm, ids, seq.prompt_logprobs)
    with pytest.raises(RequestError, match="context"):
        llm.engine.new_sequence(ids, greedy(1, prompt_logprobs=1))


@pytest.fixture(scope="module")
def small_pool(smollm2_gguf):
    return LLM(smollm2_gguf, max_model_len=256, kv_cache_tokens=128)


@pytest.mark.parametrize("text,max_tokens,when", [(LONG, 0, "mid-prompt"), (LONG, 10, "mid-prompt"),
                                                  (SHORT, 60, "decoding")])
def test_preemption_neither_duplicates_nor_corrupts(small_pool, text, max_tokens, when):
    """A pool of 8 blocks (128 tokens) holds either request alone but not
    both at their longest: the scoring request (the newest) is preempted,
    in the middle of its prompt or after it, and recomputed. Its prompt
    logprobs are each computed once (rows already stored are not asked for
    again) and equal the reference; its output is the one it gets alone."""
    llm = small_pool
    eng = llm.engine
    eng.blocks.reset_cache()  # each case starts from an empty prefix cache
    ids = llm.tokenizer.encode(text)
    other_ids = llm.tokenizer.encode(OTHERS[2])
    other = eng.new_sequence(other_ids, greedy(128 - len(other_ids) - 8))
    scoring = eng.new_sequence(ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                                   prompt_logprobs=K))
    eng.add_request(other)
    eng.step()
    eng.add_request(scoring)
    scored, at_preemption = [], []
    while eng.has_unfinished():
        eng.step()
        out = eng.last_schedule
        if scoring in out.preempted:
            at_preemption.append(len(scoring.prompt_logprobs))
        scored += [q for s in out.scheduled if s.seq is scoring for q in s.scored]
    assert at_preemption and scoring.num_preemptions == len(at_preemption)
    if when == "mid-prompt":
        assert 1 < at_preemption[0] < len(ids)
    else:
        assert at_preemption == [len(ids)] * len(at_preemption)
    assert scored == list(range(len(ids) - 1))  # each row asked for once, in order
    assert scoring.num_tokens_run > len(ids) + max(max_tokens - 1, 0)  # (the recompute)
    assert_matches_reference(llm, ids, scoring.prompt_logprobs)
    eng.blocks.reset_cache()
    if max_tokens:
        assert output(scoring)[0] == llm.generate([ids], greedy(max_tokens))[0].token_ids
    assert output(other)[0] == llm.generate([other_ids], other.params)[0].token_ids


@pytest.mark.parametrize("kwargs", [dict(prompt_logprobs=-1), dict(prompt_logprobs=SamplingParams.MAX_LOGPROBS + 1),
                                    dict(prompt_logprobs=1.5), dict(max_tokens=0),
                                    dict(max_tokens=-1, prompt_logprobs=1)])
def test_bad_values_are_refused(kwargs):
    with pytest.raises(RequestError):
        SamplingParams(**kwargs)


def test_good_values():
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).score_only
    assert SamplingParams(prompt_logprobs=SamplingParams.MAX_LOGPROBS).prompt_logprobs == 20
    assert not SamplingParams(max_tokens=1, prompt_logprobs=3).score_only
