"""The serving layer: a parsed request of any API family becomes a prepared
generation (prompt ids, SamplingParams, a grammar constraint, the tools),
and a `Run` drives it through the AsyncEngine and collects every choice's
output in one place (engine/output.py), for streamed and non-streamed
answers alike. The routes (server/routes/) only translate their API's
fields in and format the outputs out.

Errors a request can cause are raised here as ApiError (400 naming the
field) before anything is queued; a request whose client leaves is
cancelled (the AsyncEngine posts the abort; the next step frees its blocks).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import Request

from llamajet.engine.output import ChoiceOutput, RequestOutputs, TokenOut, token_piece
from llamajet.engine.sampling import SamplingParams
from llamajet.engine.sequence import StreamEvent
from llamajet.errors import LlamajetError, RequestError
from llamajet.server import tools as toolmod
from llamajet.server.errors import ApiError
from llamajet.server.grammar import Grammars
from llamajet.server.state import ServerState

GONE = object()  # the client disconnected


# ---------------------------------------------------------------- sampling


def sampling_params(llm, n_prompt: int, max_tokens: int | None, *, prompt_param: str = "prompt",
                    max_tokens_param: str = "max_tokens", logit_bias: dict | None = None,
                    stop_token_ids: list[int] | None = None, **fields) -> SamplingParams:
    """SamplingParams for a prompt of n_prompt tokens (max_tokens None: up to
    the context's end); the context and vocabulary checks name the request's
    own fields."""
    ctx = llm.max_model_len
    if max_tokens is not None and n_prompt + max_tokens > ctx:
        raise ApiError(400, f"prompt has {n_prompt} tokens and {max_tokens_param} is {max_tokens}: "
                       f"{n_prompt + max_tokens} exceeds the context of {ctx} tokens", param=max_tokens_param,
                       code="context_length_exceeded")
    if n_prompt >= ctx and max_tokens != 0:  # (a prompt scored only may fill the context)
        raise ApiError(400, f"prompt has {n_prompt} tokens but the context holds {ctx} (prompt + at least "
                       "one new token)", param=prompt_param, code="context_length_exceeded")
    vocab = llm.config.vocab_size
    bias = {}
    for k, v in (logit_bias or {}).items():
        if not 0 <= int(k) < vocab:
            raise ApiError(400, f"logit_bias: token id {k} is outside the vocabulary (0..{vocab - 1})",
                           param="logit_bias")
        bias[int(k)] = v
    for t in stop_token_ids or []:
        if not 0 <= t < vocab:
            raise ApiError(400, f"stop_token_ids: {t} is outside the vocabulary", param="stop_token_ids")
    try:
        return SamplingParams(max_tokens=max_tokens if max_tokens is not None else ctx - n_prompt,
                              logit_bias=bias, stop_token_ids=tuple(stop_token_ids or ()), **fields)
    except RequestError as e:
        raise ApiError(400, str(e))


def openai_sampling(req, n_prompt: int, max_tokens: int | None, logprobs: int | None, llm,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """The sampling fields chat and completions share (protocol._Sampling)."""
    return sampling_params(
        llm, n_prompt, max_tokens, prompt_param="messages" if hasattr(req, "messages") else "prompt",
        prompt_logprobs=prompt_logprobs,
        logit_bias=req.logit_bias, stop_token_ids=req.stop_token_ids,
        temperature=req.temperature, top_k=max(req.top_k, 0), top_p=req.top_p, min_p=req.min_p,
        repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, seed=req.seed, stop=tuple(req.stop or ()),
        ignore_eos=req.ignore_eos, logprobs=logprobs, n=req.n, speculative=req.speculative)


# ---------------------------------------------------------------- chat prompts and tools


@dataclass
class ChatPlan:
    """A chat prompt and how its reply is read: `tools` (OpenAI function tool
    dicts) when the reply may be a call, `named` when one is forced."""

    ids: list[int]
    tools: list[dict] = field(default_factory=list)
    use_tools: bool = False
    named: str | None = None
    required: bool = False

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    def calls(self, text: str) -> list[dict] | None:
        """The OpenAI tool_calls entries in a finished reply, or None (text)."""
        return toolmod.parse_calls(text, self.names) if self.use_tools else None


def plan_chat(llm, msgs: list[dict], tools: list[dict], choice: str | None, named: str | None = None, *,
              param: str = "messages", choice_param: str = "tool_choice", structured: bool = False) -> ChatPlan:
    """msgs: messages as the chat template takes them; choice: "none" |
    "auto" | "required" | None (auto with tools, else none); named: the one
    function a call must be to (choice is then ignored). `structured`: the
    request also asks for a response format (refused with tools in use)."""
    tok = llm.tokenizer
    if named is not None:
        choice = "named"
        if named not in {t["function"]["name"] for t in tools}:
            raise ApiError(400, f"{choice_param} names {named!r}, which is not in tools", param=choice_param)
    elif choice is None:
        choice = "auto" if tools else "none"
    elif choice in ("required", "auto") and not tools:
        raise ApiError(400, f"{choice_param} {choice!r} needs tools", param=choice_param)
    use_tools = bool(tools) and choice != "none"
    if use_tools and structured:
        raise ApiError(400, "response_format cannot be combined with tools", param="response_format")
    extra = {}
    if use_tools:
        if toolmod.template_shows_tools(tok.chat_template):
            extra["tools"] = tools
        else:
            msgs = [{"role": "system", "content": toolmod.system_prompt(tools)}] + msgs
    try:
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, **extra)
    except LlamajetError as e:
        raise ApiError(400, f"{param}: {e}", param=param)
    ids = tok.encode(text, add_special_tokens=False)
    return ChatPlan(ids, tools if use_tools else [], use_tools, named, choice == "required")


async def chat_constraint(state: ServerState, plan: ChatPlan, response_format: tuple[str, Any] | None,
                          tok) -> Any:
    """The grammar a reply must follow: one call when a call is forced, or
    the response format's JSON (`("json_object" | "json_schema", schema)`)."""
    if plan.use_tools and (plan.required or plan.named):
        fmt = toolmod.call_format(tok.chat_template)
        return await asyncio.to_thread(state.grammars.constraint,
                                       toolmod.call_grammar(plan.tools, plan.named, fmt, tok), "tools")
    if response_format is not None:
        kind, schema = response_format
        return await asyncio.to_thread(state.grammars.constraint,
                                       Grammars.from_json_schema(schema if kind == "json_schema" else None))
    return None


# ---------------------------------------------------------------- running


@dataclass
class Job:
    """One prompt's generation (a completions request has several)."""

    ids: list[int]
    params: SamplingParams
    constraint: Any = None


class Run:
    """A request's jobs in the engine. Choice k*n + i is choice i of job k.

        run = Run(state, llm, request, jobs, t0)
        if not await run.start(): ...            # the client left
        async for choice, tok, ev in run.events(): ...   # streamed
        or: if not await run.drain(): ...        # collected
        run.outputs.choices[...]                 # text, tokens, finish reasons
    """

    def __init__(self, state: ServerState, llm, request: Request, jobs: list[Job], t0: float) -> None:
        self.state, self.llm, self.request, self.jobs, self.t0 = state, llm, request, jobs, t0
        self.n = jobs[0].params.n
        self.outputs = RequestOutputs(len(jobs) * self.n)
        self._infos: list[dict] = [{} for _ in jobs]
        base = id(request) * 1000
        self._gens = [_events(state, llm, base + k, j.ids, j.params, j.constraint, t0, self._infos[k])
                      for k, j in enumerate(jobs)]
        self._firsts: list = []
        self.first_token_at: float | None = None
        # the access log line reads these counts when the response has been sent (server/log.py)
        request.state.llamajet_access = _AccessCounts(self)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(j.ids) for j in self.jobs)

    def prompt_logprobs(self, k: int) -> list | None:
        """Job k's prompt logprobs (engine: Sequence.prompt_logprobs; entry 0
        None, then (logprob, top)), once its prefill is done."""
        info = self._infos[k]
        return info["group"][0].prompt_logprobs if "group" in info else None

    @property
    def cached_tokens(self) -> int:
        return sum(i["group"][0].num_cached_tokens for i in self._infos if "group" in i)

    def usage(self) -> dict:
        return usage(self.prompt_tokens, self.outputs.num_generated, self.cached_tokens)

    async def start(self) -> bool:
        """Queues every job and waits for each one's first event, so a request
        the engine refuses is a 400 before any byte is sent. False: the client
        left meanwhile (everything is cancelled)."""
        try:
            firsts = await collect_or_cancel(self.request, asyncio.gather(*(_first(g) for g in self._gens)))
        except RequestError as e:
            await self.close()
            raise ApiError(400, str(e))
        except Exception as e:
            raise await self._failed(e)
        if firsts is GONE:
            await self.close()
            return False
        self._firsts = list(firsts)
        return True

    async def close(self) -> None:
        for g in self._gens:
            await g.aclose()

    async def events(self) -> AsyncIterator[tuple[ChoiceOutput, TokenOut | None, StreamEvent]]:
        """Every event, as it comes, added to its choice's output first."""
        async for k, ev in self._merged():
            choice, tok = self.outputs.add(k * self.n + ev.index, ev)
            if tok is not None and self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            yield choice, tok, ev

    async def drain(self) -> bool:
        """Collects every event; False when the client left first."""
        async def all_():
            async for _ in self.events():
                pass
            return True

        try:
            return await collect_or_cancel(self.request, all_()) is not GONE
        except ApiError:
            raise
        except Exception as e:
            raise await self._failed(e)

    async def _failed(self, e: Exception) -> ApiError:
        """A failure of the engine (a step that raised) as a 500 the error
        handlers answer like any ApiError: an exception left unhandled makes
        the server close the connection, and the client's next request on it
        fails too."""
        await self.close()
        return ApiError(500, f"internal error: {type(e).__name__}: {e}", "internal_error")

    async def _merged(self) -> AsyncIterator[tuple[int, StreamEvent]]:
        if len(self._gens) == 1:  # no queue hop for the common case
            g = self._gens[0]
            try:
                if self._firsts[0] is not None:
                    yield 0, self._firsts[0]
                async for ev in g:
                    yield 0, ev
            finally:
                await g.aclose()
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(k, g, first):
            try:
                if first is not None:
                    await q.put((k, first))
                async for ev in g:
                    await q.put((k, ev))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                await q.put((k, e))
            finally:
                await q.put((k, None))

        tasks = [asyncio.ensure_future(pump(k, g, f)) for k, (g, f) in enumerate(zip(self._gens, self._firsts))]
        left = len(tasks)
        try:
            while left:
                k, ev = await q.get()
                if ev is None:
                    left -= 1
                    continue
                if isinstance(ev, BaseException):
                    raise ev
                yield k, ev
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.close()


