"""`/v1/messages` and `/v1/messages/count_tokens` through the official
`anthropic` SDK (max_retries=0), against real servers on loopback.

The default model (SmolLM2-135M-Instruct, a chat template, tools described
in a system message) answers text, tool calls and structured output; a
second server with an API key, a small body limit, one sequence at a time
and a one-request queue gives the 401, 413, 429, 500 and 529 answers; a
third never finishes loading (529). This SDK version has no temperature /
top_p / top_k arguments (the API still takes them): they go in extra_body.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from llamajet import LLM

anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

from serverlib import LiveServer, idle as _idle, wait as _wait  # noqa: E402

from llamajet.server.routes.anthropic import reply_parts, surely_text  # noqa: E402
from llamajet.server.serving import ChatPlan  # noqa: E402

M = "test-model"
KEY = "sekret"
GREEDY = {"temperature": 0}
LONG = [{"role": "user", "content": "Write a very long story about a dragon."}]  # greedy: 900+ tokens


@pytest.fixture(scope="module")
def smol(default_server):
    """The session's shared default-model server (conftest.py: context 1024, 8 sequences)."""
    return default_server


@pytest.fixture(scope="module")
def strict(smollm2_gguf):
    """API key, 20 kB bodies, one sequence at a time, one request may wait."""
    srv = LiveServer(LLM(smollm2_gguf, max_model_len=1024, max_num_seqs=1), api_key=KEY, max_body_bytes=20_000,
                     max_queued_requests=1)
    yield srv
    srv.close()


def client(srv, key: str = "none", **kw):
    return anthropic.Anthropic(base_url=srv.url, api_key=key, max_retries=0, timeout=120, **kw)


def _error(e, status: int, kind: str) -> str:
    assert e.status_code == status, e
    assert e.body["type"] == "error" and e.body["error"]["type"] == kind, e.body
    return e.body["error"]["message"]


def _text(msg) -> str:
    return "".join(b.text for b in msg.content if b.type == "text")


WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"]}}
TIME = {"name": "get_time", "description": "Current time in a timezone",
        "input_schema": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 30}},
                         "required": ["tz"]}}


# ---------------------------------------------------------------- text


def test_create_greedy_equals_chat_completions(smol):
    pytest.importorskip("openai")
    msgs = [{"role": "user", "content": "Name three colors."}]
    r = client(smol).messages.create(model=M, max_tokens=24, messages=msgs, extra_body=GREEDY)
    ref = smol.client().chat.completions.create(model=M, messages=msgs, max_tokens=24, temperature=0)
    assert r.type == "message" and r.role == "assistant" and r.model == M and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == ref.choices[0].message.content
    assert r.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[ref.choices[0].finish_reason]
    assert r.stop_sequence is None
    assert r.usage.output_tokens == ref.usage.completion_tokens
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == ref.usage.prompt_tokens
    # a system prompt (string, or text blocks) is the template's system message
    sysmsg = [{"role": "system", "content": "You answer in French."}] + msgs
    ref = smol.client().chat.completions.create(model=M, messages=sysmsg, max_tokens=12, temperature=0)
    for system in ("You answer in French.", [{"type": "text", "text": "You answer in French."}]):
        r = client(smol).messages.create(model=M, max_tokens=12, system=system, messages=msgs, extra_body=GREEDY)
        assert _text(r) == ref.choices[0].message.content


def test_stream_one_text_delta_per_token(smol):
    c = client(smol)
    whole = c.messages.create(model=M, max_tokens=20, messages=LONG, extra_body=GREEDY)
    assert whole.stop_reason == "max_tokens"
    with c.messages.stream(model=M, max_tokens=20, messages=LONG, extra_body=GREEDY) as s:
        events = list(s)
        final = s.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and kinds[-2] == "message_delta"
    assert events[0].message.content == [] and events[0].message.usage.output_tokens == 0
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert all(e.delta.type == "text_delta" for e in events if e.type == "content_block_delta")
    assert "".join(deltas) == _text(final) == _text(whole)
    assert len(deltas) == final.usage.output_tokens == 20  # one per generated token
    assert final.stop_reason == "max_tokens" and final.stop_sequence is None
    # the same prompt again: its prefix comes from the cache, and usage says so (Anthropic's split)
    assert final.usage.cache_read_input_tokens > 0
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    # the raw stream: event names, a ping after message_start, blocks opened and closed
    lines = httpx.post(smol.url + "/v1/messages", json={"model": M, "max_tokens": 3, "messages": LONG,
                                                        "stream": True}).text.split("\n")
    names = [ln[7:] for ln in lines if ln.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_stop_sequences(smol):
    c = client(smol)
    kw = dict(model=M, max_tokens=30, messages=LONG, extra_body=GREEDY)
    full = _text(c.messages.create(**kw))
    words = [w for w in full.split() if w.isalpha() and len(w) >= 4]
    stop = words[3][1:]  # the middle of a word: stop strings need no token boundary
    r = c.messages.create(stop_sequences=["zzzz", stop], **kw)
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert _text(r) == full[:full.index(stop)]
    with c.messages.stream(stop_sequences=["zzzz", stop], **kw) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop and _text(final) == _text(r)
    # a stop sequence that never comes: the reply ends at the end of its turn or at max_tokens
    r = c.messages.create(stop_sequences=["qqqq"], **kw)
    assert r.stop_sequence is None and r.stop_reason in ("end_turn", "max_tokens") and _text(r) == full


# ---------------------------------------------------------------- tools


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_time"}])
def test_forced_tool_use_and_tool_result_round_trip(smol, choice):
    c = client(smol)
    ask = [{"role": "user", "content": "What's the weather in Paris?"}]
    r = c.messages.create(model=M, max_tokens=100, messages=ask, tools=[WEATHER, TIME], tool_choice=choice,
                          extra_body=GREEDY)
    assert r.stop_reason == "tool_use" and r.stop_sequence is None
    (call,) = r.content
    assert call.type == "tool_use" and call.id.startswith("toolu_")
    if choice["type"] == "tool":
        assert call.name == "get_time"
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.name]["input_schema"]
    jsonschema.validate(call.input, schema)
    # streamed: the call comes whole at its end, as one input_json_delta
    with c.messages.stream(model=M, max_tokens=100, messages=ask, tools=[WEATHER, TIME], tool_choice=choice,
                           extra_body=GREEDY) as s:
        events = list(s)
        final = s.get_final_message()
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert [d.type for d in deltas] == ["input_json_delta"]
    assert final.stop_reason == "tool_use" and final.content[0].name == call.name
    assert final.content[0].input == call.input == json.loads(deltas[0].partial_json)
    # the call and its result go back (the SDK's own content blocks), and a text answer comes
    history = ask + [{"role": "assistant", "content": r.content},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                   "content": [{"type": "text", "text": "18 C, sunny"}]}]}]
    r2 = c.messages.create(model=M, max_tokens=16, messages=history, tools=[WEATHER, TIME],
                           tool_choice={"type": "none"}, extra_body=GREEDY)
    assert [b.type for b in r2.content] == ["text"] and r2.content[0].text
    assert r2.stop_reason in ("end_turn", "max_tokens")
    # a tool_result that answers no tool_use is refused, naming it
    bad = ask + [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model=M, max_tokens=5, messages=bad, tools=[WEATHER])
    assert "tool_use_id" in _error(e.value, 400, "invalid_request_error")


def test_auto_tools_stream_equals_create(smol):
    """With tool_choice auto the reply is text or a call: streamed or not, the same content."""
    c = client(smol)
    # (greedy, the last one starts with "{": held to its end as a possible call, then text)
    for prompt in ("What's the weather in Paris?", "Say hello to me.", "Call get_weather for Paris."):
        kw = dict(model=M, max_tokens=60, messages=[{"role": "user", "content": prompt}], tools=[WEATHER],
                  extra_body=GREEDY)
        r = c.messages.create(**kw)
        with c.messages.stream(**kw) as s:
            final = s.get_final_message()
        strip = [{k: v for k, v in b.to_dict().items() if k != "id"} for b in r.content]
        assert [{k: v for k, v in b.to_dict().items() if k != "id"} for b in final.content] == strip
        assert final.stop_reason == r.stop_reason


def _plan(**kw) -> ChatPlan:
    return ChatPlan([], [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                    use_tools=True, **kw)


def test_call_or_text_split():
    p = _plan()
    # a bare JSON call (json format): no text block
    text, calls = reply_parts('{"name": "f", "parameters": {"a": 1}}', p, False)
    assert text == "" and [(c["name"], c["input"]) for c in calls] == [("f", {"a": 1})]
    # hermes: the text before the marker is a text block; two calls, or one when parallel use is off
    two = ('Sure.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
           '<tool_call>{"name": "f", "arguments": {"b": 2}}</tool_call>')
    text, calls = reply_parts(two, p, False)
    assert text == "Sure.\n" and len(calls) == 2
    assert len(reply_parts(two, p, True)[1]) == 1
    assert reply_parts('{"name": "g", "parameters": {}}', p, False) == ('{"name": "g", "parameters": {}}', [])
    assert reply_parts('{"name": "f", "parameters": 3}', p, False)[1] == []  # input must be an object
    # streaming: held while it may still be a call
    for held in ("", "  ", "{", ' {"na', "<|py", "<tool_c", "[1"):
        assert surely_text(held) == 0, held
    assert surely_text("Hello") == 5
    assert surely_text("Hello <tool") == 6 and surely_text("Hello <tool_call>{") == 6
    assert surely_text("Hello <b>") == 9
    # what streamed before a call is exactly the call reply's text block
    assert two[:surely_text(two)] == reply_parts(two, p, False)[0]


def test_structured_output(smol):
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client(smol).messages.create(model=M, max_tokens=80, messages=[{"role": "user", "content": "A person?"}],
                                     output_config={"format": {"type": "json_schema", "schema": person}},
                                     extra_body=GREEDY)
    assert r.stop_reason == "end_turn"
    jsonschema.validate(json.loads(_text(r)), person)


def test_accepted_fields(smol):
    r = client(smol).messages.create(
        model=M, max_tokens=4, metadata={"user_id": "u-1"}, service_tier="standard_only",
        thinking={"type": "disabled"}, cache_control={"type": "ephemeral"}, speed="standard",
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                  {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "How are you?"}],
        stop_sequences=["\n\n"], extra_body={"temperature": 0.7, "top_p": 0.9, "top_k": 40})
    assert r.content and r.usage.output_tokens <= 4


# ---------------------------------------------------------------- count_tokens


def test_count_tokens_equals_the_requests_input(smol):
    c = client(smol)
    cases = [dict(messages=[{"role": "user", "content": "A fresh question about owls?"}]),
             dict(system="You are terse.", messages=[{"role": "user", "content": "Hi"}]),
             dict(messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER, TIME]),
             dict(system=[{"type": "text", "text": "Use tools."}], tools=[WEATHER],
                  tool_choice={"type": "tool", "name": "get_weather"},
                  messages=[{"role": "user", "content": "Weather in Rome?"}])]
    for kw in cases:
        n = c.messages.count_tokens(model=M, **kw).input_tokens
        r = c.messages.create(model=M, max_tokens=2, **kw)
        # Anthropic's usage: input_tokens are those not read from the (prefix) cache
        assert n == r.usage.input_tokens + r.usage.cache_read_input_tokens + r.usage.cache_creation_input_tokens
    assert c.messages.count_tokens(model=M, **cases[2]).input_tokens > \
        c.messages.count_tokens(model=M, messages=cases[2]["messages"]).input_tokens  # the tools count
    # nothing cached yet for a new prompt's every block: the two numbers are the same
    fresh = [{"role": "user", "content": "Zebra quantum marmalade " * 8}]
    n = c.messages.count_tokens(model=M, system="Unique system prompt 7781.", messages=fresh).input_tokens
    r = c.messages.create(model=M, max_tokens=1, system="Unique system prompt 7781.", messages=fresh)
    assert r.usage.cache_read_input_tokens == 0 and r.usage.input_tokens == n


