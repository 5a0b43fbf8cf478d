"""The OpenAI-compatible HTTP service (FastAPI) over one LLM.

    app = create_app(ServerSettings(), load=lambda: LLM(path))

One engine per process, stepped by the AsyncEngine's driver in a worker
thread: handlers only tokenize, queue a request and relay its events, so
the event loop never waits on a step. The port answers while the model
loads (`/health` 200, `/ready` 503 until loaded and warmed up).

Admission, in order: draining -> 503; auth (`/v1/*`, `/tokenize`,
`/detokenize`) -> 401; body size -> 413; malformed JSON or a bad field ->
400 naming it; unknown model -> 404; prompt + max_tokens beyond the context
-> 400 naming both numbers; a full waiting queue -> 429 with Retry-After.
Every error is OpenAI-shaped: {"error": {"message", "type", "param", "code"}}.

A client that goes away (mid-stream, or before its first token on a
non-streamed request) ends its request: the stream is cancelled, the
AsyncEngine posts the abort and the next step frees its KV blocks.

Forced drain (server/run.py): every request in flight ends with
finish_reason "abort" in a last well-formed chunk, then `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from llamajet.engine.sampling import SamplingParams
from llamajet.errors import LlamajetError, RequestError
from llamajet.server import tools as toolmod
from llamajet.server.grammar import Grammars
from llamajet.server.metrics import Metrics
from llamajet.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                      MAX_PROMPTS, TokenizeRequest)


@dataclass(frozen=True)
class ServerSettings:
    model_name: str = "llamajet"      # --served-model-name (the `model` clients must send)
    api_key: str | None = None        # bearer token for /v1/*; None = open
    max_queued_requests: int = 256    # requests waiting for admission before 429
    max_body_bytes: int = 4 << 20     # request bodies larger than this get 413
    drain_timeout: float = 30.0       # seconds in-flight requests get after SIGTERM
    retry_after_s: int = 1            # Retry-After on 429


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}


def error_body(status: int, message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code or str(status)}}


class ServerState:
    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.llm = None
        self.grammars: Grammars | None = None
        self.load_error: str | None = None
        self.draining = False
        self.inflight = 0                      # generation requests not yet answered in full
        self.groups: dict[int, list] = {}      # request key -> its Sequences (loop thread only)
        self.metrics = Metrics(settings.model_name)
        self.fingerprint = "fp_llamajet"
        self.idle = asyncio.Event()            # set while inflight == 0 (drain waits on it)
        self.idle.set()

    @property
    def ready(self) -> bool:
        return self.llm is not None and not self.draining

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests: admitted to the batch or not yet."""
        running = waiting = 0
        for group in self.groups.values():
            if group[0].admit_time is None:
                waiting += 1
            elif not all(s.finished for s in group):
                running += 1
        return running, waiting


