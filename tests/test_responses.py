"""`/v1/responses` (OpenAI Responses) through the official `openai` client,
openai-agents' default Responses model, and raw HTTP, on a real server on
loopback (the default model, SmolLM2-135M-Instruct).

The request bodies the clients send by default are kept in
tests/data/responses_requests/ (captured by its capture.py against a
stand-in server); every one of them must be accepted."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import time
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("agents")

from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402
from serverlib import hold_engine, idle as _idle, wait as _wait  # noqa: E402

from llamajet.server.response_store import ResponseStore  # noqa: E402

M = "test-model"
DATA = Path(__file__).resolve().parent / "data" / "responses_requests"
EVENTS = TypeAdapter(ResponseStreamEvent)

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"]}, "strict": True}
TIME = {"type": "function", "name": "get_time", "description": "Current time in a timezone",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 30}},
                       "required": ["tz"]}, "strict": True}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def smol(default_server):
    """The session's shared default-model server (conftest.py: context 1024, 8 sequences)."""
    return default_server


def _err(r: httpx.Response, status: int, param: str | None = "-") -> dict:
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"]
    if param != "-":
        assert e["param"] == param, e
    return e


def _sse(srv, body: dict) -> list:
    """The raw stream, each event checked: `event:` names its data's type,
    the data validates (strictly) as the SDK's event type, sequence numbers
    count from 0."""
    events = []
    with httpx.Client(timeout=120) as c, c.stream("POST", srv.url + "/v1/responses",
                                                  json={"model": M, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name
                events.append(EVENTS.validate_python(data))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def _store(srv) -> ResponseStore:
    st = getattr(srv.app.state, "responses_store", None)
    if st is None:
        st = srv.app.state.responses_store = ResponseStore()
    return st


# ---------------------------------------------------------------- what the clients send


def _capture_module():
    spec = importlib.util.spec_from_file_location("responses_capture", DATA / "capture.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_captured_bodies_are_what_the_installed_clients_send():
    saved = {p.stem: json.loads(p.read_text()) for p in DATA.glob("*.json")}
    fresh = _capture_module().capture()
    assert fresh == saved, "the clients' default bodies changed: run tests/data/responses_requests/capture.py"
    assert {"openai_create", "agents_run", "agents_tool_run_2", "agents_model_settings"} <= set(saved)


@pytest.mark.parametrize("name", sorted(p.stem for p in DATA.glob("*.json")))
def test_default_bodies_are_accepted(smol, name):
    body = json.loads((DATA / f"{name}.json").read_text())
    body["max_output_tokens"] = min(body.get("max_output_tokens", 8), 8)  # short; the rest as sent
    if body.get("stream"):
        events = _sse(smol, {k: v for k, v in body.items() if k != "model"})
        assert events[0].type == "response.created" and events[-1].type in ("response.completed",
                                                                           "response.incomplete")
    else:
        r = httpx.post(smol.url + "/v1/responses", json=body, timeout=120)
        assert r.status_code == 200, r.text
        Response.model_validate(r.json())


# ---------------------------------------------------------------- text


def test_create_validates_and_equals_chat_greedy(smol):
    c = smol.client()
    msgs = [{"role": "user", "content": "Name three colors."}]
    chat = c.chat.completions.create(model=M, messages=msgs, max_tokens=24, temperature=0)
    raw = httpx.post(smol.url + "/v1/responses", json={"model": M, "input": "Name three colors.",
                                                       "max_output_tokens": 24, "temperature": 0}, timeout=120)
    assert raw.status_code == 200
    r = Response.model_validate(raw.json())  # strict: every field the SDK requires is there
    assert r.id.startswith("resp_") and r.object == "response" and r.model == M
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    # the client's own parsing, and a message list with instructions as the system message
    r2 = c.responses.create(model=M, instructions="You are terse.", temperature=0, max_output_tokens=24,
                            input=[{"role": "user", "content": [{"type": "input_text", "text": "Name three colors."}]}])
    chat2 = c.chat.completions.create(model=M, max_tokens=24, temperature=0,
                                      messages=[{"role": "system", "content": "You are terse."}, *msgs])
    assert r2.output_text == chat2.choices[0].message.content
    assert r2.instructions == "You are terse." and r2.temperature == 0


def test_stream_one_delta_per_token(smol):
    c = smol.client()
    kw = dict(model=M, input="Write a long story about the sea.", max_output_tokens=12, temperature=0)
    whole = c.responses.create(**kw)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 12 and whole.output[0].status == "incomplete"
    events = _sse(smol, {k: v for k, v in kw.items() if k != "model"})
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == 12 == events[-1].response.usage.output_tokens  # one per generated token
    text = "".join(d.delta for d in deltas)
    assert text == events[-4].text == events[-1].response.output_text == whole.output_text
    assert {d.item_id for d in deltas} == {events[-1].response.output[0].id}
    # the client's iterator and its accumulating helper read the same stream
    typed = list(c.responses.create(stream=True, **kw))
    assert "".join(e.delta for e in typed if e.type == "response.output_text.delta") == whole.output_text
    # a reply that ends by itself: completed (the client's accumulating helper wants that event)
    done = _sse(smol, {"input": "Say hi.", "max_output_tokens": 200, "temperature": 0})
    assert done[-1].type == "response.completed" and done[-1].response.status == "completed"
    assert done[-1].response.usage.output_tokens >= sum(e.type == "response.output_text.delta" for e in done) - 1
    with c.responses.stream(model=M, input="Say hi.", max_output_tokens=200, temperature=0) as s:
        for _ in s:
            pass
        assert s.get_final_response().output_text == done[-1].response.output_text


def test_logprobs_included(smol):
    kw = {"input": "Name a color.", "max_output_tokens": 5, "temperature": 0,
          "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    r = Response.model_validate(httpx.post(smol.url + "/v1/responses", json={"model": M, **kw}, timeout=120).json())
    lps = r.output[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens == 5
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in lps)
    assert "".join(lp.token for lp in lps) == r.output_text
    deltas = [e for e in _sse(smol, kw) if e.type == "response.output_text.delta"]
    assert [d.logprobs[0].logprob for d in deltas] == pytest.approx([lp.logprob for lp in lps], abs=1e-4)
    assert all(d.model_extra.get("obfuscation") is None for d in deltas)
    # stream_options.include_obfuscation: padding on each delta event
    padded = [e for e in _sse(smol, {**kw, "stream_options": {"include_obfuscation": True}})
              if e.type == "response.output_text.delta"]
    assert len(padded) == 5 and all(d.model_extra["obfuscation"] for d in padded)


# ---------------------------------------------------------------- stored responses


def test_previous_response_id_continues_the_conversation(smol):
    c = smol.client()
    first = c.responses.create(model=M, input="My name is Ada.", max_output_tokens=16, temperature=0)
    second = c.responses.create(model=M, previous_response_id=first.id, input="What is my name?",
                                max_output_tokens=16, temperature=0)
    assert second.previous_response_id == first.id and second.output_text
    # its prompt is the first exchange, then the new message
    msgs = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"}]
    ids = httpx.post(smol.url + "/tokenize", json={"messages": msgs}).json()["tokens"]
    assert second.usage.input_tokens == len(ids)
    chat = c.chat.completions.create(model=M, messages=msgs, max_tokens=16, temperature=0)
    assert second.output_text == chat.choices[0].message.content
    # retrieval, and the items it was generated from (the first exchange included)
    assert c.responses.retrieve(first.id).model_dump() == first.model_dump()
    items = c.responses.input_items.list(second.id, order="asc").data
    assert [(i.type, getattr(i, "role", None)) for i in items] == [("message", "user"), ("message", "assistant"),
                                                                   ("message", "user")]
    assert items[1].content[0].text == first.output_text
    # store false: not kept; unknown ids are 404s naming the field
    gone = c.responses.create(model=M, input="Hi.", max_output_tokens=2, store=False)
    assert gone.store is False
    _err(httpx.get(smol.url + f"/v1/responses/{gone.id}"), 404, "response_id")
    e = _err(httpx.post(smol.url + "/v1/responses",
                        json={"model": M, "input": "x", "previous_response_id": "resp_nope"}), 404,
             "previous_response_id")
    assert "resp_nope" in e["message"]
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model=M, input="x", previous_response_id=gone.id)
    # delete
    assert c.responses.delete(first.id) is None
    _err(httpx.get(smol.url + f"/v1/responses/{first.id}"), 404, "response_id")


def test_streamed_response_is_stored_and_continues(smol):
    events = _sse(smol, {"input": "Count to three.", "max_output_tokens": 10, "temperature": 0})
    final = events[-1].response
    got = httpx.get(smol.url + f"/v1/responses/{final.id}").json()
    assert Response.model_validate(got).output_text == final.output_text
    r = smol.client().responses.create(model=M, previous_response_id=final.id, input="Again.", max_output_tokens=4)
    assert r.usage.input_tokens > final.usage.input_tokens + final.usage.output_tokens


def test_store_evicts_the_oldest_by_count_and_bytes(smol):
    old = getattr(smol.app.state, "responses_store", None)
    smol.app.state.responses_store = ResponseStore(max_count=2)
    try:
        c = smol.client()
        rs = [c.responses.create(model=M, input=f"Say {w}.", max_output_tokens=1) for w in ("a", "b", "c")]
        _err(httpx.get(smol.url + f"/v1/responses/{rs[0].id}"), 404, "response_id")
        for r in rs[1:]:
            assert httpx.get(smol.url + f"/v1/responses/{r.id}").status_code == 200
        assert len(smol.app.state.responses_store) == 2 and smol.app.state.responses_store.evicted == 1
    finally:
        smol.app.state.responses_store = old


def test_store_bounds_unit():
    st = ResponseStore(max_count=10, max_bytes=2000)
    first = {"id": "resp_1", "x": "a" * 300}
    assert st.put(first, None, [{"type": "message", "id": "m1", "content": "b" * 300}], [])
    prev = st.get("resp_1")
    assert st.put({"id": "resp_2"}, prev, [{"type": "message", "id": "m2", "content": "c" * 300}], [])
    assert [i["id"] for i in st.get("resp_2").conversation] == ["m1", "m2"]
    # a conversation's bytes count in full (it keeps its predecessors' items alive)
    assert st.get("resp_2").nbytes > 600 and st.nbytes == prev.nbytes + st.get("resp_2").nbytes
    assert st.put({"id": "resp_3", "x": "d" * 900}, None, [], [])
    assert "resp_1" not in st and st.nbytes <= 2000  # the oldest went first
    assert not st.put({"id": "resp_4", "x": "e" * 3000}, None, [], []) and "resp_4" not in st
    assert st.delete("resp_3") and not st.delete("resp_3")


# ---------------------------------------------------------------- structured output and tools


def test_text_format_json_schema_validates(smol):
    c = smol.client()
    for temperature in (0.0, 1.0):
        r = c.responses.create(model=M, input="Describe a person as JSON.", max_output_tokens=80,
                               temperature=temperature,
                               text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                                                "strict": True}})
        assert r.status == "completed" and r.text.format.type == "json_schema"
        jsonschema.validate(json.loads(r.output_text), PERSON)
    r = c.responses.create(model=M, input="Give me a JSON object with a name and an age.", max_output_tokens=120,
                           temperature=0, text={"format": {"type": "json_object"}})
    assert r.status == "completed"  # the grammar ended it: a whole object
    assert isinstance(json.loads(r.output_text), dict)
    events = _sse(smol, {"input": "Describe a person as JSON.", "max_output_tokens": 80, "temperature": 0.7,
                         "text": {"format": {"type": "json_schema", "name": "person", "schema": PERSON}}})
    jsonschema.validate(json.loads("".join(e.delta for e in events if e.type == "response.output_text.delta")),
                        PERSON)
    # with tools and tool_choice auto: one call, or JSON in the format
    r = c.responses.create(model=M, input="Describe a person as JSON.", max_output_tokens=80, temperature=0,
                           tools=[WEATHER], text={"format": {"type": "json_schema", "name": "p", "schema": PERSON}})
    (item,) = r.output
    if item.type == "function_call":
        jsonschema.validate(json.loads(item.arguments), WEATHER["parameters"])
    else:
        jsonschema.validate(json.loads(r.output_text), PERSON)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_time"},
                                    {"type": "allowed_tools", "mode": "required",
                                     "tools": [{"type": "function", "name": "get_time"}]}])