# ---------------------------------------------------------------- errors


def test_bad_requests_are_400_naming_the_field(smol):
    c = client(smol)
    hi = [{"role": "user", "content": "hi"}]
    cases = [
        (lambda: c.post("/v1/messages", body={"model": M, "messages": hi}, cast_to=object), "max_tokens"),
        (lambda: c.messages.create(model=M, max_tokens=5, messages=hi, extra_body={"temperature": 1.5}),
         "temperature"),
        (lambda: c.messages.create(model=M, max_tokens=5, messages=hi,
                                   thinking={"type": "enabled", "budget_tokens": 2048}), "thinking"),
        (lambda: c.messages.create(model=M, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]),
         "image"),
        (lambda: c.messages.create(model=M, max_tokens=5, messages=hi, container="c1"), "container"),
        (lambda: c.messages.create(model=M, max_tokens=5, messages=hi + [{"role": "assistant", "content": "Sure"}]),
         "prefill"),
        (lambda: c.messages.create(model=M, max_tokens=5, messages=hi, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "nope"}), "tool_choice"),
        (lambda: c.messages.create(model=M, max_tokens=5, messages=hi, tool_choice={"type": "any"}), "tool_choice"),
        (lambda: c.messages.create(model=M, max_tokens=5, messages=hi,
                                   tools=[{"type": "web_search_20250305", "name": "web_search"}]), "server tools"),
        (lambda: c.messages.create(model=M, max_tokens=2000, messages=hi), "max_tokens"),
        (lambda: c.messages.count_tokens(model=M, messages=[]), "messages"),
    ]
    for call, named in cases:
        with pytest.raises(anthropic.BadRequestError) as e:
            call()
        assert named in _error(e.value, 400, "invalid_request_error"), named
    assert _wait(lambda: _idle(smol))


