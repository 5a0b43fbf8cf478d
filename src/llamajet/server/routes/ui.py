"""The chat page at `/` (on unless `llamajet serve --no-ui`): one static page
shipped in the package (server/ui/: HTML, CSS, JS; no build step, nothing
fetched from outside). It holds no secret and loads without the API key; its
script sends the key on /v1/* when the server has one.

The page's Content-Security-Policy lets it run only its own script and talk
only to this server: a second wall behind the script's rule that model output
never becomes HTML (see ui/chat.js)."""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import Response

router = APIRouter()

_UI = files("llamajet.server") / "ui"
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # a new llamajet's page replaces the old one at once
}


def _asset(name: str, media_type: str):
    body = (_UI / name).read_bytes()  # read once, at import: the files are small and never change

    async def get():
        return Response(body, media_type=media_type, headers=_HEADERS)

    return get


router.add_api_route("/", _asset("index.html", "text/html; charset=utf-8"), methods=["GET"])
router.add_api_route("/ui/chat.js", _asset("chat.js", "text/javascript; charset=utf-8"), methods=["GET"])
router.add_api_route("/ui/chat.css", _asset("chat.css", "text/css; charset=utf-8"), methods=["GET"])
