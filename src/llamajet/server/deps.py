"""Typed FastAPI dependencies: the server state, the ready model, a parsed
and model-checked body, admission.

A generation route declares, in this order,

    req: Annotated[ChatCompletionRequest, Depends(served(ChatCompletionRequest))]
    llm: ReadyLLM
    admit: Admission

and FastAPI resolves them in that order, which is the admission order the
README gives: a bad body is a 400 naming the field, then a loading or
draining server a 503, then an unknown model a 404; `admit()` (a full queue:
429) is called by the route once the request is known to be servable, so a
bad prompt is a 400 even when the queue is full.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import TYPE_CHECKING, Annotated, Any, Callable

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from llamajet.server.errors import ApiError
from llamajet.server.state import ServerState

if TYPE_CHECKING:  # the server reaches the model through the state; no import at run time
    from llamajet.api import LLM


def get_state(request: Request) -> ServerState:
    return request.app.state.llamajet


State = Annotated[ServerState, Depends(get_state)]


def ready_llm(state: State) -> "LLM":
    if state.draining:
        raise ApiError(503, "the server is shutting down", "service_unavailable", code="draining")
    if state.llm is None:
        raise ApiError(503, "the model is still loading" if not state.load_error else
                       f"the model failed to load: {state.load_error}", "service_unavailable", code="not_ready")
    return state.llm


ReadyLLM = Annotated[Any, Depends(ready_llm)]


def check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.settings.model_name:
        raise ApiError(404, f"model {name!r} does not exist; this server serves {state.settings.model_name!r}",
                       "not_found_error", "model", "model_not_found")


@lru_cache(maxsize=None)
def parsed(cls):
    """The dependency that reads the body as `cls` (one per class, so FastAPI's
    per-request cache shares it). JSON is read whatever the content-type
    says, as clients are lax about it."""

    async def parse_body(request: Request):
        body = await request.body()
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as e:
            raise ApiError(400, f"malformed JSON: {e}", param=None, code="invalid_json")
        if not isinstance(data, dict):
            raise ApiError(400, "the body must be a JSON object", code="invalid_json")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise RequestValidationError(e.errors())

    parse_body.__name__ = f"parse_{cls.__name__}"
    return parse_body


@lru_cache(maxsize=None)
def served(cls):
    """Parsed as `cls`, the model loaded, and `model` (when the body names
    one) this server's."""
    body = parsed(cls)

    async def checked(state: State, req=Depends(body), _llm: Any = Depends(ready_llm)):
        check_model(state, getattr(req, "model", None))
        return req

    checked.__name__ = f"served_{cls.__name__}"
    return checked


def admission(state: State) -> Callable[[], None]:
    def admit() -> None:
        _, waiting = state.counts()
        limit = state.settings.max_queued_requests
        if waiting >= limit:
            raise ApiError(429, f"{waiting} requests are already waiting (--max-queued-requests {limit}); "
                           "retry later", "rate_limit_exceeded", code="queue_full",
                           headers={"Retry-After": str(state.settings.retry_after_s)})

    return admit


Admission = Annotated[Callable[[], None], Depends(admission)]