def test_function_calls_and_their_outputs(smol, choice):
    c = smol.client()
    r = c.responses.create(model=M, input="What's the weather in Paris?", tools=[WEATHER, TIME],
                           tool_choice=choice, max_output_tokens=100, temperature=0)
    assert r.status == "completed" and r.output_text == ""
    (call,) = r.output
    assert call.type == "function_call" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    fn = {"get_weather": WEATHER, "get_time": TIME}[call.name]
    if isinstance(choice, dict):
        assert call.name == "get_time"
    jsonschema.validate(json.loads(call.arguments), fn["parameters"])
    # streamed: the call comes whole at its end
    events = _sse(smol, {"input": "Weather in Rome?", "tools": [WEATHER, TIME], "tool_choice": choice,
                         "max_output_tokens": 100, "temperature": 0})
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    done = events[-2].item
    assert events[3].delta == events[4].arguments == done.arguments and json.loads(done.arguments)
    assert events[-1].response.output[0].call_id == done.call_id
    # the call and its output go back as input items (no stored state), and the reply is text
    r2 = c.responses.create(model=M, tools=[WEATHER, TIME], tool_choice="none", max_output_tokens=10,
                            store=False, input=[{"role": "user", "content": "What's the weather in Paris?"},
                                                call.model_dump(exclude_none=True),
                                                {"type": "function_call_output", "call_id": call.call_id,
                                                 "output": "18 C, sunny"}])
    assert r2.output[0].type == "message" and r2.output_text
    # this template renders no tool_calls: the call is shown as the model writes it, then the tool's answer
    shown = json.dumps({"name": call.name, "parameters": json.loads(call.arguments)})
    msgs = [{"role": "user", "content": "What's the weather in Paris?"}, {"role": "assistant", "content": shown},
            {"role": "tool", "content": "18 C, sunny"}]
    assert r2.usage.input_tokens == len(httpx.post(smol.url + "/tokenize", json={"messages": msgs}).json()["tokens"])