def create_app(settings: ServerSettings, load: Callable[[], Any] | Any) -> FastAPI:
    """The app. `load`: the LLM, or a function that builds it (run in a
    thread at startup, so the port answers meanwhile)."""
    state = ServerState(settings)

    def install(llm) -> None:
        llm.generate([[llm.tokenizer.bos_id or 0]], SamplingParams(max_tokens=1, temperature=0))  # warm-up
        state.grammars = Grammars(llm.tokenizer, llm.config.vocab_size)
        st = llm.engine.runner
        state.fingerprint = f"fp_{st.isa}_{llm.runtime.kernels}"
        state.llm = llm

    def load_in_thread() -> None:
        try:
            install(load())
        except Exception as e:  # stays not ready; /ready says why
            state.load_error = f"{type(e).__name__}: {e}"

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if callable(load):
            threading.Thread(target=load_in_thread, name="llamajet-load", daemon=True).start()
        else:
            await asyncio.to_thread(install, load)
        yield

    app = FastAPI(title="llamajet", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.llamajet = state

    # ------------------------------------------------------------------ middleware

    protected = ("/v1/", "/tokenize", "/detokenize")

    class Guard:
        """ASGI middleware: HTTP counts, auth, body size (also for chunked
        bodies, counted as they arrive)."""

        def __init__(self, inner) -> None:
            self.inner = inner

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http":
                return await self.inner(scope, receive, send)
            path = scope["path"]
            status_box = {"status": 500}

            async def send_counted(msg):
                if msg["type"] == "http.response.start":
                    status_box["status"] = msg["status"]
                await send(msg)

            async def reply(status: int, body: dict, headers: dict | None = None):
                resp = JSONResponse(body, status_code=status, headers=headers)
                await resp(scope, receive, send_counted)

            try:
                if path.startswith(protected):
                    headers = dict(scope["headers"])
                    if settings.api_key is not None:
                        auth = headers.get(b"authorization", b"").decode("latin-1")
                        if auth != f"Bearer {settings.api_key}":
                            return await reply(401, error_body(401, "missing or wrong API key (Authorization: "
                                                               "Bearer <key>)", "authentication_error",
                                                               code="invalid_api_key"))
                    length = headers.get(b"content-length")
                    limit = settings.max_body_bytes
                    if length is not None and length.isdigit() and int(length) > limit:
                        return await reply(413, error_body(413, f"request body of {int(length)} bytes is over the "
                                                           f"limit of {limit}", "invalid_request_error",
                                                           code="request_too_large"))
                    seen = {"n": 0}

                    async def receive_limited():
                        msg = await receive()
                        if msg["type"] == "http.request":
                            seen["n"] += len(msg.get("body", b""))
                            if seen["n"] > limit:
                                raise _BodyTooLarge()
                        return msg

                    try:
                        return await self.inner(scope, receive_limited, send_counted)
                    except _BodyTooLarge:
                        return await reply(413, error_body(413, f"request body is over the limit of {limit} bytes",
                                                           "invalid_request_error", code="request_too_large"))
                return await self.inner(scope, receive, send_counted)
            finally:
                route = path if path in _ROUTES else "other"
                state.metrics.http.labels(route, str(status_box["status"])).inc()
                if path.startswith("/v1/") and status_box["status"] >= 400:
                    state.metrics.failure.labels(settings.model_name, str(status_box["status"])).inc()

    app.add_middleware(Guard)

    # ------------------------------------------------------------------ errors

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return JSONResponse(error_body(e.status, e.message, e.type, e.param, e.code), status_code=e.status,
                            headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            msg = f"malformed JSON: {first.get('msg')}"
            param = None
        elif first.get("type") == "extra_forbidden":
            msg = f"unsupported field {param!r}: llamajet does not implement it (it is refused, not ignored)"
        else:
            msg = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        return JSONResponse(error_body(400, msg, "invalid_request_error", param, "invalid_request"),
                            status_code=400)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        return JSONResponse(error_body(500, f"internal error: {type(e).__name__}: {e}", "internal_error"),
                            status_code=500)

    @app.exception_handler(LlamajetError)
    async def _ours(request: Request, e: LlamajetError):
        return JSONResponse(error_body(400, str(e), "invalid_request_error", None, "invalid_request"),
                            status_code=400)

    # ------------------------------------------------------------------ health and metrics

    @app.get("/health")
    async def health():
        return PlainTextResponse("ok")

    @app.get("/ready")
    async def ready():
        if state.ready:
            return PlainTextResponse("ready")
        why = ("draining" if state.draining else f"load failed: {state.load_error}" if state.load_error
               else "loading")
        return PlainTextResponse(why, status_code=503)

    @app.get("/metrics")
    async def metrics():
        running, waiting = state.counts()
        state.metrics.refresh(state.llm.engine if state.llm else None, running, waiting)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------------ helpers

    def llm_or_503():
        if state.draining:
            raise ApiError(503, "the server is shutting down", "service_unavailable", code="draining")
        if state.llm is None:
            raise ApiError(503, "the model is still loading" if not state.load_error else
                           f"the model failed to load: {state.load_error}", "service_unavailable",
                           code="not_ready")
        return state.llm

    def check_model(name: str | None) -> None:
        if name is not None and name != settings.model_name:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {settings.model_name!r}",
                           "not_found_error", "model", "model_not_found")

    async def parse(request: Request, cls):
        body = await request.body()
        try:
            data = json.loads(body)
        except ValueError as e:
            raise ApiError(400, f"malformed JSON: {e}", param=None, code="invalid_json")
        if not isinstance(data, dict):
            raise ApiError(400, "the body must be a JSON object", code="invalid_json")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise RequestValidationError(e.errors())

    async def begin(request: Request, cls):
        """(arrival time, the parsed request, the LLM) of a generation request."""
        t0 = time.perf_counter()
        req = await parse(request, cls)
        llm = llm_or_503()
        check_model(req.model)
        return t0, req, llm

    def sampling(req, n_prompt: int, max_tokens: int | None, logprobs: int | None, llm) -> SamplingParams:
        ctx = llm.max_model_len
        if max_tokens is not None and n_prompt + max_tokens > ctx:
            raise ApiError(400, f"prompt has {n_prompt} tokens and max_tokens is {max_tokens}: "
                           f"{n_prompt + max_tokens} exceeds the context of {ctx} tokens", param="max_tokens",
                           code="context_length_exceeded")
        if n_prompt >= ctx:
            raise ApiError(400, f"prompt has {n_prompt} tokens but the context holds {ctx} (prompt + at least "
                           "one new token)", param="messages" if hasattr(req, "messages") else "prompt",
                           code="context_length_exceeded")
        vocab = llm.config.vocab_size
        bias = {}
        for k, v in (req.logit_bias or {}).items():
            if not 0 <= int(k) < vocab:
                raise ApiError(400, f"logit_bias: token id {k} is outside the vocabulary (0..{vocab - 1})",
                               param="logit_bias")
            bias[int(k)] = v
        for t in req.stop_token_ids or []:
            if not 0 <= t < vocab:
                raise ApiError(400, f"stop_token_ids: {t} is outside the vocabulary", param="stop_token_ids")
        try:
            return SamplingParams(
                max_tokens=max_tokens if max_tokens is not None else ctx - n_prompt,
                temperature=req.temperature, top_k=max(req.top_k, 0), top_p=req.top_p, min_p=req.min_p,
                repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty, seed=req.seed, stop=tuple(req.stop or ()),
                stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos, logit_bias=bias,
                logprobs=logprobs, n=req.n)
        except RequestError as e:
            raise ApiError(400, str(e))

    async def admit() -> None:
        _, waiting = state.counts()
        if waiting >= settings.max_queued_requests:
            raise ApiError(429, f"{waiting} requests are already waiting (--max-queued-requests "
                           f"{settings.max_queued_requests}); retry later", "rate_limit_exceeded",
                           code="queue_full", headers={"Retry-After": str(settings.retry_after_s)})

    async def events(llm, key: int, ids: list[int], params: SamplingParams, constraint,
                     t0: float, info: dict) -> AsyncIterator:
        """The request's StreamEvents; metrics updated as they pass.
        info["group"]: its Sequences, once they exist."""
        m, name = state.metrics, settings.model_name
        last: dict[int, float] = {}

        def on_open(group):
            state.groups[key] = group
            info["group"] = group

        state.inflight += 1  # until the last event is handed over (drain waits for these)
        state.idle.clear()
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
            state.inflight -= 1
            if state.inflight == 0:
                state.idle.set()
            state.groups.pop(key, None)
            if "group" in info:
                head = info["group"][0]
                m.prompt_tokens.labels(name).inc(len(ids))
                m.prefix_queries.labels(name).inc(len(ids))
                m.prefix_hits.labels(name).inc(head.num_cached_tokens)
                if head.admit_time is not None:
                    m.queue.labels(name).observe(max(head.admit_time - t0, 0.0))
                m.e2e.labels(name).observe(time.perf_counter() - t0)

    async def until_disconnect(request: Request) -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    async def first_event(gen):
        try:
            return await gen.__anext__()
        except StopAsyncIteration:
            return None

    async def collect_or_cancel(request: Request, coro):
        """Runs `coro`; cancels it (and returns _GONE) when the client
        disconnects first."""
        task = asyncio.ensure_future(coro)
        watch = asyncio.ensure_future(until_disconnect(request))
        try:
            done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
            return _GONE
        finally:
            watch.cancel()

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"

    def usage(n_prompt: int, n_out: int, cached: int) -> dict:
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def piece(llm, tok: int) -> tuple[str, list[int]]:
        b = llm.tokenizer.token_bytes(tok)
        return b.decode("utf-8", errors="replace"), list(b)

    def chat_logprob(llm, ev) -> dict:
        tok, b = piece(llm, ev.token_id)
        tops = []
        for i, lp in ev.top_logprobs:
            t, bb = piece(llm, i)
            tops.append({"token": t, "logprob": lp, "bytes": bb})
        return {"token": tok, "logprob": ev.logprob, "bytes": b, "top_logprobs": tops}

    # ------------------------------------------------------------------ routes

    @app.get("/v1/models")
    async def models():
        llm = llm_or_503()
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": 0,
                                            "owned_by": "llamajet", "max_model_len": llm.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await parse(request, TokenizeRequest)
        llm = llm_or_503()
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
                [toolmod.history_message(m) for m in req.messages],
                add_generation_prompt=req.add_generation_prompt), add_special_tokens=False)
        else:
            ids = llm.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": llm.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await parse(request, DetokenizeRequest)
        llm = llm_or_503()
        check_model(req.model)
        try:
            return {"prompt": llm.tokenizer.decode(req.tokens, skip_special_tokens=False)}
        except LlamajetError as e:
            raise ApiError(400, str(e), param="tokens")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        t0, req, llm = await begin(request, ChatCompletionRequest)
        tok = llm.tokenizer
        tools = [t.model_dump() for t in req.tools] if req.tools else []
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
        named = None
        if not isinstance(choice, str):
            named = choice.function.name
            if named not in {t["function"]["name"] for t in tools}:
                raise ApiError(400, f"tool_choice names {named!r}, which is not in tools", param="tool_choice")
        elif choice in ("required", "auto") and not tools:
            raise ApiError(400, f"tool_choice {choice!r} needs tools", param="tool_choice")
        use_tools = bool(tools) and choice != "none"
        if use_tools and req.response_format is not None and req.response_format.type != "text":
            raise ApiError(400, "response_format cannot be combined with tools", param="response_format")
        msgs = [toolmod.history_message(m) for m in req.messages]
        extra = {}
        if use_tools:
            if toolmod.template_shows_tools(tok.chat_template):
                extra["tools"] = tools
            else:
                msgs = [{"role": "system", "content": toolmod.system_prompt(tools)}] + msgs
        try:
            text = tok.apply_chat_template(msgs, add_generation_prompt=True, **extra)
        except LlamajetError as e:
            raise ApiError(400, f"messages: {e}", param="messages")
        ids = tok.encode(text, add_special_tokens=False)
        max_tokens = req.max_completion_tokens or req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if req.top_logprobs and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        params = sampling(req, len(ids), max_tokens, logprobs, llm)
        fmt = toolmod.call_format(tok.chat_template)
        constraint = None
        if use_tools and (choice == "required" or named):
            constraint = await asyncio.to_thread(
                state.grammars.constraint, toolmod.call_grammar(tools, named, fmt, tok), "tools")
        elif req.response_format is not None and req.response_format.type != "text":
            rf = req.response_format
            schema = rf.json_schema.schema_ if rf.type == "json_schema" else None
            constraint = await asyncio.to_thread(state.grammars.constraint, Grammars.from_json_schema(schema))
        await admit()
        names = {t["function"]["name"] for t in tools}
        rid = "chatcmpl-" + uuid.uuid4().hex
        created = int(time.time())
        key = id(request)
        info: dict = {}
        gen = events(llm, key, ids, params, constraint, t0, info)

        def cached() -> int:
            return info["group"][0].num_cached_tokens if "group" in info else 0
        try:  # bad requests fail here, before any byte is sent; a client gone by now cancels it
            first = await collect_or_cancel(request, first_event(gen))
        except RequestError as e:
            raise ApiError(400, str(e))
        if first is _GONE:
            return Response(status_code=499)
        base = {"id": rid, "created": created, "model": settings.model_name, "system_fingerprint": state.fingerprint}

        async def all_events():
            if first is not None:
                yield first
            async for ev in gen:
                yield ev

        def finish_of(reason: str, calls) -> str:
            return "tool_calls" if calls else reason

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def body():
                texts = {i: [] for i in range(params.n)}
                n_out = 0
                for i in range(params.n):
                    yield sse({**base, "object": "chat.completion.chunk",
                               "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}],
                               **({"usage": None} if include_usage else {})})
                async for ev in all_events():
                    if ev.token_id is not None:
                        n_out += 1
                    if use_tools:  # the reply is a call or text: known only at its end
                        texts[ev.index].append(ev.text)
                        if ev.finish_reason is None:
                            continue
                        whole = "".join(texts[ev.index])
                        calls = toolmod.parse_calls(whole, names)
                        delta = ({"tool_calls": [{"index": j, **c} for j, c in enumerate(calls)]} if calls
                                 else {"content": whole})
                        yield sse({**base, "object": "chat.completion.chunk",
                                   "choices": [{"index": ev.index, "delta": delta, "logprobs": None,
                                                "finish_reason": finish_of(ev.finish_reason, calls)}],
                                   **({"usage": None} if include_usage else {})})
                        continue
                    lp = ({"content": [chat_logprob(llm, ev)]} if params.logprobs is not None
                          and ev.token_id is not None and ev.logprob is not None else None)
                    if ev.text or lp is not None or ev.finish_reason is not None:
                        yield sse({**base, "object": "chat.completion.chunk",
                                   "choices": [{"index": ev.index, "delta": {"content": ev.text} if ev.text else {},
                                                "logprobs": lp, "finish_reason": ev.finish_reason}],
                                   **({"usage": None} if include_usage else {})})
                if include_usage:
                    yield sse({**base, "object": "chat.completion.chunk", "choices": [],
                               "usage": usage(len(ids), n_out, cached())})
                yield "data: [DONE]\n\n"

            return StreamingResponse(body(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": rid})

        async def collect():
            texts = {i: [] for i in range(params.n)}
            lps = {i: [] for i in range(params.n)}
            reasons = {}
            n_out = 0
            async for ev in all_events():
                texts[ev.index].append(ev.text)
                if ev.token_id is not None:
                    n_out += 1
                    if params.logprobs is not None and ev.logprob is not None:
                        lps[ev.index].append(chat_logprob(llm, ev))
                if ev.finish_reason is not None:
                    reasons[ev.index] = ev.finish_reason
            return texts, lps, reasons, n_out

        result = await collect_or_cancel(request, collect())
        if result is _GONE:  # the client left
            return Response(status_code=499)
        texts, lps, reasons, n_out = result
        choices = []
        for i in range(params.n):
            whole = "".join(texts[i])
            calls = toolmod.parse_calls(whole, names) if use_tools else None
            msg = ({"role": "assistant", "content": None, "tool_calls": calls} if calls
                   else {"role": "assistant", "content": whole})
            choices.append({"index": i, "message": msg,
                            "logprobs": {"content": lps[i]} if params.logprobs is not None else None,
                            "finish_reason": finish_of(reasons.get(i, "abort"), calls)})
        return {**base, "object": "chat.completion", "choices": choices,
                "usage": usage(len(ids), n_out, cached())}

    @app.post("/v1/completions")
    async def completions(request: Request):
        t0, req, llm = await begin(request, CompletionRequest)
        for f in ("suffix", "best_of"):
            if getattr(req, f) not in (None, 1 if f == "best_of" else None):
                raise ApiError(400, f"{f} is not supported", param=f)
        if req.echo:  # until the prompt's own logprobs are returned, echo would score every prompt 0
            raise ApiError(400, "echo is not supported yet: llamajet does not return the prompt's logprobs, "
                           "and without them a scoring client (lm-eval) would read wrong numbers", param="echo")
        p = req.prompt
        if isinstance(p, str):
            prompts = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        else:
            prompts = list(p)
        if not prompts:
            raise ApiError(400, "prompt is empty", param="prompt")
        if len(prompts) > MAX_PROMPTS:
            raise ApiError(400, f"at most {MAX_PROMPTS} prompts in one request", param="prompt")
        tok = llm.tokenizer
        encoded = []
        for x in prompts:
            if isinstance(x, str):
                if not x:
                    raise ApiError(400, "prompt is empty", param="prompt")
                encoded.append(tok.encode(x))
            else:
                bad = [t for t in x if not 0 <= t < llm.config.vocab_size]
                if bad or not x:
                    raise ApiError(400, f"prompt: token id {bad[0]} is outside the vocabulary" if bad
                                   else "prompt is empty", param="prompt")
                encoded.append(list(x))
        plist = [sampling(req, len(ids), req.max_tokens if req.max_tokens is not None else 16, req.logprobs, llm)
                 for ids in encoded]
        constraint_for = None
        if req.response_format is not None and req.response_format.type != "text":
            rf = req.response_format
            grammar = Grammars.from_json_schema(rf.json_schema.schema_ if rf.type == "json_schema" else None)
            constraint_for = grammar
        await admit()
        rid = "cmpl-" + uuid.uuid4().hex
        base = {"id": rid, "created": int(time.time()), "model": settings.model_name,
                "system_fingerprint": state.fingerprint}
        n = req.n
        gens, infos = [], []
        for k, (ids, params) in enumerate(zip(encoded, plist)):
            c = (await asyncio.to_thread(state.grammars.constraint, constraint_for)) if constraint_for else None
            infos.append({})
            gens.append(events(llm, id(request) * 1000 + k, ids, params, c, t0, infos[-1]))
        try:
            firsts = await collect_or_cancel(request, asyncio.gather(*(first_event(g) for g in gens)))
        except RequestError as e:
            for g in gens:
                await g.aclose()
            raise ApiError(400, str(e))
        if firsts is _GONE:
            for g in gens:
                await g.aclose()
            return Response(status_code=499)

        async def merged() -> AsyncIterator[tuple[int, Any]]:
            """(choice index, event) of every prompt's stream, as they come."""
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

            tasks = [asyncio.ensure_future(pump(k, g, f)) for k, (g, f) in enumerate(zip(gens, firsts))]
            left = len(tasks)
            try:
                while left:
                    k, ev = await q.get()
                    if ev is None:
                        left -= 1
                        continue
                    if isinstance(ev, BaseException):
                        raise ev
                    yield k * n + ev.index, ev
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                for g in gens:
                    await g.aclose()

        def lp_entry(ev, offset):
            t, _ = piece(llm, ev.token_id)
            return t, ev.logprob, {piece(llm, i)[0]: lp for i, lp in ev.top_logprobs}, offset

        total_prompt = sum(len(i) for i in encoded)

        def cached_now() -> int:
            return sum(i["group"][0].num_cached_tokens for i in infos if "group" in i)

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def body():
                n_out = 0
                offsets: dict[int, int] = {}
                cached = 0
                async for idx, ev in merged():
                    cached = max(cached, cached_now())
                    if ev.token_id is not None:
                        n_out += 1
                    lp = None
                    if req.logprobs is not None and ev.token_id is not None and ev.logprob is not None:
                        t, l, top, off = lp_entry(ev, offsets.get(idx, 0))
                        lp = {"tokens": [t], "token_logprobs": [l], "top_logprobs": [top], "text_offset": [off]}
                    offsets[idx] = offsets.get(idx, 0) + len(ev.text)
                    if ev.text or lp is not None or ev.finish_reason is not None:
                        yield sse({**base, "object": "text_completion",
                                   "choices": [{"index": idx, "text": ev.text, "logprobs": lp,
                                                "finish_reason": ev.finish_reason}],
                                   **({"usage": None} if include_usage else {})})
                if include_usage:
                    yield sse({**base, "object": "text_completion", "choices": [],
                               "usage": usage(total_prompt, n_out, cached)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(body(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": rid})

        async def collect():
            texts: dict[int, list[str]] = {}
            lps: dict[int, dict] = {}
            reasons: dict[int, str] = {}
            n_out = cached = 0
            async for idx, ev in merged():
                cached = max(cached, cached_now())
                texts.setdefault(idx, [])
                if ev.token_id is not None:
                    n_out += 1
                    if req.logprobs is not None and ev.logprob is not None:
                        d = lps.setdefault(idx, {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                 "text_offset": []})
                        t, l, top, off = lp_entry(ev, sum(len(x) for x in texts[idx]))
                        d["tokens"].append(t)
                        d["token_logprobs"].append(l)
                        d["top_logprobs"].append(top)
                        d["text_offset"].append(off)
                texts[idx].append(ev.text)
                if ev.finish_reason is not None:
                    reasons[idx] = ev.finish_reason
            return texts, lps, reasons, n_out, cached

        result = await collect_or_cancel(request, collect())
        if result is _GONE:
            return Response(status_code=499)
        texts, lps, reasons, n_out, cached = result
        choices = []
        for idx in range(len(encoded) * n):
            text = "".join(texts.get(idx, []))
            choices.append({"index": idx, "text": text,
                            "logprobs": lps.get(idx) if req.logprobs is not None else None,
                            "finish_reason": reasons.get(idx, "abort")})
        return {**base, "object": "text_completion", "choices": choices,
                "usage": usage(total_prompt, n_out, cached)}

    return app


class _BodyTooLarge(Exception):
    pass


_GONE = object()  # the client disconnected


_ROUTES = {"/health", "/ready", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions",
           "/tokenize", "/detokenize"}
