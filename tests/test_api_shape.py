"""The Python API in vLLM's shape: RequestOutput.outputs holds the n
completions (text, token ids, cumulative logprob, per-token logprobs, finish
reason), compared with what the same request returns from the server's
completions route through the official `openai` client; `chat` takes one
conversation or several; every public entry point refuses a bad argument
with a RequestError that names it."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from llamajet import LLM, CompletionOutput, RequestError, RequestOutput, SamplingParams

openai = pytest.importorskip("openai")

M = "test-model"


@pytest.fixture(scope="module")
def srv(default_server):
    """The session's shared default-model server (conftest.py: context 1024, 8 sequences)."""
    return default_server


@pytest.fixture(scope="module")
def stories(stories_hf):
    return LLM(stories_hf, max_model_len=128)


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.9, 7)])
def test_n_completions_with_logprobs_equal_the_completions_route(srv, temperature, seed):
    llm = srv.llm
    prompt = "Once upon a time, in a small village,"
    out = llm.generate(prompt, SamplingParams(n=3, max_tokens=10, temperature=temperature, seed=seed,
                                              logprobs=2))
    assert len(out) == 1 and isinstance(out[0], RequestOutput)
    r = out[0]
    assert [c.index for c in r.outputs] == [0, 1, 2] and all(isinstance(c, CompletionOutput) for c in r.outputs)
    assert r.prompt == prompt and r.prompt_token_ids == llm.tokenizer.encode(prompt)
    assert (r.text, r.token_ids, r.finish_reason) == (r.outputs[0].text, r.outputs[0].token_ids,
                                                      r.outputs[0].finish_reason)
    got = srv.client().completions.create(model=M, prompt=prompt, n=3, max_tokens=10, temperature=temperature,
                                          seed=seed, logprobs=2)
    assert len(got.choices) == 3
    for c, s in zip(r.outputs, sorted(got.choices, key=lambda x: x.index)):
        assert c.text == s.text and c.finish_reason == s.finish_reason
        assert len(c.token_ids) == len(c.logprobs) == len(s.logprobs.tokens)
        for tid, lps, lp_route, top_route in zip(c.token_ids, c.logprobs, s.logprobs.token_logprobs,
                                                 s.logprobs.top_logprobs):
            assert lps[tid].logprob == pytest.approx(lp_route, abs=1e-6)
            top = sorted((v for v in lps.values() if v.rank is not None), key=lambda v: v.rank)
            assert [v.rank for v in top] == [1, 2]
            assert {v.decoded_token: v.logprob for v in top} == pytest.approx(top_route, abs=1e-6)
        assert c.cumulative_logprob == pytest.approx(sum(s.logprobs.token_logprobs), abs=1e-4)
    if temperature == 0:  # greedy: every completion is the same, and its tokens are the top-1
        assert len({c.text for c in r.outputs}) == 1
        assert all(lps[t].rank == 1 for t, lps in zip(r.outputs[0].token_ids, r.outputs[0].logprobs))
    else:  # seeded: the three differ, and the same request repeats them
        assert len({c.text for c in r.outputs}) > 1
        again = llm.generate(prompt, SamplingParams(n=3, max_tokens=10, temperature=temperature, seed=seed,
                                                    logprobs=2))[0]
        assert [c.token_ids for c in again.outputs] == [c.token_ids for c in r.outputs]


def test_without_logprobs_there_are_none(stories):
    r = stories.generate("Once upon a time", SamplingParams(n=2, max_tokens=5, temperature=0.8, seed=1))[0]
    assert len(r.outputs) == 2
    assert all(c.logprobs is None and c.cumulative_logprob is None for c in r.outputs)
    assert all(len(c.token_ids) == 5 and c.finish_reason == "length" for c in r.outputs)


def test_prompt_logprobs_are_the_prompts(stories):
    ids = stories.tokenizer.encode("Once upon a time there was a cat")
    r = stories.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(ids)
    logits = stories.logits(ids).astype(np.float64)
    for p in range(1, len(ids)):
        row = logits[p - 1]
        ref = row[ids[p]] - row.max() - math.log(np.exp(row - row.max()).sum())
        assert r.prompt_logprobs[p][ids[p]].logprob == pytest.approx(ref, abs=1e-4)


def test_several_prompts_and_params_keep_their_order(stories):
    outs = stories.generate(["Once upon a time", "The dog"], [SamplingParams(max_tokens=3, temperature=0),
                                                              SamplingParams(max_tokens=5, temperature=0)])
    assert [len(o.token_ids) for o in outs] == [3, 5] and [o.prompt for o in outs] == ["Once upon a time", "The dog"]