class _AccessCounts:
    """A Run's counts for the access line, read (as a dict's get) when it is written."""

    def __init__(self, run: "Run") -> None:
        self.run = run

    def get(self, key, default=None):
        r = self.run
        if key == "prompt_tokens":
            return r.prompt_tokens
        if key == "completion_tokens":
            return r.outputs.num_generated
        if key == "ttft":
            return None if r.first_token_at is None else r.first_token_at - r.t0
        return default


async def _events(state: ServerState, llm, key: int, ids: list[int], params: SamplingParams, constraint,
                  t0: float, info: dict) -> AsyncIterator[StreamEvent]:
    """One job's StreamEvents; metrics updated as they pass.
    info["group"]: its Sequences, once they exist."""
    m, name = state.metrics, state.settings.model_name
    last: dict[int, float] = {}

    def on_open(group):
        state.groups[key] = group
        info["group"] = group

    with state.in_flight():  # until the last event is handed over
        try:
            async for ev in llm.async_engine.stream(ids, params, constraint, on_open):
                now = time.perf_counter()
                if ev.token_id is not None:
                    m.generation_tokens.labels(name).inc()
                    prev = last.get(ev.index)
                    if prev is None:
                        if not last:
                            m.ttft.labels(name).observe(now - t0)
                    else:
                        m.itl.labels(name).observe(now - prev)
                    last[ev.index] = now
                if ev.finish_reason is not None:
                    m.success.labels(name, ev.finish_reason).inc()
                yield ev
        finally:
            state.groups.pop(key, None)
            if "group" in info:
                head = info["group"][0]
                m.prompt_tokens.labels(name).inc(len(ids))
                m.prefix_queries.labels(name).inc(len(ids))
                m.prefix_hits.labels(name).inc(head.num_cached_tokens)
                if head.admit_time is not None:
                    m.queue.labels(name).observe(max(head.admit_time - t0, 0.0))
                m.e2e.labels(name).observe(time.perf_counter() - t0)


async def _first(gen):
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        return None


async def _until_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def collect_or_cancel(request: Request, coro):
    """Runs `coro`; cancels it (and returns GONE) when the client
    disconnects first."""
    task = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        return GONE
    finally:
        watch.cancel()


# ---------------------------------------------------------------- formatting helpers


def sse(obj, event: str | None = None) -> str:
    data = f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"
    return f"event: {event}\n{data}" if event else data


def usage(n_prompt: int, n_out: int, cached: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": cached}}


def piece(llm, tok: int) -> tuple[str, list[int]]:
    """A token's text (invalid UTF-8 replaced) and its bytes (engine/output.token_piece)."""
    return token_piece(llm.tokenizer, tok)


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex
