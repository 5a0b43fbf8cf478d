"""OpenAI Responses (`/v1/responses`): input items, instructions, function
tools, structured output (`text.format`), stored responses and
`previous_response_id`; streamed as typed server-sent events.

    POST   /v1/responses                      create (stream or not)
    GET    /v1/responses/{id}                 a stored response
    DELETE /v1/responses/{id}                 forget it
    GET    /v1/responses/{id}/input_items     the items it was generated from

A request becomes a chat prompt: `instructions` as a first system message,
then the stored conversation of `previous_response_id` (its input items and
its output), then `input`'s items (a function_call is an assistant message
with tool_calls, a function_call_output a "tool" message), through the same
serving layer as /v1/chat/completions (plan_chat, the grammars, Run).

Streaming: `response.output_text.delta` comes once per generated token.
With no tools in use (none given, or tool_choice "none") the reply is text
and streams as it comes. With a forced call (tool_choice "required" or a
named function) the grammar makes the reply a call, which comes whole at its
end (as chat completions: output_item.added, one
function_call_arguments.delta with the whole arguments, .done,
output_item.done). With tool_choice "auto" the reply is a call exactly when
it begins as one (`{`, `[`, `<tool_call>` or `<|python_tag|>` after any
whitespace) and parses as a call to one of the tools: its tokens are held
back while the reply may still be beginning a call, and stream as text
(the held ones first, one delta each) as soon as it cannot; a call comes
whole at its end, and a reply that looked like a call but does not parse as
one comes as text at its end. The non-streamed answer applies the same rule.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response, StreamingResponse

from llamajet.errors import RequestError
from llamajet.server import tools as toolmod
from llamajet.server.deps import Admission, ReadyLLM, State, served
from llamajet.server.errors import ApiError
from llamajet.server.grammar import Grammars
from llamajet.server.protocol_responses import (FunctionCallItem, FunctionCallOutputItem, MessageItem,
                                                ResponseRequest, ToolChoiceAllowed, ToolChoiceFunction)
from llamajet.server.response_store import ResponseStore, StoredResponse
from llamajet.server.routes.openai_chat import chat_logprob
from llamajet.server.serving import (ChatPlan, Job, Run, chat_constraint, new_id, piece, plan_chat,
                                     sampling_params, sse)

router = APIRouter()

CALL_STARTS = ("{", "[", "<tool_call>", "<|python_tag|>")


def response_store(request: Request) -> ResponseStore:
    """The app's store, made on first use (`app.state.responses_store`; a test
    or the server's setup may put its own there, with other bounds)."""
    st = getattr(request.app.state, "responses_store", None)
    if st is None:
        settings = request.app.state.llamajet.settings
        st = request.app.state.responses_store = ResponseStore(settings.responses_max_count,
                                                               settings.responses_max_bytes)
    return st


Store = Annotated[ResponseStore, Depends(response_store)]


# ---------------------------------------------------------------- input items -> chat messages


def canonical_items(inp) -> list[dict]:
    """The request's input as stored items (ids given where missing): what
    GET .../input_items lists and what a continuation replays."""
    if isinstance(inp, str):
        inp = [MessageItem(role="user", content=inp)]
    out = []
    for it in inp:
        if isinstance(it, MessageItem):
            if it.role == "assistant":
                out.append({"type": "message", "id": it.id or new_id("msg_"), "role": "assistant",
                            "status": it.status or "completed",
                            "content": [{"type": "output_text", "text": it.text(), "annotations": []}]})
            else:
                out.append({"type": "message", "id": it.id or new_id("msg_"), "role": it.role,
                            "status": it.status or "completed",
                            "content": [{"type": "input_text", "text": it.text()}]})
        elif isinstance(it, FunctionCallItem):
            out.append({"type": "function_call", "id": it.id or new_id("fc_"), "call_id": it.call_id,
                        "name": it.name, "arguments": it.arguments, "status": it.status or "completed"})
        else:
            assert isinstance(it, FunctionCallOutputItem)
            out.append({"type": "function_call_output", "id": it.id or new_id("fco_"), "call_id": it.call_id,
                        "output": it.text(), "status": it.status or "completed"})
    return out


def call_text(fmt: str, name: str, args: Any) -> str:
    """A call as the model writes it (for templates that do not render tool_calls)."""
    if fmt == "hermes":
        return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"
    return json.dumps({"name": name, "parameters": args})


