"""`llamajet serve` through the official `openai` client and raw HTTP.

The default model (SmolLM2-135M-Instruct, it has a chat template) serves
chat, tools and structured output; stories260K (fp32) serves completions
whose logprobs are checked against transformers. Each server runs in this
process on a loopback port, so a test can look at the engine's block pool
after a client goes away; SIGTERM is tested on real subprocesses."""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from llamajet import LLM, SamplingParams

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from serverlib import LiveServer, spawn, idle as _idle, wait as _wait  # noqa: E402

M = "test-model"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smol(default_server):
    """The session's shared default-model server (conftest.py: context 1024, 8 sequences)."""
    return default_server


@pytest.fixture(scope="module")
def stories(stories_hf):
    srv = LiveServer(LLM(stories_hf, quantize="none", max_model_len=256, max_num_seqs=8,
                         enable_prefix_caching=False))
    yield srv
    srv.close()


# ---------------------------------------------------------------- chat and completions


def test_models_health_ready(smol):
    assert [m.id for m in smol.client().models.list().data] == [M]
    assert httpx.get(smol.url + "/health").status_code == 200
    assert httpx.get(smol.url + "/ready").status_code == 200


def test_chat_greedy_equals_llm_generate(smol):
    msgs = [{"role": "user", "content": "Name three colors."}]
    r = smol.client().chat.completions.create(model=M, messages=msgs, max_tokens=24, temperature=0)
    ids = httpx.post(smol.url + "/tokenize", json={"messages": msgs}).json()["tokens"]
    assert ids == smol.llm.chat_ids(msgs)
    ref = smol.llm.generate([ids], SamplingParams(max_tokens=24, temperature=0))[0]
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref.token_ids)
    assert r.id.startswith("chatcmpl-") and r.system_fingerprint


def test_chat_stream_one_token_per_chunk_and_usage(smol):
    msgs = [{"role": "user", "content": "Write one sentence about the sea."}]
    c = smol.client()
    whole = c.chat.completions.create(model=M, messages=msgs, max_tokens=20, temperature=0)
    chunks = list(c.chat.completions.create(model=M, messages=msgs, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    content_chunks = [ch for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(content_chunks) <= whole.usage.completion_tokens  # never several tokens' text in one chunk ...
    assert len(content_chunks) >= whole.usage.completion_tokens - 2  # ... and no batching of tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    # the same prompt again: its blocks come from the prefix cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_completions_token_ids_and_string_prompts(smol):
    c = smol.client()
    ids = smol.llm.tokenizer.encode("The capital of France is")
    r = c.completions.create(model=M, prompt=ids, max_tokens=8, temperature=0)
    ref = smol.llm.generate([ids], SamplingParams(max_tokens=8, temperature=0))[0]
    assert r.choices[0].text == ref.text
    r2 = c.completions.create(model=M, prompt=["The capital of France is", "One, two,"], max_tokens=8,
                              temperature=0)
    assert [ch.index for ch in r2.choices] == [0, 1] and r2.choices[0].text == ref.text
    streamed = list(c.completions.create(model=M, prompt="The capital of France is", max_tokens=8,
                                         temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == ref.text


def test_n_choices_share_the_prompt(smol):
    c = smol.client()
    r = c.chat.completions.create(model=M, messages=[{"role": "user", "content": "Tell me a story."}],
                                  max_tokens=12, temperature=1.0, seed=5, n=3)
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2]
    assert len({ch.message.content for ch in r.choices}) > 1
    # the prompt was computed once for the three (reference counts: tests/test_choices.py)
    assert r.usage.completion_tokens == 36 or r.usage.completion_tokens < 36  # stop tokens may end one early
    s = list(c.chat.completions.create(model=M, messages=[{"role": "user", "content": "Tell me a story."}],
                                       max_tokens=12, temperature=1.0, seed=5, n=3, stream=True))
    for i in range(3):
        text = "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices and ch.choices[0].index == i)
        assert text == r.choices[i].message.content  # same seed, same choices, streamed or not
    assert _wait(lambda: _idle(smol))


def test_seed_reproducible(smol):
    c = smol.client()
    kw = dict(model=M, messages=[{"role": "user", "content": "Say something."}], max_tokens=16, temperature=1.0)
    a = c.chat.completions.create(seed=42, **kw).choices[0].message.content
    b = c.chat.completions.create(seed=42, **kw).choices[0].message.content
    d = c.chat.completions.create(seed=43, **kw).choices[0].message.content
    assert a == b and a != d


def test_stop_strings_across_token_boundaries(smol):
    c = smol.client()
    kw = dict(model=M, prompt="The history of Rome begins", max_tokens=24, temperature=0)
    full = c.completions.create(**kw).choices[0].text
    # a stop string that starts inside one token and ends inside another
    toks = smol.llm.tokenizer.encode(full, add_special_tokens=False)
    pieces = [smol.llm.tokenizer.decode([t]) for t in toks]
    k = next(i for i in range(2, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    start = sum(len(p) for p in pieces[:k]) + 1
    stop = full[start:start + len(pieces[k])]
    assert stop and stop not in pieces
    cut = full.index(stop)
    r = c.completions.create(stop=[stop], **kw)
    assert r.choices[0].text == full[:cut] and r.choices[0].finish_reason == "stop"
    streamed = list(c.completions.create(stop=[stop], stream=True, **kw))
    assert "".join(ch.choices[0].text for ch in streamed) == full[:cut]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_multibyte_text_streams_whole_characters(smol):
    c = smol.client()
    emoji = "🙂"
    bias = {str(t): 100 for t in smol.llm.tokenizer.encode(emoji, add_special_tokens=False)}
    assert len(bias) >= 2  # one character over several byte tokens
    chunks = list(c.completions.create(model=M, prompt="Smile:", max_tokens=6, temperature=0, logit_bias=bias,
                                       stream=True))
    texts = [ch.choices[0].text for ch in chunks if ch.choices[0].text]
    assert all("\ufffd" not in t for t in texts)
    assert emoji in "".join(texts)


def test_logprobs_vs_transformers(stories, stories_hf):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    ids = stories.llm.tokenizer.encode("Once upon a time, there was a")
    r = stories.client().completions.create(model=M, prompt=ids, max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    out = stories.llm.generate([ids], SamplingParams(max_tokens=6, temperature=0))[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(stories_hf, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids + out])).logits[0].double(), -1).numpy()
    assert len(lp.token_logprobs) == len(out)
    for k, t in enumerate(out):
        assert lp.token_logprobs[k] == pytest.approx(ref[len(ids) - 1 + k, t], abs=1e-3)  # fp32 vs fp32
        assert len(lp.top_logprobs[k]) == 3
        assert max(lp.top_logprobs[k].values()) == pytest.approx(lp.token_logprobs[k])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # chat-style logprobs on the same server's completions stream
    s = list(stories.client().completions.create(model=M, prompt=ids, max_tokens=6, temperature=0, logprobs=0,
                                                 stream=True))
    got = [x for ch in s for x in (ch.choices[0].logprobs.token_logprobs if ch.choices[0].logprobs else [])]
    np.testing.assert_allclose(got, lp.token_logprobs, atol=1e-9)


def test_completions_echo_returns_the_prompts_own_logprobs(smol):
    """vLLM's shape: the prompt's tokens first (the first logprob null), their
    top alternatives with the prompt's token among them, then the generated
    ones; max_tokens 0 scores only; batches and token-id prompts."""
    llm = smol.llm
    ids = llm.tokenizer.encode("The cat sat on the mat and looked at the")
    ls = llm.logits(ids).astype(np.float64)
    ls = ls - ls.max(1, keepdims=True)
    ls = ls - np.log(np.exp(ls).sum(1, keepdims=True))
    u = smol.url + "/v1/completions"
    body = {"model": M, "prompt": [ids, ids[:4]], "echo": True, "logprobs": 2, "max_tokens": 0}
    r = httpx.post(u, json=body).json()
    first, second = r["choices"]
    lp = first["logprobs"]
    assert first["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 0
    assert r["usage"]["prompt_tokens"] == len(ids) + 4
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for p in range(1, len(ids)):
        assert abs(lp["token_logprobs"][p] - ls[p - 1, ids[p]]) <= 1e-4
        top = lp["top_logprobs"][p]
        assert lp["tokens"][p] in top and 2 <= len(top) <= 3  # the top 2, and the prompt's own token
        assert max(top.values()) == pytest.approx(ls[p - 1].max(), abs=1e-4)
    assert second["logprobs"]["token_logprobs"][1:] == lp["token_logprobs"][1:4]  # batch-invariant rows
    assert first["text"] == llm.tokenizer.decode(ids, skip_special_tokens=False)
    # echo with generation: the prompt's entries, then the generated token's
    r = smol.client().completions.create(model=M, prompt="The cat sat on the", echo=True, logprobs=1,
                                         max_tokens=2, temperature=0)
    c = r.choices[0]
    n = len(llm.tokenizer.encode("The cat sat on the"))
    assert c.text.startswith("The cat sat on the") and len(c.logprobs.tokens) == n + 2
    assert c.logprobs.token_logprobs[0] is None and all(x is not None for x in c.logprobs.token_logprobs[1:])
    assert c.logprobs.text_offset == sorted(c.logprobs.text_offset)
    # streamed: the echo comes first, then one chunk per token
    chunks = list(smol.client().completions.create(model=M, prompt="The cat sat on the", echo=True, logprobs=0,
                                                   max_tokens=3, temperature=0, stream=True))
    assert chunks[0].choices[0].text == "The cat sat on the"
    whole = smol.client().completions.create(model=M, prompt="The cat sat on the", echo=True, max_tokens=3,
                                             temperature=0).choices[0].text
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole
    # scoring needs echo; prompt_logprobs are never taken from the prefix cache (it computes no logits)
    _err(httpx.post(u, json={"model": M, "prompt": "x", "max_tokens": 0}), 400, "max_tokens")
    assert _wait(lambda: _idle(smol))


def test_chat_logprobs(smol):
    r = smol.client().chat.completions.create(model=M, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(bytes(e.bytes).decode("utf-8", "replace") for e in content) == r.choices[0].message.content
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == pytest.approx(e.logprob)


# ---------------------------------------------------------------- structured output and tools

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(smol, temperature):
    c = smol.client()
    for seed in range(2):
        r = c.chat.completions.create(
            model=M, messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=120,
            temperature=temperature, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_json_object_and_streamed_schema(smol):
    c = smol.client()
    r = c.chat.completions.create(
        model=M, messages=[{"role": "user", "content": "Give me a JSON object with a name and an age."}],
        max_tokens=80, temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"  # the grammar ended it: a whole object
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    s = list(c.chat.completions.create(
        model=M, messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=120,
        temperature=0.7, seed=1, stream=True, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}))
    for i in range(2):
        text = "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices and ch.choices[0].index == i)
        jsonschema.validate(json.loads(text), PERSON)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 30}}, "required": ["tz"]}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_tool_calls_are_well_formed(smol, choice):
    c = smol.client()
    r = c.chat.completions.create(model=M, messages=[{"role": "user", "content": "What's the weather in Paris?"}],
                                  tools=[WEATHER, TIME], tool_choice=choice, max_tokens=100, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    fn = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), fn["function"]["parameters"])
    assert call.id.startswith("call_") and call.type == "function"
    # streamed: the call arrives as one tool_calls delta, then [DONE]
    s = list(c.chat.completions.create(model=M, messages=[{"role": "user", "content": "Weather in Rome?"}],
                                       tools=[WEATHER, TIME], tool_choice=choice, max_tokens=100, temperature=0,
                                       stream=True))
    calls = [tc for x in s if x.choices for tc in (x.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and s[-1].choices[0].finish_reason == "tool_calls"
    json.loads(calls[0].function.arguments)
    # the call goes back in the history, with the tool's answer, and the chat continues
    msgs = [{"role": "user", "content": "What's the weather in Paris?"},
            {"role": "assistant", "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    r2 = c.chat.completions.create(model=M, messages=msgs, tools=[WEATHER, TIME], tool_choice="none", max_tokens=10)
    assert r2.choices[0].finish_reason in ("stop", "length") and r2.choices[0].message.tool_calls is None


# ---------------------------------------------------------------- errors and limits (raw HTTP)


def _err(r: httpx.Response, status: int, param: str | None = "-") -> dict:
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"]
    if param != "-":
        assert e["param"] == param
    return e


def test_bad_requests_get_openai_shaped_400s(smol):
    u = smol.url + "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    _err(httpx.post(u, content=b"{not json", headers={"content-type": "application/json"}), 400)
    _err(httpx.post(u, json={"model": M, "messages": msgs, "temperature": "hot"}), 400, "temperature")
    e = _err(httpx.post(u, json={"model": M, "messages": msgs, "functions": []}), 400, "functions")
    assert "not implement" in e["message"]  # refused, never silently dropped
    _err(httpx.post(u, json={"model": M, "messages": msgs, "n": 17}), 400, "n")
    _err(httpx.post(u, json={"model": M, "messages": msgs, "logprobs": True, "top_logprobs": 21}), 400,
         "top_logprobs")
    _err(httpx.post(u, json={"model": M, "messages": msgs, "stop": [str(i) for i in range(17)]}), 400, "stop")
    _err(httpx.post(u, json={"model": M, "messages": []}), 400, "messages")
    _err(httpx.post(u, json={"model": M, "messages": msgs, "logit_bias": {"99999999": 1}}), 400, "logit_bias")
    _err(httpx.post(u, json={"model": M, "messages": msgs, "tool_choice": "required"}), 400, "tool_choice")
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100}
                                            for i in range(800)}}
    _err(httpx.post(u, json={"model": M, "messages": msgs,
                             "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": big}}}),
         400, "response_format")
    _err(httpx.post(smol.url + "/v1/completions", json={"model": M, "prompt": "x", "best_of": 3}), 400, "best_of")
    e = _err(httpx.post(u, json={"model": "gpt-4", "messages": msgs}), 404, "model")
    assert "gpt-4" in e["message"]
    assert _wait(lambda: _idle(smol))


def test_unknown_paths_answer_404_in_their_api_family(smol):
    r = httpx.get(smol.url + "/v1/nope")
    e = _err(r, 404, None)  # OpenAI's shape, not FastAPI's {"detail": ...}
    assert "/v1/nope" in e["message"]
    for r in (httpx.post(smol.url + "/v1/messages/nope", json={}),
              httpx.get(smol.url + "/v2/anything", headers={"anthropic-version": "2023-06-01"})):
        assert r.status_code == 404
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error", r.text
    r = httpx.get(smol.url + "/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    # route labels come from the app's routes (counted once the response is sent: poll)
    assert _wait(lambda: 'route="/v1/chat/completions",status="405"' in httpx.get(smol.url + "/metrics").text)
    assert 'route="other",status="404"' in httpx.get(smol.url + "/metrics").text


def test_an_engine_failure_is_a_500_and_the_connection_stays_usable(stories_hf):
    srv = LiveServer(LLM(stories_hf, max_model_len=256))
    runner = srv.llm.engine.runner
    real = runner.run
    calls = {"n": 0}

    def failing_once(*a, **k):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected forward failure")
        return real(*a, **k)

    runner.run = failing_once
    body = {"model": M, "prompt": "Once upon a time", "max_tokens": 4}
    try:
        with httpx.Client(timeout=60) as c:  # one connection for both requests
            r = c.post(srv.url + "/v1/completions", json=body)
            assert r.status_code == 500 and "injected forward failure" in r.json()["error"]["message"]
            r = c.post(srv.url + "/v1/completions", json=body)  # the same connection: not reset
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert _wait(lambda: _idle(srv))
    finally:
        srv.close()


def test_context_overflow_names_both_numbers(smol):
    ids = [1] * 1000
    r = httpx.post(smol.url + "/v1/completions", json={"model": M, "prompt": ids, "max_tokens": 100})
    e = _err(r, 400, "max_tokens")
    assert "1000" in e["message"] and "100" in e["message"] and "1024" in e["message"]
    r = httpx.post(smol.url + "/v1/completions", json={"model": M, "prompt": [1] * 1024})
    e = _err(r, 400)
    assert "1024" in e["message"]
    with pytest.raises(openai.BadRequestError):
        smol.client().completions.create(model=M, prompt=ids, max_tokens=100)


def test_body_over_the_limit_is_413(stories_hf):
    srv = LiveServer(LLM(stories_hf, max_model_len=128), max_body_bytes=2000)
    try:
        _err(httpx.post(srv.url + "/v1/completions", json={"model": M, "prompt": "x" * 5000}), 413)

        def chunked():  # no content-length: counted as it arrives
            yield b'{"model": "test-model", "prompt": "'
            for _ in range(10):
                yield b"x" * 500
            yield b'"}'

        _err(httpx.post(srv.url + "/v1/completions", content=chunked(),
                        headers={"content-type": "application/json"}), 413)
        assert httpx.post(srv.url + "/v1/completions", json={"model": M, "prompt": "Once", "max_tokens": 2}
                          ).status_code == 200
    finally:
        srv.close()


def test_api_key_guards_v1_but_not_health(stories_hf):
    srv = LiveServer(LLM(stories_hf, max_model_len=128), api_key="sekret")
    try:
        for path in ("/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize"):
            _err(httpx.post(srv.url + path, json={}) if path != "/v1/models" else httpx.get(srv.url + path), 401)
        _err(httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        assert httpx.get(srv.url + "/health").status_code == 200
        assert httpx.get(srv.url + "/ready").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            srv.client(api_key="wrong").models.list()
        r = srv.client(api_key="sekret").completions.create(model=M, prompt="Once", max_tokens=3)
        assert r.choices[0].text
    finally:
        srv.close()


def test_full_queue_is_429_with_retry_after(stories_hf):
    # The first request must still be running when the third arrives: 500 tokens of slowed steps
    # (closing its stream below ends it); unslowed, it once finished first and the third was admitted.
    srv = LiveServer(LLM(stories_hf, max_model_len=512, max_num_seqs=1), max_queued_requests=2)
    long = {"model": M, "prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True, "stream": True}
    eng = srv.llm.engine
    step = eng.step

    def slow_step():  # >= 2.5 s for the first stream's 500 steps, however busy or quiet the machine
        time.sleep(0.005)
        return step()

    eng.step = slow_step
    try:
        with httpx.Client(timeout=60) as c1:
            threads = []
            with c1.stream("POST", srv.url + "/v1/completions", json=long) as r1:
                it = r1.iter_lines()
                next(it)  # the first runs (max_num_seqs=1) ...
                for _ in range(2):  # ... two wait
                    t = threading.Thread(target=lambda: httpx.post(srv.url + "/v1/completions", timeout=120,
                                                                   json={**long, "stream": False, "max_tokens": 5}))
                    t.start()
                    threads.append(t)
                assert _wait(lambda: srv.metric("llamajet:num_requests_waiting") == 2)
                r = httpx.post(srv.url + "/v1/completions", json={**long, "stream": False})
                _err(r, 429)
                assert r.headers["retry-after"] == "1"
                with pytest.raises(openai.RateLimitError):
                    srv.client().completions.create(model=M, prompt="x", max_tokens=2)
            for t in threads:
                t.join(120)
        assert _wait(lambda: _idle(srv))
    finally:
        srv.close()


def test_disconnect_mid_stream_frees_the_sequence(smol):
    eng = smol.llm.engine
    before = eng.stats.generated
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", smol.url + "/v1/completions",
                      json={"model": M, "prompt": "Count: one, two,", "max_tokens": 500, "ignore_eos": True,
                            "stream": True}) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert all(g.startswith("data: ") or g == "" for g in got)
            assert srv_running(smol) == 1
    # closed mid-stream: the next step aborts it and its blocks go back
    assert _wait(lambda: _idle(smol))
    assert eng.stats.generated - before < 500
    assert smol.llm.engine.scheduler.running == [] and not smol.llm.engine.scheduler.waiting


def srv_running(srv) -> float:
    return srv.metric("llamajet:num_requests_running")


def test_disconnect_before_the_first_token_cancels_the_waiting_request(smollm2_gguf):
    srv = LiveServer(LLM(smollm2_gguf, max_model_len=2048, max_num_seqs=1))
    eng = srv.llm.engine
    try:
        with httpx.Client(timeout=60) as c1, c1.stream(
                "POST", srv.url + "/v1/completions",
                json={"model": M, "prompt": "Once", "max_tokens": 500, "ignore_eos": True, "stream": True}) as r1:
            lines = r1.iter_lines()  # (kept: a dropped iterator closes the stream)
            next(lines)
            base_tokens, base_generated = eng.stats.tokens, eng.stats.generated
            # A non-streamed request queued behind it (max_num_seqs=1); its client goes away once the
            # server counts it waiting, before any token (a raw socket: the test, not a timer, disconnects).
            body = json.dumps({"model": M, "prompt": "The cat sat on", "max_tokens": 50}).encode()
            c2 = socket.create_connection(("127.0.0.1", srv.port))
            c2.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            assert _wait(lambda: srv.metric("llamajet:num_requests_waiting") == 1)
            c2.close()
            assert _wait(lambda: srv.metric("llamajet:num_requests_waiting") == 0)  # gone from the queue ...
            assert srv.metric("llamajet:num_requests_running") == 1  # ... while the first still runs
        assert _wait(lambda: _idle(srv))
        # Every step since computed one decode token of the first request: the second never ran (its
        # prompt would have added 4 computed tokens that sample only once). The base was read while a
        # step may have been between its two counter updates: that shifts the difference by one either way.
        extra = (eng.stats.tokens - base_tokens) - (eng.stats.generated - base_generated)
        assert abs(extra) <= 1, extra
        assert len(srv.llm.tokenizer.encode("The cat sat on")) >= 4
        assert eng.stats.generated - base_generated < 2000
    finally:
        srv.close()


# ---------------------------------------------------------------- metrics


def test_metrics_cover_what_deploy_uses(smol):
    smol.client().completions.create(model=M, prompt="Hello", max_tokens=3)
    text = httpx.get(smol.url + "/metrics").text
    exposed = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    for name in ("llamajet:num_requests_running", "llamajet:num_requests_waiting", "llamajet:kv_cache_usage_perc",
                 "llamajet:prefix_cache_queries_total", "llamajet:prefix_cache_hits_total",
                 "llamajet:prompt_tokens_total", "llamajet:generation_tokens_total",
                 "llamajet:request_success_total", "llamajet:num_preemptions_total",
                 "llamajet:time_to_first_token_seconds_bucket", "llamajet:inter_token_latency_seconds_bucket",
                 "llamajet:e2e_request_latency_seconds_bucket", "llamajet:request_queue_time_seconds_bucket",
                 "llamajet:http_requests_total", "llamajet:thread_idle_fraction"):
        assert name in exposed, name
    # the steps of that request: the share of thread time spent waiting, a fraction
    assert 0.0 <= srv_metric_labelled(text, "llamajet:thread_idle_fraction", "") <= 1.0
    used = set()
    for f in (ROOT / "deploy").rglob("*"):
        if f.is_file() and f.suffix in (".yaml", ".yml", ".json"):
            used |= set(re.findall(r"llamajet:[a-z][a-z0-9_]*", f.read_text()))
    assert used, "deploy/ uses no llamajet metric"
    for name in used:  # series names, or a histogram's family name in prose
        assert name in exposed or name + "_bucket" in exposed, f"deploy/ uses {name}, which /metrics does not expose"
    assert srv_metric_labelled(text, "llamajet:request_success_total", 'finished_reason="length"') >= 1
    assert srv_metric_labelled(text, "llamajet:generation_tokens_total", "") >= 3


def srv_metric_labelled(text: str, name: str, label: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_tokenize_detokenize_round_trip_vs_hf_tokenizers(smol):
    from tokenizers import Tokenizer

    text = "Grüße, 世界! 🙂"
    r = httpx.post(smol.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    ref = smol.llm.tokenizer.backend  # HF tokenizers' own encoder
    assert isinstance(ref, Tokenizer) and r["tokens"] == ref.encode(text, add_special_tokens=False).ids
    back = httpx.post(smol.url + "/detokenize", json={"tokens": r["tokens"]}).json()["prompt"]
    assert back == text
    _err(httpx.post(smol.url + "/detokenize", json={"tokens": [10 ** 9]}), 400, "tokens")


# ---------------------------------------------------------------- SIGTERM (real processes)


def _stream_all(url: str, out: list, i: int, max_tokens: int) -> None:
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": f"Story {i}:"}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
            lines = [ln for ln in r.iter_lines() if ln]
        chunks = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
        out[i] = {"status": r.status_code, "done": lines[-1] == "data: [DONE]",
                  "finish": [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1],
                  "tokens": [c["usage"]["completion_tokens"] for c in chunks if c.get("usage")]}
    except Exception as e:  # noqa: BLE001 - recorded for the assertion
        out[i] = {"error": repr(e)}


def _streams_then_sigterm(proc, url: str, n: int, max_tokens: int) -> tuple[list, list]:
    """n streaming chat requests in threads; SIGTERM once all n run. Returns their results (filled
    in as they end) and the threads."""
    out: list = [None] * n
    threads = [threading.Thread(target=_stream_all, args=(url, out, i, max_tokens)) for i in range(n)]
    for t in threads:
        t.start()
    assert _wait(lambda: _metric(url, "llamajet:num_requests_running") == n, 60)
    proc.send_signal(signal.SIGTERM)
    return out, threads


def test_sigterm_drains_in_flight_streams_and_exits_0(smollm2_gguf):
    proc, url = spawn("--drain-timeout", "60", "--max-model-len", "512")
    try:
        out, threads = _streams_then_sigterm(proc, url, 8, 40)
        assert _wait(lambda: httpx.get(url + "/ready").status_code == 503)  # stops admitting at once
        r = httpx.post(url + "/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
        for t in threads:
            t.join(120)
        assert proc.wait(60) == 0
        for o in out:
            assert o.get("status") == 200 and o["done"] and o["finish"] == "length", o
            assert o["tokens"] == [40]  # ran to the end
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_log_has_a_banner_access_lines_and_the_drain(smollm2_gguf):
    proc, url = spawn("--max-model-len", "512", "--log-level", "info")
    try:
        body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 5, "ignore_eos": True}
        usage = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()["usage"]
        with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
            list(r.iter_lines())
        httpx.post(url + "/v1/chat/completions", json={**body, "temperature": 9})
        httpx.get(url + "/metrics")  # scrapes and probes are not logged
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        log = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    banner = next(ln for ln in log.splitlines() if "serving 'SmolLM2-135M-Instruct'" in ln)
    for part in ("llama", "weights ", "context 512 tokens", "usable cores", "isa ", "KV pool ", "tokens ("):
        assert part in banner, (part, banner)
    access = [ln for ln in log.splitlines() if " /v1/chat/completions " in ln]
    assert len(access) == 3, log
    want = f"prompt_tokens={usage['prompt_tokens']} completion_tokens=5"
    assert want in access[0] and want in access[1] and " 200 " in access[0]
    assert re.search(r"ttft=\d+\.\d{3}s duration=\d+\.\d{3}s", access[1])  # the format, never the time
    assert " 400 " in access[2] and "completion_tokens=-" in access[2]
    assert "/metrics" not in log
    assert "drain: started" in log and "drain: done" in log


def test_drain_timeout_ends_streams_with_a_last_chunk(smollm2_gguf):
    proc, url = spawn("--drain-timeout", "1", "--max-model-len", "4096")
    try:
        out, threads = _streams_then_sigterm(proc, url, 3, 3000)
        for t in threads:
            t.join(60)
        assert proc.wait(30) == 0
        for o in out:
            assert o.get("status") == 200 and o["done"] and o["finish"] == "abort", o
    finally:
        if proc.poll() is None:
            proc.kill()


def _metric(url: str, name: str) -> float:
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return -1
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return -1


def test_default_threads_honour_the_cgroup_quota(tmp_path):
    from llamajet.ops.dispatch import cgroup_cpu_limit, default_threads, physical_cores

    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(str(tmp_path)) == 1.5
    assert default_threads(str(tmp_path)) == min(physical_cores(), 2)
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(str(tmp_path)) is None and default_threads(str(tmp_path)) == physical_cores()
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert default_threads(str(tmp_path)) == 1


def test_cgroup_quota_is_read_from_this_process_child_cgroup(tmp_path):
    """The quota comes from the cgroup /proc/self/cgroup names and its
    ancestors (the tightest wins), not only the hierarchy's root."""
    from llamajet.ops.dispatch import cgroup_cpu_limit, default_threads, physical_cores

    proc = tmp_path / "cgroup"
    # v2: root unlimited, the child limited to 1.5 CPUs, a grandchild unlimited
    (tmp_path / "v2" / "kube" / "pod1").mkdir(parents=True)
    (tmp_path / "v2" / "cpu.max").write_text("max 100000\n")
    (tmp_path / "v2" / "kube" / "cpu.max").write_text("150000 100000\n")
    (tmp_path / "v2" / "kube" / "pod1" / "cpu.max").write_text("max 100000\n")
    proc.write_text("0::/kube/pod1\n")
    assert cgroup_cpu_limit(str(tmp_path / "v2"), str(proc)) == 1.5
    assert default_threads(str(tmp_path / "v2"), str(proc)) == min(physical_cores(), 2)
    # the same tree with this process at the root: unlimited
    proc.write_text("0::/\n")
    assert cgroup_cpu_limit(str(tmp_path / "v2"), str(proc)) is None
    # v1: the cpu controller mounted as cpu,cpuacct; the child's own quota is the tightest
    d = tmp_path / "v1" / "cpu,cpuacct" / "job"
    d.mkdir(parents=True)
    (d.parent / "cpu.cfs_quota_us").write_text("-1\n")
    (d.parent / "cpu.cfs_period_us").write_text("100000\n")
    (d / "cpu.cfs_quota_us").write_text("50000\n")
    (d / "cpu.cfs_period_us").write_text("100000\n")
    proc.write_text("4:memory:/other\n3:cpu,cpuacct:/job\n0::/\n")
    assert cgroup_cpu_limit(str(tmp_path / "v1"), str(proc)) == 0.5
    assert default_threads(str(tmp_path / "v1"), str(proc)) == 1
    # unreadable /proc file: the root alone is looked at
    assert cgroup_cpu_limit(str(tmp_path / "v2"), str(tmp_path / "missing")) is None


def test_hermes_tool_calls_on_a_qwen2_template(tmp_path, qwen25_tokenizer_dir):
    """Qwen2.5's template shows the tools itself and wants <tool_call>...</tool_call>: the grammar
    writes that format and the parser reads it back (a random-weight Qwen2 of the real vocabulary)."""
    import shutil

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from llamajet.server import tools as toolmod

    cfg = transformers.Qwen2Config(
        vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=151643,
        eos_token_id=151645)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        shutil.copy(qwen25_tokenizer_dir / f, tmp_path / f)
    llm = LLM(tmp_path, max_model_len=512)
    assert toolmod.call_format(llm.tokenizer.chat_template) == "hermes"
    assert toolmod.template_shows_tools(llm.tokenizer.chat_template)
    city = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "days": {"enum": [1, 2, 3]}},
        "required": ["city", "days"]}}}
    srv = LiveServer(llm)
    try:
        for seed in range(3):
            r = srv.client().chat.completions.create(
                model=M, messages=[{"role": "user", "content": "Pick a city."}], tools=[city],
                tool_choice="required", max_tokens=80, temperature=1.0, seed=seed)
            ch = r.choices[0]
            assert ch.finish_reason == "tool_calls", ch
            (call,) = ch.message.tool_calls
            assert call.function.name == "pick"
            jsonschema.validate(json.loads(call.function.arguments), city["function"]["parameters"])
    finally:
        srv.close()
    text = '<tool_call>\n{"name": "pick", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>'
    (c,) = toolmod.parse_calls(text, {"pick"})
    assert json.loads(c["function"]["arguments"]) == {"city": "Rome", "days": 2}
    assert toolmod.parse_calls('{"name": "other", "parameters": {}}', {"pick"}) is None
    assert toolmod.parse_calls("<|python_tag|>" + '{"name": "pick", "parameters": {"city": "Oslo"}}', {"pick"})