def test_agenerate_has_the_same_shape(stories):
    p = SamplingParams(n=2, max_tokens=6, temperature=0.8, seed=3, logprobs=1)
    a = asyncio.run(stories.agenerate("Once upon a time", p))
    b = stories.generate("Once upon a time", p)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert [c.cumulative_logprob for c in a.outputs] == [c.cumulative_logprob for c in b.outputs]


def test_chat_takes_one_conversation_or_several(srv):
    llm = srv.llm
    a = [{"role": "user", "content": "Name the capital of France."}]
    b = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    p = SamplingParams(max_tokens=12, temperature=0)
    one = llm.chat(a, p)
    assert isinstance(one, list) and len(one) == 1
    both = llm.chat([a, b], p)
    assert [o.text for o in both] == [one[0].text, llm.chat(b, p)[0].text]
    assert both[1].prompt_token_ids == llm.chat_ids(b)
    # the same conversation through the server's chat route
    r = srv.client().chat.completions.create(model=M, messages=b, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == both[1].text


# ---------------------------------------------------------------- bad arguments, at every entry point


@pytest.mark.parametrize("call, match", [
    (lambda l: l.generate(None), "prompts: expected"),
    (lambda l: l.generate(42), "prompts: expected"),
    (lambda l: l.generate([]), "prompts: empty"),
    (lambda l: l.generate(["ok", None]), r"prompts\[1\]: expected a str or a list of token ids, got NoneType"),
    (lambda l: l.generate([[1, 2.5]]), r"prompts\[0\]\[1\]: token ids must be integers, got float"),
    (lambda l: l.generate([[1, True]]), r"prompts\[0\]\[1\]: token ids must be integers, got bool"),
    (lambda l: l.generate("hi", {"max_tokens": 3}), r"params: expected a SamplingParams .*got dict.*SamplingParams\(\*\*d\)"),
    (lambda l: l.generate(["a", "b"], [SamplingParams()]), "params: 1 SamplingParams for 2 prompts"),
    (lambda l: l.generate("hi", "greedy"), "params: expected a SamplingParams"),
    (lambda l: l.stream(None), "prompt: expected a str or a list of token ids"),
    (lambda l: l.stream("hi", {"temperature": 0}), "params: expected a SamplingParams"),
    (lambda l: asyncio.run(l.agenerate(3.0)), "prompt: expected a str or a list of token ids"),
    (lambda l: asyncio.run(l.agenerate("hi", 1)), "params: expected a SamplingParams"),
    (lambda l: l.chat("hello"), "messages: expected a list of .* got str .*a str is one message"),
    (lambda l: l.chat([]), "messages: empty conversation"),
    (lambda l: l.chat([{"role": "robot", "content": "beep"}]), r"messages\[0\]: role 'robot' is not one of system, user"),
    (lambda l: l.chat([{"content": "no role"}]), r"messages\[0\]: role None is not one of"),
    (lambda l: l.chat(["hello"]), r"messages\[0\]: expected a dict"),
    (lambda l: l.chat([{"role": "user", "content": 5}]), r"messages\[0\]: content must be a str, got int"),
    (lambda l: l.chat([[{"role": "user", "content": "ok"}], [{"role": "bot", "content": "x"}]]),
     r"messages\[1\]\[0\]: role 'bot'"),
    (lambda l: l.chat([{"role": "user", "content": "hi"}], {"max_tokens": 1}), "params: expected a SamplingParams"),
    (lambda l: l.chat([{"role": "user", "content": "hi"}], add_generation_prompt="yes"), "add_generation_prompt"),
    (lambda l: l.chat_ids({"role": "user", "content": "hi"}), "messages: expected a list .* got dict"),
    (lambda l: l.logits("Hello"), r"token_ids: expected a list of token ids, got str .*tokenizer.encode"),
    (lambda l: l.logits([1, "a"]), r"token_ids\[1\]: token ids must be integers, got str"),
    (lambda l: l.logits(None), "token_ids: expected a list of token ids, got NoneType"),
])
def test_bad_arguments_are_request_errors_naming_them(stories, call, match):
    with pytest.raises(RequestError, match=match):
        call(stories)
    # nothing half-done: the engine holds no request and no block afterwards
    assert not stories.engine.scheduler.running and not stories.engine.scheduler.waiting
    assert stories.engine.blocks.num_used == 0


def test_template_raise_exception_is_a_request_error(stories_hf):
    llm = LLM(stories_hf, max_model_len=64)
    llm.tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                                   "{{ raise_exception('System role not supported') }}{% endif %}"
                                   "{{ m['content'] }}{% endfor %}")
    with pytest.raises(RequestError, match="chat template refused these messages: System role not supported"):
        llm.chat([{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}])
    assert llm.chat([{"role": "user", "content": "Once upon a time"}],
                    SamplingParams(max_tokens=2, temperature=0))[0].finish_reason == "length"