def test_not_found(smol):
    c = client(smol)
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="claude-nope", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert "claude-nope" in _error(e.value, 404, "not_found_error")
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.count_tokens(model="claude-nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.NotFoundError) as e:
        c.post("/v1/messages/nope", body={}, cast_to=object)
    assert "/v1/messages/nope" in _error(e.value, 404, "not_found_error")


def test_auth_body_limit_and_overload(strict):
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(strict, "wrong").messages.create(model=M, max_tokens=2, messages=hi)
    _error(e.value, 401, "authentication_error")
    c = client(strict, KEY)
    assert c.messages.create(model=M, max_tokens=2, messages=hi).usage.output_tokens >= 1
    with pytest.raises(anthropic.ContentTooLargeError) as e:
        c.messages.create(model=M, max_tokens=2, messages=[{"role": "user", "content": "x" * 30_000}])
    _error(e.value, 413, "request_too_large")
    strict.state.draining = True  # what SIGTERM sets (server/run.py)
    try:
        with pytest.raises(anthropic.OverloadedError) as e:
            c.messages.create(model=M, max_tokens=2, messages=hi)
        _error(e.value, 529, "overloaded_error")
    finally:
        strict.state.draining = False


def test_loading_is_529(smollm2_gguf):
    release = threading.Event()

    def load():
        release.wait(60)
        raise RuntimeError("test: never loads")

    srv = LiveServer(load)
    try:
        with pytest.raises(anthropic.InternalServerError) as e:
            client(srv).messages.create(model=M, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert isinstance(e.value, anthropic.OverloadedError)
        assert "loading" in _error(e.value, 529, "overloaded_error")
    finally:
        release.set()
        srv.close()


def test_full_queue_is_429(strict):
    c = client(strict, KEY)
    body = {"model": M, "max_tokens": 900, "messages": LONG, "stream": True}
    waiter = threading.Thread(target=lambda: client(strict, KEY).messages.create(model=M, max_tokens=3,
                                                                                 messages=LONG))
    with httpx.Client(timeout=60, headers={"x-api-key": KEY}) as h:
        with h.stream("POST", strict.url + "/v1/messages", json=body) as r:
            lines = r.iter_lines()
            assert next(lines) == "event: message_start"  # it runs (max_num_seqs=1) ...
            waiter.start()  # ... one waits ...
            assert _wait(lambda: strict.metric("llamajet:num_requests_waiting") == 1)
            with pytest.raises(anthropic.RateLimitError) as e:  # ... and the queue is full
                c.messages.create(model=M, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
            _error(e.value, 429, "rate_limit_error")
            assert e.value.response.headers["retry-after"] == "1"
    waiter.join(120)
    assert _wait(lambda: _idle(strict))


def test_engine_failure_is_500_api_error(strict):
    """A forward pass that raises (as a kernel fault would) fails the requests in flight: before the
    stream starts, a 500 api_error; once it has started, an error event in the stream."""
    runner = strict.llm.engine.runner
    real = runner.run
    c = client(strict, KEY)
    hi = [{"role": "user", "content": "hi"}]
    calls = {"n": 0, "ok": 0}

    def failing(*a, **kw):
        calls["n"] += 1
        if calls["n"] > calls["ok"]:
            raise RuntimeError("test: injected forward failure")
        return real(*a, **kw)

    runner.run = failing
    try:
        with pytest.raises(anthropic.InternalServerError) as e:
            c.messages.create(model=M, max_tokens=5, messages=hi)
        assert "injected forward failure" in _error(e.value, 500, "api_error")
        with pytest.raises(anthropic.InternalServerError):
            with c.messages.stream(model=M, max_tokens=5, messages=hi) as s:
                list(s)
        calls.update(n=0, ok=3)  # the prompt and two tokens, then the fault
        with pytest.raises(anthropic.APIStatusError) as e:
            with c.messages.stream(model=M, max_tokens=50, messages=LONG, extra_body=GREEDY) as s:
                list(s)
        assert e.value.body["error"]["type"] == "api_error"
    finally:
        runner.run = real
    assert _wait(lambda: _idle(strict))
    assert c.messages.create(model=M, max_tokens=2, messages=hi).usage.output_tokens >= 1  # serving again


def _abort_all(srv) -> None:
    """What a forced drain does (server/run.py), on the server's loop."""
    ae = srv.llm.async_engine
    ae._loop.call_soon_threadsafe(lambda: ae.abort_all("abort"))


def test_forced_drain_is_overloaded(smol):
    c = client(smol)
    out = {}

    def ask():
        try:
            c.messages.create(model=M, max_tokens=900, messages=LONG, extra_body=GREEDY)
        except anthropic.APIStatusError as e:
            out["e"] = e

    t = threading.Thread(target=ask)
    t.start()
    assert _wait(lambda: smol.metric("llamajet:num_requests_running") == 1)
    _abort_all(smol)
    t.join(60)
    assert isinstance(out.get("e"), anthropic.OverloadedError)
    assert "cut short" in _error(out["e"], 529, "overloaded_error")
    with pytest.raises(anthropic.APIStatusError) as e:
        with c.messages.stream(model=M, max_tokens=900, messages=LONG, extra_body=GREEDY) as s:
            for ev in s:
                if ev.type == "content_block_delta":
                    _abort_all(smol)
    assert e.value.body["error"]["type"] == "overloaded_error"
    assert _wait(lambda: _idle(smol))


def test_disconnect_mid_stream_frees_the_sequence(smol):
    eng = smol.llm.engine
    before = eng.stats.generated
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", smol.url + "/v1/messages",
                      json={"model": M, "max_tokens": 900, "messages": LONG, "stream": True,
                            "temperature": 0}) as r:
            lines = r.iter_lines()
            got = []
            while sum(ln == "event: content_block_delta" for ln in got) < 3:
                got.append(next(lines))
            assert smol.metric("llamajet:num_requests_running") == 1
    # closed mid-stream: the next step aborts it and its blocks go back
    assert _wait(lambda: _idle(smol))
    assert eng.stats.generated - before < 900
    assert eng.scheduler.running == [] and not eng.scheduler.waiting
