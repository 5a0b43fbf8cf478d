"""Captures the request bodies `openai`'s `client.responses.create` and
openai-agents' default Responses model (OpenAIResponsesModel) send, against
a tiny stand-in server that answers with fixed, well-formed Responses.

    .venv/bin/python tests/data/responses_requests/capture.py

Writes <name>.json next to this file (the bodies exactly as received).
tests/test_responses.py checks that llamajet accepts every one of them.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

HERE = Path(__file__).resolve().parent
captured: list[dict] = []


def _response(body: dict, output: list[dict]) -> dict:
    return {"id": "resp_capture", "object": "response", "created_at": time.time(), "status": "completed",
            "model": body.get("model", "m"), "output": output, "parallel_tool_calls": True, "tool_choice": "auto",
            "tools": [], "incomplete_details": None, "error": None, "instructions": None, "metadata": {},
            "temperature": 1.0, "top_p": 1.0,
            "usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2,
                      "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}}


def _output(body: dict) -> list[dict]:
    items = body.get("input") if isinstance(body.get("input"), list) else []
    answered = any(isinstance(i, dict) and i.get("type") == "function_call_output" for i in items)
    if body.get("tools") and not answered:
        return [{"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": body["tools"][0]["name"],
                 "arguments": json.dumps({"city": "Paris"}), "status": "completed"}]
    return [{"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
             "content": [{"type": "output_text", "text": "done", "annotations": []}]}]


app = FastAPI()


@app.post("/v1/responses")
async def responses(request: Request):
    body = await request.json()
    captured.append(body)
    out = _output(body)
    resp = _response(body, out)
    if not body.get("stream"):
        return resp

    def ev(seq, kind, **kw):
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **kw})}\n\n"

    async def stream():
        n = 0
        yield ev(n, "response.created", response={**resp, "status": "in_progress", "output": []})
        for i, item in enumerate(out):
            n += 1
            yield ev(n, "response.output_item.added", output_index=i, item=item)
            n += 1
            yield ev(n, "response.output_item.done", output_index=i, item=item)
        n += 1
        yield ev(n, "response.completed", response=resp)

    return StreamingResponse(stream(), media_type="text/event-stream")


def capture() -> dict[str, dict]:
    """{name: body} for every call the clients make (a name gets _1, _2 ... when one run makes several)."""
    from agents import (Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool,
                        set_tracing_disabled)
    from openai import AsyncOpenAI, OpenAI
    from openai.types.shared import Reasoning
    from pydantic import BaseModel

    class Forecast(BaseModel):
        city: str
        celsius: int

    set_tracing_disabled(True)
    captured.clear()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # (TCP_NODELAY: see serverlib)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    bodies: dict[str, dict] = {}

    def save(name: str, first: int) -> None:
        got = captured[first:]
        for k, body in enumerate(got):
            bodies[f"{name}_{k + 1}" if len(got) > 1 else name] = body

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return f"18 C in {city}"

    async def agents_runs():
        aclient = AsyncOpenAI(base_url=url, api_key="none", max_retries=0)
        model = OpenAIResponsesModel(model="test-model", openai_client=aclient)
        plain = Agent(name="plain", instructions="Be brief.", model=model)
        tooled = Agent(name="tooled", instructions="Use the tool.", model=model, tools=[get_weather],
                       model_settings=ModelSettings(tool_choice="required"))
        n = len(captured)
        await Runner.run(plain, "Say hi.")
        save("agents_run", n)
        n = len(captured)
        r = Runner.run_streamed(plain, "Say hi.")
        async for _ in r.stream_events():
            pass
        save("agents_run_streamed", n)
        n = len(captured)
        await Runner.run(tooled, "Weather in Paris?")
        save("agents_tool_run", n)
        n = len(captured)
        r = Runner.run_streamed(tooled, "Weather in Paris?")
        async for _ in r.stream_events():
            pass
        save("agents_tool_run_streamed", n)
        # every ModelSettings field a caller commonly sets, and a structured final output
        n = len(captured)
        full = Agent(name="full", instructions="Be brief.", model=model, output_type=Forecast,
                     model_settings=ModelSettings(temperature=0.2, top_p=0.9, max_tokens=32, parallel_tool_calls=True,
                                                  truncation="disabled", store=True, metadata={"k": "v"},
                                                  top_logprobs=2, reasoning=Reasoning(effort="none"),
                                                  prompt_cache_retention="in_memory", verbosity="medium"))
        try:
            await Runner.run(full, "Weather in Paris?")
        except Exception:  # the stand-in's answer is not a Forecast; the body is what is kept
            pass
        save("agents_model_settings", n)

    try:
        client = OpenAI(base_url=url, api_key="none", max_retries=0)
        n = len(captured)
        client.responses.create(model="test-model", input="Say hi.")
        save("openai_create", n)
        n = len(captured)
        list(client.responses.create(model="test-model", input="Say hi.", stream=True))
        save("openai_create_stream", n)
        asyncio.run(agents_runs())
    finally:
        server.should_exit = True
        thread.join(10)
    return bodies


def main() -> None:
    for name, body in capture().items():
        (HERE / f"{name}.json").write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
        print(name)


if __name__ == "__main__":
    main()