def chat_messages(items: list[dict], template: str | None) -> list[dict]:
    """Stored items as chat-template messages: consecutive function_calls (and
    the assistant text before them) make one assistant message with
    tool_calls (arguments as objects, as server/tools.py history_message
    gives them); a function_call_output is a "tool" message. A template that
    does not render tool_calls also gets each call as the model would have
    written it, in the assistant message's content, so the model sees it."""
    fmt = toolmod.call_format(template)
    renders_calls = bool(template) and "tool_calls" in template
    msgs: list[dict] = []
    for it in items:
        kind = it["type"]
        if kind == "message":
            msgs.append({"role": "system" if it["role"] == "developer" else it["role"],
                         "content": "".join(p["text"] for p in it["content"])})
        elif kind == "function_call":
            try:
                args = json.loads(it["arguments"])
            except ValueError:
                args = it["arguments"]
            last = msgs[-1] if msgs else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                msgs.append(last)
            last.setdefault("tool_calls", []).append(
                {"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": args}})
            if not renders_calls:
                last["content"] += ("\n" if last["content"] else "") + call_text(fmt, it["name"], args)
        else:
            msgs.append({"role": "tool", "tool_call_id": it["call_id"], "content": it["output"]})
    return msgs


# ---------------------------------------------------------------- tools, format, constraint


def tool_setup(req: ResponseRequest) -> tuple[list[dict], str | None, str | None]:
    """(chat tool dicts, choice "none"|"auto"|"required"|None, the named function)."""
    tools = [t.chat_tool() for t in req.tools or []]
    choice = req.tool_choice
    if isinstance(choice, ToolChoiceFunction):
        return tools, None, choice.name
    if isinstance(choice, ToolChoiceAllowed):
        names = {t["function"]["name"] for t in tools}
        allowed = [t.name for t in choice.tools]
        missing = [n for n in allowed if n not in names]
        if missing:
            raise ApiError(400, f"tool_choice.tools names {missing[0]!r}, which is not in tools", param="tool_choice")
        tools = [t for t in tools if t["function"]["name"] in allowed]
        choice = choice.mode
    if choice == "auto" and not tools:
        choice = None  # nothing to call: plain text (OpenAI accepts "auto" with no tools)
    return tools, choice, None


def text_format(req: ResponseRequest) -> tuple[str, Any] | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    return (fmt.type, fmt.schema_ if fmt.type == "json_schema" else None)


def call_or_answer_grammar(plan: ChatPlan, kind: str, schema: Any, tok) -> str:
    """tool_choice auto with a text.format: the reply is one call, or JSON in the format."""
    lark = toolmod.call_grammar(plan.tools, None, toolmod.call_format(tok.chat_template), tok)
    head, rest = lark.split("\n", 1)
    answer = dict(schema if kind == "json_schema" else {"type": "object"})
    answer["x-guidance"] = {"whitespace_flexible": False}
    return ("start: callturn | answer\ncallturn" + head[len("start"):] + "\n" + rest
            + "answer: %json " + json.dumps(answer) + "\n")


async def constraint_for(state, plan: ChatPlan, fmt: tuple[str, Any] | None, tok):
    try:
        if fmt is not None and plan.use_tools and not (plan.required or plan.named):
            lark = call_or_answer_grammar(plan, fmt[0], fmt[1], tok)
            return await asyncio.to_thread(state.grammars.constraint, Grammars.from_lark(lark), "text.format")
        return await chat_constraint(state, plan, fmt, tok)
    except RequestError as e:
        raise ApiError(400, str(e).replace("response_format", "text.format"),
                       param="tools" if plan.use_tools and fmt is None else "text.format")


def starts_as_call(text: str) -> str:
    """"call": the reply begins as a call; "maybe": it may still; "text": it cannot."""
    s = text.lstrip()
    if not s:
        return "maybe"
    if s.startswith(CALL_STARTS):
        return "call"
    return "maybe" if any(m.startswith(s) for m in CALL_STARTS) else "text"


def reply_calls(plan: ChatPlan, text: str) -> list[dict] | None:
    if not plan.use_tools or starts_as_call(text) != "call":
        return None
    return plan.calls(text)


# ---------------------------------------------------------------- response objects


