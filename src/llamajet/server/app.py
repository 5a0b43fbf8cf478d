"""The HTTP service (FastAPI) over one LLM: state, lifespan, the guard,
error handlers and the routers of each API family (server/routes/).

    app = create_app(ServerSettings(), load=lambda: LLM(path))

One engine per process, stepped by the AsyncEngine's driver in a worker
thread: handlers only tokenize, queue a request and relay its events, so
the event loop never waits on a step. The port answers while the model
loads (`/health` 200, `/ready` 503 until loaded and warmed up).

Admission, in order: auth (`/v1/*`, `/tokenize`, `/detokenize`) -> 401;
body size -> 413; malformed JSON or a bad field -> 400 naming it; loading
or draining -> 503; unknown model -> 404; prompt + max_tokens beyond the
context -> 400 naming both numbers; a full waiting queue -> 429 with
Retry-After. Errors come in the shape of the request's API family
(server/errors.py).

A client that goes away (mid-stream, or before its first token on a
non-streamed request) ends its request: the stream is cancelled, the
AsyncEngine posts the abort and the next step frees its KV blocks.

Forced drain (server/run.py): every request in flight ends with
finish_reason "abort" in a last well-formed chunk, then `[DONE]`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import asynccontextmanager
from typing import Any, Callable

from fastapi import FastAPI
from starlette.routing import Match

from llamajet.engine.sampling import SamplingParams
from llamajet.server.errors import ApiError, error_body, install_handlers, render
from llamajet.server import log
from llamajet.server.grammar import Grammars
from llamajet.server.routes import anthropic, basic, embeddings, openai_chat, openai_completions, responses, ui
from llamajet.server.state import ServerSettings, ServerState

__all__ = ["ApiError", "ServerSettings", "ServerState", "create_app", "error_body"]

ROUTERS = (basic.router, openai_chat.router, openai_completions.router, responses.router, anthropic.router,
           embeddings.router)


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
        log.server_log.info(log.banner(llm, settings.model_name))

    def load_in_thread() -> None:
        try:
            install(load())
        except Exception as e:  # stays not ready; /ready says why
            state.load_error = f"{type(e).__name__}: {e}"
            log.server_log.error("the model failed to load: %s", state.load_error)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if callable(load):
            threading.Thread(target=load_in_thread, name="llamajet-load", daemon=True).start()
        else:
            await asyncio.to_thread(install, load)
        yield

    app = FastAPI(title="llamajet", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.llamajet = state
    routers = ROUTERS + ((ui.router,) if settings.ui else ())
    for r in routers:
        app.include_router(r)
    install_handlers(app)
    # the routers' own routes (FastAPI wraps an included router; its routes keep their paths here)
    leaf = [r for router in routers for r in router.routes]
    app.add_middleware(Guard, state=state, routes=lambda: leaf)
    return app


class _BodyTooLarge(Exception):
    pass


QUIET = ("/health", "/ready", "/metrics")  # probes and scrapes: seconds apart, forever; not logged
PROTECTED = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info")


class Guard:
    """ASGI middleware: HTTP counts by route (the app's own route paths, so
    a new route is counted under its name without a list to keep), auth and
    body size (also for chunked bodies, counted as they arrive)."""

    def __init__(self, inner, state: ServerState, routes: Callable[[], list]) -> None:
        self.inner, self.state, self.routes = inner, state, routes

    def route_of(self, scope) -> str:
        """The path of the route that matched (a wrong method too: its path
        matched), else "other"."""
        partial = None
        for r in self.routes():
            if getattr(r, "path", None) is None:
                continue
            match = r.matches(scope)[0]
            if match is Match.FULL:
                return r.path
            if match is Match.PARTIAL and partial is None:
                partial = r.path
        return partial or "other"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.inner(scope, receive, send)
        settings = self.state.settings
        path = scope["path"]
        status_box = {"status": 500}
        t0 = time.perf_counter()
        # routes copy the scope but share this dict: request.state.llamajet_access lands here
        req_state = scope.setdefault("state", {})

        async def send_counted(msg):
            if msg["type"] == "http.response.start":
                status_box["status"] = msg["status"]
            await send(msg)

        async def reply(e: ApiError):
            await render(path, scope["headers"], e)(scope, receive, send_counted)

        try:
            if path.startswith(PROTECTED):
                headers = dict(scope["headers"])
                if settings.api_key is not None:
                    # OpenAI's clients send Authorization: Bearer, Anthropic's x-api-key; either is enough
                    auth = headers.get(b"authorization", b"").decode("latin-1")
                    xkey = headers.get(b"x-api-key", b"").decode("latin-1")
                    if auth != f"Bearer {settings.api_key}" and xkey != settings.api_key:
                        return await reply(ApiError(401, "missing or wrong API key (Authorization: Bearer <key>, "
                                                    "or x-api-key: <key>)", "authentication_error",
                                                    code="invalid_api_key"))
                length = headers.get(b"content-length")
                limit = settings.max_body_bytes
                if length is not None and length.isdigit() and int(length) > limit:
                    return await reply(ApiError(413, f"request body of {int(length)} bytes is over the limit of "
                                                f"{limit}", "invalid_request_error", code="request_too_large"))
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
                    return await reply(ApiError(413, f"request body is over the limit of {limit} bytes",
                                                "invalid_request_error", code="request_too_large"))
            return await self.inner(scope, receive, send_counted)
        finally:
            m = self.state.metrics
            status = status_box["status"]
            if path not in QUIET:
                log.access(scope["method"], path, status, time.perf_counter() - t0,
                           req_state.get("llamajet_access"))
            m.http.labels(self.route_of(scope), str(status)).inc()
            if path.startswith("/v1/") and status_box["status"] >= 400:
                m.failure.labels(settings.model_name, str(status_box["status"])).inc()
