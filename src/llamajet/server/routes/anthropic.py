"""Anthropic `/v1/messages` and `/v1/messages/count_tokens`.

A Messages request becomes the same chat prompt as chat completions
(server/serving.py `plan_chat`): `system` and the messages in order,
tool_use blocks as the assistant's `tool_calls`, each tool_result as a
"tool" message with its `tool_call_id`. count_tokens builds that prompt and
counts it, so it equals what a request reports as
`input_tokens + cache_read_input_tokens` (Anthropic's usage: `input_tokens`
are the prompt tokens not read from the prefix cache).

stop_reason: "tool_use" when the reply is a call, "max_tokens", else
"stop_sequence" (with the string) or "end_turn". The engine's finish "stop"
covers a stop token and a stop string alike; which stop string ended a
reply is found by decoding its tokens again with the engine's own
incremental decoder: the reply's text ends where the stop string begins, so
the decoded rest starts with it (`stop_sequence_of`).

Streaming: message_start, ping, then content blocks, message_delta,
message_stop; one text_delta per generated token. With tools under "auto"
the reply is a call or text, known only at its end: text streams as it
comes once it cannot be the start of a call (a reply starting with `{`,
`[`, `<|python_tag|>` or `<tool_call>` is held to its end), and from a
`<tool_call>` marker on it is held; a call then comes whole at the end as
a tool_use block with one input_json_delta. A forced call ("any" or
"tool") is held whole the same way. A reply cut short by a forced drain
ends with an `error` event (overloaded_error), as Anthropic's API does.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from llamajet.errors import RequestError
from llamajet.server.deps import Admission, ReadyLLM, State, served
from llamajet.server.errors import ApiError
from llamajet.server.grammar import Grammars
from llamajet.server.protocol_anthropic import CountTokensRequest, Message, MessagesRequest, PromptRequest
from llamajet.server.serving import ChatPlan, Job, Run, chat_constraint, new_id, plan_chat, sampling_params, sse

router = APIRouter()

_CALL_STARTS = ("{", "[", "<|python_tag|>", "<tool_call>")
_MARKER = "<tool_call>"
_HERMES = re.compile(r"<tool_call>\s*\{")


# ---------------------------------------------------------------- request -> prompt


def _text(blocks) -> str:
    return "\n".join(b.text for b in blocks)


def chat_messages(req: PromptRequest) -> list[dict]:
    """The request's system prompt and messages as the chat template takes
    them (the dicts server/tools.py `history_message` makes for chat
    completions)."""
    out: list[dict] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system)})
    seen: set[str] = set()  # tool_use ids of the assistant turns so far
    for i, m in enumerate(req.messages):
        out.extend(_one(m, i, seen))
    if req.messages[-1].role == "assistant":
        raise ApiError(400, f"messages.{len(req.messages) - 1}: the last message is the assistant's; continuing "
                       "it (prefill) is not supported, the reply is always a new assistant turn",
                       param="messages")
    return out


def _one(m: Message, i: int, seen: set[str]) -> list[dict]:
    where = f"messages.{i}.content"
    if m.role == "system":
        bad = [j for j, b in enumerate(m.content) if b.type != "text"]
        if bad:
            raise ApiError(400, f"{where}.{bad[0]}: a system message holds text blocks only", param=where)
        return [{"role": "system", "content": _text(m.content)}]
    if m.role == "assistant":
        texts, calls = [], []
        for j, b in enumerate(m.content):
            if b.type == "tool_result":
                raise ApiError(400, f"{where}.{j}: tool_result blocks belong in user messages", param=where)
            if b.type == "text":
                texts.append(b.text)
            else:
                calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}})
                seen.add(b.id)
        d: dict = {"role": "assistant", "content": "\n".join(texts)}
        if calls:
            d["tool_calls"] = calls
        return [d]
    out: list[dict] = []
    texts = []
    for j, b in enumerate(m.content):
        if b.type == "tool_use":
            raise ApiError(400, f"{where}.{j}: tool_use blocks belong in assistant messages", param=where)
        if b.type == "text":
            texts.append(b.text)
            continue
        if b.tool_use_id not in seen:
            raise ApiError(400, f"{where}.{j}.tool_use_id: {b.tool_use_id!r} answers no tool_use block of an "
                           "earlier assistant message", param=f"{where}.{j}.tool_use_id")
        if texts:
            out.append({"role": "user", "content": "\n".join(texts)})
            texts = []
        out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                    "content": ("Error: " if b.is_error else "") + b.text()})
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def plan(llm, req: PromptRequest) -> ChatPlan:
    """The prompt of a messages (or count_tokens) request, and how its
    reply is read."""
    tools = [t.openai() for t in req.tools or []]
    tc = req.tool_choice
    kind = tc.type if tc is not None else None
    if kind in ("auto", "any", "tool") and not tools:
        raise ApiError(400, f"tool_choice {{\"type\": \"{kind}\"}} needs tools", param="tool_choice")
    choice = {"auto": "auto", "any": "required", "none": "none", None: None, "tool": None}[kind]
    named = tc.name if kind == "tool" else None
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None and tools and kind != "none":
        raise ApiError(400, "output_config.format cannot be combined with tools (unless tool_choice is none)",
                       param="output_config.format")
    return plan_chat(llm, chat_messages(req), tools, choice, named)


async def constraint(state, p: ChatPlan, req: MessagesRequest, tok):
    if p.use_tools:
        return await chat_constraint(state, p, None, tok)
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is None:
        return None
    try:
        return await asyncio.to_thread(state.grammars.constraint, Grammars.from_json_schema(fmt.schema_),
                                       "output_config.format")
    except RequestError as e:  # an invalid schema; the message names json_schema or output_config.format
        msg = str(e)
        raise ApiError(400, msg if msg.startswith("output_config.format") else f"output_config.format: {msg}",
                       param="output_config.format")


# ---------------------------------------------------------------- reply -> content


def reply_parts(text: str, p: ChatPlan, single: bool) -> tuple[str, list[dict]]:
    """A finished reply's text block (may be "") and tool_use blocks. A call
    reply's text is what came before a `<tool_call>` marker (none for a bare
    JSON call)."""
    calls = p.calls(text) if p.use_tools else None
    if not calls:
        return text, []
    blocks = []
    for c in calls:
        try:
            args = json.loads(c["function"]["arguments"])
        except ValueError:
            return text, []
        if not isinstance(args, dict):  # Anthropic's input is an object
            return text, []
        blocks.append({"type": "tool_use", "id": new_id("toolu_"), "name": c["function"]["name"], "input": args})
    lead = ""
    if not text.lstrip().startswith(_CALL_STARTS[:3]):
        m = _HERMES.search(text)
        if m is not None:
            lead = text[:m.start()]
    return (lead if lead.strip() else ""), blocks[:1] if single else blocks


def surely_text(text: str) -> int:
    """How much of an unfinished reply (tools in use, not forced) is text
    whatever follows: 0 while it may still be a whole-reply call; else up to
    a `<tool_call>` marker, or the start of what may still become one."""
    s = text.lstrip()
    if not s or any(s.startswith(m) or m.startswith(s) for m in _CALL_STARTS):
        return 0
    i = text.find(_MARKER)
    if i >= 0:
        return i
    for k in range(min(len(_MARKER) - 1, len(text)), 0, -1):
        if text.endswith(_MARKER[:k]):
            return len(text) - k
    return len(text)


def stop_sequence_of(llm, out, stops: list[str] | None) -> str | None:
    """The stop string that ended `out` (finish_reason "stop"), or None (a
    stop token, or a grammar's end). Its tokens are decoded again by the
    engine's incremental decoder; the reply's text is that text up to where
    the stop string begins, so what follows starts with it."""
    if out.finish_reason != "stop" or not stops:
        return None
    dec = llm.tokenizer.stream_decoder()
    full = "".join(dec.push(t) for t in out.token_ids) + dec.flush()
    if not full.startswith(out.text):
        return None
    rest = full[len(out.text):]
    found = [s for s in stops if rest.startswith(s)]
    return min(found, key=len) if found else None


def stop_reason_of(finish: str | None, calls: list, matched: str | None) -> str:
    if calls:
        return "tool_use"
    if finish == "length":
        return "max_tokens"
    return "stop_sequence" if matched is not None else "end_turn"


def usage_of(run: Run) -> dict:
    cached = run.cached_tokens
    return {"input_tokens": run.prompt_tokens - cached, "output_tokens": run.outputs.num_generated,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached, "service_tier": "standard"}


def _aborted(out) -> ApiError:
    return ApiError(503, f"the server is shutting down: the reply was cut short after {len(out.tokens)} tokens",
                    "service_unavailable", code="draining")


# ---------------------------------------------------------------- routes


@router.post("/v1/messages")
async def messages(request: Request, req: Annotated[MessagesRequest, Depends(served(MessagesRequest))],
                   llm: ReadyLLM, state: State, admit: Admission):
    t0 = time.perf_counter()
    p = plan(llm, req)
    params = sampling_params(llm, len(p.ids), req.max_tokens, prompt_param="messages", temperature=req.temperature,
                             top_p=req.top_p if req.top_p is not None else 1.0, top_k=req.top_k or 0,
                             stop=tuple(req.stop_sequences or ()), speculative=req.speculative)
    cons = await constraint(state, p, req, llm.tokenizer)
    admit()
    run = Run(state, llm, request, [Job(p.ids, params, cons)], t0)
    mid = new_id("msg_")
    headers = {"request-id": new_id("req_")}
    if not await run.start():
        return Response(status_code=499)
    single = req.tool_choice is not None and getattr(req.tool_choice, "disable_parallel_tool_use", False)
    forced = p.use_tools and (p.required or p.named is not None)
    base = {"id": mid, "type": "message", "role": "assistant", "model": state.settings.model_name}

    if not req.stream:
        if not await run.drain():  # the client left
            return Response(status_code=499)
        out = run.outputs.choices[0]
        if out.finish_reason == "abort":
            raise _aborted(out)
        text, calls = reply_parts(out.text, p, single)
        matched = None if calls else stop_sequence_of(llm, out, req.stop_sequences)
        content = ([{"type": "text", "text": text}] if text else []) + calls
        return JSONResponse({**base, "content": content,
                             "stop_reason": stop_reason_of(out.finish_reason, calls, matched),
                             "stop_sequence": matched, "usage": usage_of(run)}, headers=headers)

    async def body():
        start_usage = {**usage_of(run), "output_tokens": 0}
        yield sse({"type": "message_start", "message": {**base, "content": [], "stop_reason": None,
                                                        "stop_sequence": None, "usage": start_usage}},
                  "message_start")
        yield sse({"type": "ping"}, "ping")
        index, text_open, emitted = 0, False, 0

        def text_delta(s: str):
            nonlocal text_open
            if not text_open:
                text_open = True
                yield sse({"type": "content_block_start", "index": index,
                           "content_block": {"type": "text", "text": ""}}, "content_block_start")
            yield sse({"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": s}},
                      "content_block_delta")

        def close_text():
            nonlocal text_open, index
            if text_open:
                yield sse({"type": "content_block_stop", "index": index}, "content_block_stop")
                text_open, index = False, index + 1

        try:
            async for out, _tok, ev in run.events():
                if ev.finish_reason is None:
                    full = out.text
                    safe = 0 if forced else surely_text(full) if p.use_tools else len(full)
                    if safe > emitted:
                        for x in text_delta(full[emitted:safe]):
                            yield x
                        emitted = safe
                    continue
                if ev.finish_reason == "abort":
                    for x in close_text():
                        yield x
                    e = _aborted(out)
                    yield sse({"type": "error", "error": {"type": "overloaded_error", "message": e.message}},
                              "error")
                    return
                text, calls = reply_parts(out.text, p, single)
                if len(text) > emitted:
                    for x in text_delta(text[emitted:]):
                        yield x
                for x in close_text():
                    yield x
                for c in calls:
                    yield sse({"type": "content_block_start", "index": index,
                               "content_block": {**c, "input": {}}}, "content_block_start")
                    yield sse({"type": "content_block_delta", "index": index,
                               "delta": {"type": "input_json_delta", "partial_json": json.dumps(c["input"])}},
                              "content_block_delta")
                    yield sse({"type": "content_block_stop", "index": index}, "content_block_stop")
                    index += 1
                matched = None if calls else stop_sequence_of(llm, out, req.stop_sequences)
                yield sse({"type": "message_delta",
                           "delta": {"stop_reason": stop_reason_of(out.finish_reason, calls, matched),
                                     "stop_sequence": matched},
                           "usage": {k: v for k, v in usage_of(run).items() if k != "service_tier"}},
                          "message_delta")
                yield sse({"type": "message_stop"}, "message_stop")
        except Exception as e:  # noqa: BLE001 - the stream has begun: the error goes in it
            yield sse({"type": "error", "error": {"type": "api_error",
                                                  "message": f"internal error: {type(e).__name__}: {e}"}}, "error")

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", **headers})


@router.post("/v1/messages/count_tokens")
async def count_tokens(req: Annotated[CountTokensRequest, Depends(served(CountTokensRequest))], llm: ReadyLLM):
    return {"input_tokens": len(plan(llm, req).ids)}
