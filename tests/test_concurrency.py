"""The concurrency contract of LLM and AsyncEngine (api.LLM's docstring,
docs/limits.md): calls from several threads either work, each as it would
alone, or raise ConcurrencyError; the KV pool is whole afterwards.

Waits below have generous timeouts so a regression fails instead of hanging
the run; no test asserts anything about time."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from llamajet import LLM, SamplingParams
from llamajet.errors import ConcurrencyError, LlamajetError

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One day, a bird"]
WAIT_S = 300  # a hang fails the test instead of the whole run


@pytest.fixture(scope="module")
def llm(stories_hf):
    return LLM(stories_hf, max_model_len=128)


def assert_pool_idle(llm: LLM) -> None:
    """Block manager invariants hold and no sequence holds a block."""
    blocks = llm.engine.blocks
    blocks.check()
    assert all(b.ref_count == 0 for b in blocks.blocks)
    assert not llm.engine.has_unfinished()


@pytest.fixture(scope="module")
def alone(llm) -> dict[str, list[int]]:
    """Each prompt's greedy ids, generated with nothing else running."""
    return {p: llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS}


def test_threads_sharing_an_llm_get_what_each_gets_alone(llm, alone):
    start = threading.Barrier(len(PROMPTS))

    def run(prompt: str) -> list[list[int]]:
        start.wait(timeout=WAIT_S)  # every thread calls generate at once
        return [llm.generate(prompt, GREEDY)[0].token_ids for _ in range(3)]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(run, PROMPTS, timeout=WAIT_S))
    for prompt, runs in zip(PROMPTS, results):
        assert runs == [alone[prompt]] * 3, prompt
    assert_pool_idle(llm)


def test_logits_and_chat_beside_generate(llm, alone):
    ids = llm.tokenizer.encode(PROMPTS[0])
    ref = llm.logits(ids)
    start = threading.Barrier(2)

    def score():
        start.wait(timeout=WAIT_S)
        return [llm.logits(ids) for _ in range(5)]

    def gen():
        start.wait(timeout=WAIT_S)
        return [llm.generate(PROMPTS[1], GREEDY)[0].token_ids for _ in range(3)]

    with ThreadPoolExecutor(2) as pool:
        scores, gens = pool.submit(score), pool.submit(gen)
        assert all((s == ref).all() for s in scores.result(WAIT_S))
        assert gens.result(WAIT_S) == [alone[PROMPTS[1]]] * 3
    assert_pool_idle(llm)


def test_streams_from_two_threads_share_steps_safely(llm):
    """stream is not serialized: two threads step the engine in turn (whole
    steps, under the Engine's lock) and each gets its own request's tokens."""
    start = threading.Barrier(2)

    def consume(prompt: str) -> list:
        start.wait(timeout=WAIT_S)
        return list(llm.stream(prompt, GREEDY))

    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(consume, PROMPTS[:2], timeout=WAIT_S)
    for events in (a, b):
        toks = [e.token_id for e in events if e.token_id is not None]
        assert len(toks) == GREEDY.max_tokens and events[-1].finish_reason == "length"
    assert_pool_idle(llm)


def _loop_in_thread() -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    return loop, thread


def _close(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    loop.call_soon_threadsafe(loop.stop)
    thread.join(WAIT_S)
    loop.close()


def test_sync_generate_while_async_requests_run(llm):
    """A sync call and the AsyncEngine's driver step one engine: every
    request of both finishes, none loses its events, the pool ends idle."""
    loop, thread = _loop_in_thread()
    try:
        futures = [asyncio.run_coroutine_threadsafe(llm.agenerate(p, GREEDY), loop) for p in PROMPTS[:2]]
        sync = [llm.generate(p, GREEDY)[0] for p in PROMPTS[2:]]
        outs = [f.result(WAIT_S) for f in futures]
    finally:
        _close(loop, thread)
    for out in outs + sync:
        assert len(out.token_ids) == GREEDY.max_tokens and out.finish_reason == "length"
    assert_pool_idle(llm)


def test_async_engine_refuses_a_second_event_loop(llm, alone):
    loop, thread = _loop_in_thread()
    try:
        first = asyncio.run_coroutine_threadsafe(llm.agenerate(PROMPTS[0], GREEDY), loop).result(WAIT_S)
        assert first.token_ids == alone[PROMPTS[0]]
        # the first loop still runs: a request from another loop is refused, nothing queued
        with pytest.raises(ConcurrencyError, match="bound to one event loop") as info:
            asyncio.run(llm.agenerate(PROMPTS[1], GREEDY))
        assert isinstance(info.value, LlamajetError)
        assert not llm.engine.has_unfinished()
        # the first loop keeps working
        again = asyncio.run_coroutine_threadsafe(llm.agenerate(PROMPTS[1], GREEDY), loop).result(WAIT_S)
        assert again.token_ids == alone[PROMPTS[1]]
    finally:
        _close(loop, thread)
    # once that loop is closed, another may take over; loops one after another work
    assert asyncio.run(llm.agenerate(PROMPTS[2], GREEDY)).token_ids == alone[PROMPTS[2]]
    assert asyncio.run(llm.agenerate(PROMPTS[3], GREEDY)).token_ids == alone[PROMPTS[3]]
    assert_pool_idle(llm)