def test_auto_tool_choice_streams_text_per_token(smol):
    kw = {"input": "Write a poem about the sea.", "tools": [WEATHER], "max_output_tokens": 16, "temperature": 0}
    whole = Response.model_validate(httpx.post(smol.url + "/v1/responses", json={"model": M, **kw},
                                               timeout=120).json())
    events = _sse(smol, kw)
    final = events[-1].response
    assert final.output[0].type == whole.output[0].type
    if whole.output[0].type == "message":  # text: held while it might begin a call, then one delta per token
        deltas = [e for e in events if e.type == "response.output_text.delta"]
        assert "".join(d.delta for d in deltas) == whole.output_text == final.output_text
        if whole.status == "incomplete":
            assert len(deltas) == whole.usage.output_tokens
    else:
        assert [e.type for e in events].count("response.function_call_arguments.delta") == 1


def test_openai_agents_tool_round_trip(smol):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[dict] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append({"city": city})
        return f"18 C and sunny in {city}"

    schema = get_weather.params_json_schema

    async def go():
        client = AsyncOpenAI(base_url=smol.url + "/v1", api_key="none", max_retries=0)
        model = OpenAIResponsesModel(model=M, openai_client=client)
        # tool_choice "required" makes the first reply a grammar-enforced call; reset_tool_choice (the default)
        # sends the next request without it, so the model answers from the tool's output and the run ends
        agent = Agent(name="weather", instructions="Answer with the tool.", model=model, tools=[get_weather],
                      model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60))
        r = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        s = Runner.run_streamed(agent, "What is the weather in Rome?", max_turns=4)
        kinds = [e.type async for e in s.stream_events()]
        return r, s, kinds

    r, s, kinds = asyncio.run(go())
    assert len(calls) == 2
    for args in calls:
        jsonschema.validate(args, schema)
    for run in (r, s):
        types = [type(i).__name__ for i in run.new_items]
        assert types[:2] == ["ToolCallItem", "ToolCallOutputItem"] and types[-1] == "MessageOutputItem"
        assert isinstance(run.final_output, str) and run.final_output
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    # the tool's output went back to the model in the request that produced the answer
    last = smol.app.state.responses_store.get(s.raw_responses[-1].response_id)
    outs = [i for i in last.input_items if i["type"] == "function_call_output"]
    assert outs and outs[0]["output"].startswith("18 C and sunny in")


# ---------------------------------------------------------------- refusals and cleanup


@pytest.mark.parametrize("extra,param", [
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"truncation": "auto"}, "truncation"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"text": {"verbosity": "high"}}, "text.verbosity"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input"),
    ({"seed": 1}, "seed"),
    ({"temperature": 3}, "temperature"),
    ({"max_output_tokens": 5000}, "max_output_tokens"),
])
def test_refused_fields_are_400s_naming_them(smol, extra, param):
    e = _err(httpx.post(smol.url + "/v1/responses", json={"model": M, "input": "hi", **extra}), 400, param)
    if param not in ("temperature", "max_output_tokens", "tool_choice"):
        assert "refused" in e["message"] or "Field required" in e["message"]


def test_unknown_model_and_empty_input(smol):
    _err(httpx.post(smol.url + "/v1/responses", json={"model": "gpt-4o", "input": "hi"}), 404, "model")
    _err(httpx.post(smol.url + "/v1/responses", json={"model": M, "input": []}), 400, "input")
    _err(httpx.get(smol.url + "/v1/responses/resp_nope"), 404, "response_id")


def test_disconnect_mid_stream_frees_the_sequence(smol):
    eng = smol.llm.engine
    before = eng.stats.generated
    # The engine is held once the reply has 8 tokens, until the client has
    # closed the stream: so the request is still running at the checks below
    # however fast or slow the machine.
    with hold_engine(eng, 8) as (held, release):
        with httpx.Client(timeout=60) as c:
            with c.stream("POST", smol.url + "/v1/responses",
                          json={"model": M, "input": "Count from one to a thousand.", "max_output_tokens": 500,
                                "temperature": 0, "stream": True}) as r:
                lines = r.iter_lines()
                got = []
                while not any(g.startswith("data: ") and '"response.output_text.delta"' in g for g in got):
                    got.append(next(lines))
                assert held.wait(60)
                assert smol.metric("llamajet:num_requests_running") == 1
        release.set()  # the stream is closed: the next step sees the abort
        assert _wait(lambda: _idle(smol))
    assert eng.stats.generated - before < 500
    assert smol.llm.engine.scheduler.running == [] and not smol.llm.engine.scheduler.waiting