class Shape:
    """The echoed request fields and the ids of one response."""

    def __init__(self, req: ResponseRequest, model: str) -> None:
        self.req, self.model = req, model
        self.id = new_id("resp_")
        self.created = int(time.time())
        self.msg_id = new_id("msg_")

    def obj(self, status: str, output: list[dict], usage: dict | None, *, incomplete: str | None = None,
            error: dict | None = None) -> dict:
        r = self.req
        fmt = r.text.format if r.text is not None and r.text.format is not None else None
        choice = r.tool_choice
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "background": False, "completed_at": int(time.time()) if status == "completed" else None,
            "error": error, "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "max_tool_calls": r.max_tool_calls, "model": self.model, "output": output,
            "parallel_tool_calls": r.parallel_tool_calls if r.parallel_tool_calls is not None else True,
            "previous_response_id": r.previous_response_id, "prompt_cache_key": r.prompt_cache_key,
            "reasoning": {"effort": r.reasoning.effort if r.reasoning else None, "summary": None},
            "safety_identifier": r.safety_identifier, "service_tier": "default", "store": r.stored,
            "temperature": r.temperature if r.temperature is not None else 1.0,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"},
                     "verbosity": "medium"},
            "tool_choice": (choice if isinstance(choice, str) else choice.model_dump()) if choice else "auto",
            "tools": [t.model_dump(exclude_none=True) | {"strict": t.strict} for t in r.tools or []],
            "top_logprobs": r.top_logprobs or 0, "top_p": r.top_p if r.top_p is not None else 1.0,
            "truncation": "disabled", "usage": usage, "user": r.user, "metadata": r.metadata or {},
        }

    def message(self, text: str, status: str, logprobs: list | None = None) -> dict:
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}

    @staticmethod
    def call(c: dict) -> dict:
        return {"type": "function_call", "id": new_id("fc_"), "call_id": c["id"], "name": c["function"]["name"],
                "arguments": c["function"]["arguments"], "status": "completed"}


def usage_of(run: Run) -> dict:
    n_in, n_out = run.prompt_tokens, run.outputs.num_generated
    return {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": run.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n_in + n_out}


def ending(finish: str | None, calls) -> tuple[str, str, str | None, dict | None]:
    """(response status, item status, incomplete reason, error) for a reply's finish."""
    if calls or finish == "stop":
        return "completed", "completed", None, None
    if finish == "length":
        return "incomplete", "incomplete", "max_output_tokens", None
    return "failed", "incomplete", None, {"code": "server_error",
                                          "message": "the request was aborted (the server is shutting down)"}


def text_logprobs(llm, tokens, on: bool) -> list[dict]:
    return [chat_logprob(llm, t) for t in tokens if t.logprob is not None] if on else []


# ---------------------------------------------------------------- routes


@router.post("/v1/responses")
async def create(request: Request, req: Annotated[ResponseRequest, Depends(served(ResponseRequest))],
                 llm: ReadyLLM, state: State, admit: Admission, store: Store):
    t0 = time.perf_counter()
    previous: StoredResponse | None = None
    if req.previous_response_id is not None:
        previous = store.get(req.previous_response_id)
        if previous is None:
            raise ApiError(404, f"no stored response with id {req.previous_response_id!r} (unknown, not stored, "
                           "or evicted)", "invalid_request_error", "previous_response_id",
                           "previous_response_not_found")
    new_items = canonical_items(req.input)
    items = (previous.conversation if previous is not None else []) + new_items
    tok = llm.tokenizer
    msgs = chat_messages(items, tok.chat_template)
    if req.instructions is not None:
        msgs = [{"role": "system", "content": req.instructions}] + msgs
    if not msgs:
        raise ApiError(400, "input is empty (and there is no previous_response_id to continue)", param="input")
    tools, choice, named = tool_setup(req)
    fmt = text_format(req)
    plan = plan_chat(llm, msgs, tools, choice, named, param="input", choice_param="tool_choice")
    params = sampling_params(llm, len(plan.ids), req.max_output_tokens, prompt_param="input",
                             max_tokens_param="max_output_tokens",
                             temperature=req.temperature if req.temperature is not None else 1.0,
                             top_p=req.top_p if req.top_p is not None else 1.0, logprobs=req.logprobs,
                             speculative=req.speculative)
    constraint = await constraint_for(state, plan, fmt, tok)
    admit()
    run = Run(state, llm, request, [Job(plan.ids, params, constraint)], t0)
    if not await run.start():
        return Response(status_code=499)
    shape = Shape(req, state.settings.model_name)
    want_lp = params.logprobs is not None

    def finish(out) -> dict:
        """The final response (stored when asked) from the choice's output."""
        calls = reply_calls(plan, out.text)
        status, item_status, reason, error = ending(out.finish_reason, calls)
        output = ([shape.call(c) for c in calls] if calls else
                  [shape.message(out.text, item_status, text_logprobs(llm, out.tokens, want_lp))])
        resp = shape.obj(status, output, usage_of(run), incomplete=reason, error=error)
        if req.stored:
            store.put(resp, previous, new_items, output)
        return resp

    if not req.stream:
        if not await run.drain():  # the client left
            return Response(status_code=499)
        return finish(run.outputs.choices[0])

    obfuscate = bool(req.stream_options and req.stream_options.include_obfuscation)

    async def body():
        seq = 0

        def event(kind: str, **fields) -> str:
            nonlocal seq
            if obfuscate and kind.endswith(".delta"):
                fields["obfuscation"] = secrets.token_urlsafe(secrets.randbelow(12) + 1)
            s = sse({"type": kind, "sequence_number": seq, **fields}, event=kind)
            seq += 1
            return s

        where = {"item_id": shape.msg_id, "output_index": 0}
        text_open = False

        def open_text():
            nonlocal text_open
            text_open = True
            return (event("response.output_item.added", output_index=0, item=shape.message("", "in_progress"))
                    + event("response.content_part.added", **where, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))

        def delta(text: str, tk) -> str:
            lp = []
            if want_lp and tk is not None and tk.logprob is not None:
                t, _ = piece(llm, tk.id)
                lp = [{"token": t, "logprob": tk.logprob,
                       "top_logprobs": [{"token": piece(llm, i)[0], "logprob": v} for i, v in tk.top]}]
            return event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=lp)

        skeleton = shape.obj("in_progress", [], None)
        yield event("response.created", response=skeleton)
        yield event("response.in_progress", response=skeleton)
        holding = plan.use_tools  # the reply may be a call: held back until it cannot be
        forced = plan.required or plan.named is not None
        held: list[tuple[str, Any]] = []
        out = run.outputs.choices[0]
        async for out, tk, ev in run.events():
            if tk is None and not ev.text:
                continue
            if holding:
                held.append((ev.text, tk))
                if forced or starts_as_call(out.text) != "text":
                    continue
                holding = False
                yield open_text()
                for text, t in held:
                    yield delta(text, t)
                held = []
                continue
            if not text_open:
                yield open_text()
            yield delta(ev.text, tk)
        resp = finish(out)
        item = resp["output"][0]
        if item["type"] == "function_call":
            for i, it in enumerate(resp["output"]):
                loc = {"item_id": it["id"], "output_index": i}
                yield event("response.output_item.added", output_index=i, item={**it, "arguments": "",
                                                                                  "status": "in_progress"})
                yield event("response.function_call_arguments.delta", **loc, delta=it["arguments"])
                yield event("response.function_call_arguments.done", **loc, arguments=it["arguments"],
                            name=it["name"])
                yield event("response.output_item.done", output_index=i, item=it)
        else:
            if not text_open:
                yield open_text()
                for text, t in held:
                    yield delta(text, t)
            part = item["content"][0]
            yield event("response.output_text.done", **where, content_index=0, text=part["text"],
                        logprobs=part["logprobs"])
            yield event("response.content_part.done", **where, content_index=0, part=part)
            yield event("response.output_item.done", output_index=0, item=item)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(resp["status"],
                                                                                           "response.failed")
        yield event(kind, response=resp)

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Request-Id": shape.id})


def _stored(store: ResponseStore, rid: str) -> StoredResponse:
    found = store.get(rid)
    if found is None:
        raise ApiError(404, f"no stored response with id {rid!r} (unknown, not stored, or evicted)",
                       "invalid_request_error", "response_id", "response_not_found")
    return found


@router.get("/v1/responses/{response_id}")
async def retrieve(response_id: str, store: Store, stream: bool = False):
    if stream:
        raise ApiError(400, "stream is not supported on retrieval (responses are never in the background)",
                       param="stream")
    return _stored(store, response_id).response


@router.delete("/v1/responses/{response_id}")
async def delete(response_id: str, store: Store):
    _stored(store, response_id)
    store.delete(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items")
async def input_items(response_id: str, store: Store, limit: int = Query(20, ge=1, le=100),
                      order: str = Query("desc", pattern="^(asc|desc)$"), after: str | None = None):
    items = list(_stored(store, response_id).input_items)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [it["id"] for it in items]
        if after not in ids:
            raise ApiError(404, f"no input item {after!r} in response {response_id!r}", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
