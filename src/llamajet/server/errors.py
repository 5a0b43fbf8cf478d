"""Errors in the shape of the API a request belongs to.

Two families: OpenAI's `{"error": {"message", "type", "param", "code"}}`
(chat, completions, Responses, embeddings, tokenize and every other path),
and Anthropic's `{"type": "error", "error": {"type", "message"}}` for
`/v1/messages*` or any request carrying an `anthropic-version` header (its
SDK sends one on every call, so a typo in the path still gets an error its
client can read). A handler raises ApiError with the OpenAI fields; the
family is chosen where the response is written, from the request alone.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from llamajet.errors import LlamajetError


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}


def error_body(status: int, message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code or str(status)}}


# Anthropic's error types by status (docs.anthropic.com, "Errors"). Loading
# and draining are 529 overloaded_error there, where OpenAI's routes say 503.
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    500: "api_error", 529: "overloaded_error"}


def is_anthropic(path: str, headers) -> bool:
    """headers: a starlette Headers, or the ASGI scope's raw list."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return True
    if isinstance(headers, list):
        return any(k == b"anthropic-version" for k, _ in headers)
    return "anthropic-version" in headers


def render(path: str, headers, e: ApiError) -> JSONResponse:
    """e as the response of its request's API family."""
    if is_anthropic(path, headers):
        status = 529 if e.status == 503 else e.status
        kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return JSONResponse({"type": "error", "error": {"type": kind, "message": e.message}}, status_code=status,
                            headers=e.headers)
    return JSONResponse(error_body(e.status, e.message, e.type, e.param, e.code), status_code=e.status,
                        headers=e.headers)


def validation_error(e: RequestValidationError) -> ApiError:
    """A pydantic failure as a 400 that names the field (unknown fields are
    refused, never dropped)."""
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
    return ApiError(400, msg, "invalid_request_error", param, "invalid_request")


def install_handlers(app: FastAPI) -> None:
    def out(request: Request, e: ApiError) -> JSONResponse:
        return render(request.url.path, request.headers, e)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return out(request, e)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        return out(request, validation_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        # FastAPI's own 404 / 405 ({"detail": ...}), which clients print bare
        if e.status_code == 404:
            return out(request, ApiError(404, f"no route {request.method} {request.url.path} on this server "
                                         "(the routes: README, 'Serving')", "not_found_error", code="not_found"))
        if e.status_code == 405:
            return out(request, ApiError(405, f"{request.method} is not allowed on {request.url.path}",
                                         "invalid_request_error", code="method_not_allowed"))
        return out(request, ApiError(e.status_code, str(e.detail), "invalid_request_error"))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        return out(request, ApiError(500, f"internal error: {type(e).__name__}: {e}", "internal_error"))

    @app.exception_handler(LlamajetError)
    async def _ours(request: Request, e: LlamajetError):
        return out(request, ApiError(400, str(e), "invalid_request_error", None, "invalid_request"))
