"""OpenAI `/v1/chat/completions`: messages, tools, structured output, n,
logprobs; streamed as one chunk per generated token (a tool call comes
whole, at its end: whether a reply is a call is known only then)."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from llamajet.server import tools as toolmod
from llamajet.server.deps import Admission, ReadyLLM, State, served
from llamajet.server.errors import ApiError
from llamajet.server.protocol import ChatCompletionRequest
from llamajet.server.serving import (Job, Run, chat_constraint, new_id, openai_sampling, piece, plan_chat, sse)

router = APIRouter()


def chat_logprob(llm, tok) -> dict:
    t, b = piece(llm, tok.id)
    tops = []
    for i, lp in tok.top:
        tt, bb = piece(llm, i)
        tops.append({"token": tt, "logprob": lp, "bytes": bb})
    return {"token": t, "logprob": tok.logprob, "bytes": b, "top_logprobs": tops}


def finish_of(reason: str | None, calls) -> str:
    return "tool_calls" if calls else (reason or "abort")


@router.post("/v1/chat/completions")
async def chat(request: Request, req: Annotated[ChatCompletionRequest, Depends(served(ChatCompletionRequest))],
               llm: ReadyLLM, state: State, admit: Admission):
    t0 = time.perf_counter()
    tools = [t.model_dump() for t in req.tools] if req.tools else []
    choice = req.tool_choice
    named = choice.function.name if choice is not None and not isinstance(choice, str) else None
    structured = req.response_format is not None and req.response_format.type != "text"
    plan = plan_chat(llm, [toolmod.history_message(m) for m in req.messages], tools,
                     choice if isinstance(choice, str) else None, named, structured=structured)
    max_tokens = req.max_completion_tokens or req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if req.top_logprobs and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    params = openai_sampling(req, len(plan.ids), max_tokens, logprobs, llm)
    rf = req.response_format
    fmt = (rf.type, rf.json_schema.schema_ if rf.type == "json_schema" else None) if structured else None
    constraint = await chat_constraint(state, plan, fmt, llm.tokenizer)
    admit()
    run = Run(state, llm, request, [Job(plan.ids, params, constraint)], t0)
    rid = new_id("chatcmpl-")
    if not await run.start():
        return Response(status_code=499)
    base = {"id": rid, "created": int(time.time()), "model": state.settings.model_name,
            "system_fingerprint": state.fingerprint}

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        extra = {"usage": None} if include_usage else {}

        def chunk(index: int, delta: dict, lp, finish) -> str:
            return sse({**base, "object": "chat.completion.chunk",
                        "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}],
                        **extra})

        async def body():
            for i in range(params.n):
                yield chunk(i, {"role": "assistant", "content": ""}, None, None)
            async for out, tok, ev in run.events():
                if plan.use_tools:  # the reply is a call or text: known only at its end
                    if ev.finish_reason is None:
                        continue
                    calls = plan.calls(out.text)
                    delta = ({"tool_calls": [{"index": j, **c} for j, c in enumerate(calls)]} if calls
                             else {"content": out.text})
                    yield chunk(out.index, delta, None, finish_of(ev.finish_reason, calls))
                    continue
                lp = ({"content": [chat_logprob(llm, tok)]} if params.logprobs is not None and tok is not None
                      and tok.logprob is not None else None)
                if ev.text or lp is not None or ev.finish_reason is not None:
                    yield chunk(out.index, {"content": ev.text} if ev.text else {}, lp, ev.finish_reason)
            if include_usage:
                yield sse({**base, "object": "chat.completion.chunk", "choices": [], "usage": run.usage()})
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": rid})

    if not await run.drain():  # the client left
        return Response(status_code=499)
    choices = []
    for out in run.outputs.choices:
        calls = plan.calls(out.text)
        msg = ({"role": "assistant", "content": None, "tool_calls": calls} if calls
               else {"role": "assistant", "content": out.text})
        lps = ({"content": [chat_logprob(llm, t) for t in out.tokens if t.logprob is not None]}
               if params.logprobs is not None else None)
        choices.append({"index": out.index, "message": msg, "logprobs": lps,
                        "finish_reason": finish_of(out.finish_reason, calls)})
    return {**base, "object": "chat.completion", "choices": choices, "usage": run.usage()}
