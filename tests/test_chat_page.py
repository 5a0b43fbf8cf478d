"""The chat page at `/` of `llamajet serve`, in a real browser: Debian's
headless Chromium driven by Playwright (its own browser download fails here,
so `executable_path` points at the system one; `make test` installs it with
apt when it can). The browser is started so that it calls nowhere on its own,
and every test checks that the page made no request outside loopback and
logged no console error.

Screenshots (phone-sized and desktop-sized windows) are written to
test-artifacts/ at the repository root, or to $LLAMAJET_TEST_ARTIFACTS.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from llamajet import LLM, SamplingParams
from llamajet.server.app import ServerSettings, create_app

from serverlib import LiveServer, hold_engine, wait

ROOT = Path(__file__).resolve().parents[1]
UI = ROOT / "src" / "llamajet" / "server" / "ui"
ARTIFACTS = Path(os.environ.get("LLAMAJET_TEST_ARTIFACTS", ROOT / "test-artifacts"))
M = "test-model"
KEY = "sekrit-key-1"
CHROMIUM_ARGS = ["--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run", "--disable-default-apps", "--disable-extensions", "--metrics-recording-only",
                 "--disable-features=Translate,OptimizationHints,MediaRouter"]
MODEL_SHOWN = "document.getElementById('model').textContent.startsWith('test-model')"
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}


# ---------------------------------------------------------------- without a browser


def test_page_assets_never_parse_text_as_html_and_fetch_nothing_outside():
    js = (UI / "chat.js").read_text()
    code = re.sub(r"^\s*//.*$", "", js, flags=re.M)  # the header comment names what is banned
    for banned in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function",
                   "setAttribute(\"on"):
        assert banned not in code, banned
    for name in ("index.html", "chat.css", "chat.js"):
        text = (UI / name).read_text()
        assert "://" not in text, name  # no absolute URL: no CDN, no web font, nothing from outside
        assert "@import" not in text and "url(" not in text.replace("data:", ""), name
    html = (UI / "index.html").read_text()
    assert re.findall(r"<script\b[^>]*>", html) == ['<script src="/ui/chat.js" defer>']  # no inline script


def test_no_ui_turns_the_page_off():
    from starlette.testclient import TestClient

    on = TestClient(create_app(ServerSettings(), load=lambda: None))  # (no lifespan: the model never loads)
    r = on.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "connect-src 'self'" in csp and "default-src 'none'" in csp
    assert on.get("/ui/chat.js").headers["content-type"].startswith("text/javascript")
    assert on.get("/ui/chat.css").status_code == 200
    off = TestClient(create_app(ServerSettings(ui=False), load=lambda: None))
    for path in ("/", "/ui/chat.js", "/ui/chat.css"):
        r = off.get(path)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", path


# ---------------------------------------------------------------- in Chromium


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    exe = os.environ.get("LLAMAJET_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("no chromium: the browser tests need Debian's chromium (apt-get install chromium; "
                    "make test installs it when run as root)")
    args = CHROMIUM_ARGS + (["--no-sandbox"] if os.geteuid() == 0 else [])
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, headless=True, args=args)
        yield b
        b.close()


@pytest.fixture(scope="module")
def srv(default_server):
    """The session's shared default-model server (conftest.py: context 1024, 8 sequences)."""
    return default_server


@pytest.fixture(scope="module")
def keyed(smollm2_gguf):
    s = LiveServer(LLM(smollm2_gguf, max_model_len=256, max_num_seqs=2), api_key=KEY)
    yield s
    s.close()


class Tab:
    """A page in a fresh browser context that records what the page did:
    console errors, uncaught exceptions, every request (a request outside
    loopback is recorded and refused, so nothing leaves even by mistake)."""

    def __init__(self, browser, viewport=DESKTOP) -> None:
        self.ctx = browser.new_context(viewport=viewport)
        self.page = self.ctx.new_page()
        self.console: list[str] = []
        self.errors: list[str] = []
        self.requests: list = []
        self.outside: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.console.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r))
        self.ctx.route("**/*", self._route)

    def _route(self, route):
        u = urlparse(route.request.url)
        if u.scheme in ("http", "https", "ws", "wss") and u.hostname not in ("127.0.0.1", "localhost", "::1"):
            self.outside.append(route.request.url)
            return route.abort()
        return route.fallback()

    def chats(self) -> list[dict]:
        """The bodies the page posted to /v1/chat/completions."""
        return [r.post_data_json for r in self.requests if r.url.endswith("/v1/chat/completions")]

    def until(self, js: str, timeout: float = 120.0) -> None:
        """Polls the expression `js` until true. (Page.wait_for_function evaluates a string with eval,
        which the page's CSP refuses, rightly; evaluate goes through the debugger.)"""
        assert wait(lambda: self.page.evaluate(js), timeout), js

    def settle(self) -> None:
        """Waits until no reply is streaming (Send shown again)."""
        self.page.wait_for_selector("#send:not([hidden])", timeout=120_000)

    def set(self, **fields) -> None:
        p = self.page
        if p.locator("#settings").get_attribute("open") is None:
            p.click("#settings summary")
        for k, v in fields.items():
            p.fill(f"#{k}", str(v))
            p.dispatch_event(f"#{k}", "change")

    def conversation(self) -> list[dict]:
        return json.loads(self.page.evaluate("localStorage.getItem('llamajet.conversation') || '[]'"))

    def close(self, allowed_console: tuple[str, ...] = ()) -> None:
        try:
            assert self.errors == [], self.errors
            assert [c for c in self.console if not any(a in c for a in allowed_console)] == [], self.console
            assert self.outside == [], self.outside
            hosts = {urlparse(r.url).hostname for r in self.requests if not r.url.startswith("data:")}
            assert hosts <= {"127.0.0.1"}, hosts
        finally:
            self.ctx.close()


OBSERVE = """() => {
  window.__snaps = [];
  new MutationObserver(() => {
    const m = document.querySelectorAll('.msg.assistant .body');
    if (m.length) window.__snaps.push(m[m.length - 1].textContent);
  }).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true});
}"""


def test_chat_streams_token_by_token_and_keeps_the_conversation(browser, srv):
    tab = Tab(browser)
    p = tab.page
    p.goto(srv.url + "/")
    tab.until(MODEL_SHOWN)
    assert "1024" in p.inner_text("#model")  # the context, from /v1/models
    tab.set(temperature=0, max_tokens=24, system="You are terse.")
    p.evaluate(OBSERVE)
    eng = srv.llm.engine
    step = eng.step

    def paced_step():  # tokens ~20 ms apart, so that a busy machine's browser still reads them one by one
        time.sleep(0.02)
        return step()

    eng.step = paced_step
    try:
        p.fill("#input", "What is the capital of France?")
        p.press("#input", "Enter")
        tab.settle()
    finally:
        del eng.step  # the class's own again
    conv = tab.conversation()
    assert [m["role"] for m in conv] == ["user", "assistant"]
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the capital of France?"}]
    ref = srv.llm.chat(msgs, SamplingParams(temperature=0, top_p=1, max_tokens=24))[0]
    assert conv[1]["content"] == ref.text  # the page's reply is the server's greedy reply, whole
    assert tab.chats()[0]["messages"] == msgs and tab.chats()[0]["stream"] is True
    # token by token: the reply grew in many steps, each a prefix of the next (one SSE chunk per token;
    # several may share a network read, so at least a third of the tokens are seen as their own step)
    grown = [s for s in dict.fromkeys(p.evaluate("window.__snaps")) if s]
    n_tokens = len(ref.token_ids)
    assert len(grown) >= max(3, n_tokens // 3), (len(grown), n_tokens)
    assert all(b.startswith(a) for a, b in zip(grown, grown[1:]))
    stats = p.inner_text("#stats")
    assert f"{n_tokens} tokens" in stats and "tok/s" in stats and "first token" in stats, stats

    # Shift+Enter is a new line, Enter sends; the second request carries the whole conversation
    p.fill("#input", "Say it again")
    p.press("#input", "Shift+Enter")
    p.type("#input", "in one word.")
    assert p.input_value("#input") == "Say it again\nin one word."
    p.press("#input", "Enter")
    tab.settle()
    second = tab.chats()[1]["messages"]
    assert second[1:] == [msgs[1], {"role": "assistant", "content": ref.text},
                          {"role": "user", "content": "Say it again\nin one word."}]
    assert p.locator(".msg.user").nth(1).inner_text() == "Say it again\nin one word."

    # kept across a reload, until cleared
    p.reload()
    tab.until(MODEL_SHOWN)
    assert p.locator(".msg").count() == 4
    assert p.input_value("#temperature") == "0" and p.input_value("#max_tokens") == "24"  # settings kept too
    p.click("#clear")
    assert p.locator(".msg").count() == 0 and tab.conversation() == []
    tab.close()


def test_stop_cancels_the_request_and_the_server_frees_the_sequence(browser, srv):
    eng = srv.llm.engine
    tab = Tab(browser)
    p = tab.page
    p.goto(srv.url + "/")
    tab.until(MODEL_SHOWN)
    tab.set(temperature=0, max_tokens=900)
    before = eng.stats.generated
    # The engine is held once the reply has a few tokens, so the stream is
    # still open when Stop is clicked (CI once found the reply already ended
    # and no Stop to click).
    with hold_engine(eng, 6) as (held, _):
        p.fill("#input", "Count from 1 to 300, one number per line.")
        p.press("#input", "Enter")
        assert held.wait(120)
        tab.until("(document.querySelector('.msg.assistant .body') || {textContent: ''}).textContent.length > 0")
        assert srv.metric("llamajet:num_requests_running") == 1
        p.click("#stop")
        # the browser closes the stream at once; the server sees it at the next step
        tab.settle()
    # the browser closed the stream; the server aborted the sequence and gave its KV blocks back
    assert wait(lambda: srv.metric("llamajet:num_requests_running") == 0 and
                srv.metric("llamajet:kv_cache_usage_perc") == 0.0)
    assert eng.scheduler.running == [] and not eng.scheduler.waiting and eng.blocks.num_used == 0
    assert eng.stats.generated - before < 900
    conv = tab.conversation()
    assert conv[-1]["role"] == "assistant" and conv[-1]["note"] == "stopped" and conv[-1]["content"]
    assert p.inner_text(".msg.assistant .note") == "stopped"
    assert p.inner_text("#stats").startswith("stopped")
    tab.close()


def test_json_schema_toggle_sends_response_format(browser, srv):
    jsonschema = pytest.importorskip("jsonschema")
    tab = Tab(browser)
    p = tab.page
    p.goto(srv.url + "/")
    tab.until(MODEL_SHOWN)
    tab.set(temperature=0, max_tokens=200)
    p.check("#schema_on")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    p.fill("#schema", json.dumps(schema))
    p.dispatch_event("#schema", "change")
    p.fill("#input", "Name the capital of France.")
    p.press("#input", "Enter")
    tab.settle()
    body = tab.chats()[0]
    assert body["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "reply", "schema": schema, "strict": True}}
    reply = tab.conversation()[-1]["content"]
    jsonschema.validate(json.loads(reply), schema)
    # not JSON: said in the page, nothing sent, the message stays in the box
    p.fill("#schema", "{not json")
    p.dispatch_event("#schema", "change")
    p.fill("#input", "again")
    p.press("#input", "Enter")
    assert "not valid JSON" in p.inner_text("#error")
    assert len(tab.chats()) == 1 and p.input_value("#input") == "again"
    # a draining server's 503, in its own words
    p.uncheck("#schema_on")
    srv.state.draining = True
    try:
        p.press("#input", "Enter")
        tab.until("document.getElementById('error').textContent.startsWith('503')")
    finally:
        srv.state.draining = False
    assert "shutting down" in p.inner_text("#error") and p.input_value("#input") == "again"
    p.click("#clear")
    tab.close(allowed_console=("status of 503",))


def test_api_key_is_asked_for_and_a_wrong_one_is_named(browser, keyed):
    tab = Tab(browser)
    p = tab.page
    p.goto(keyed.url + "/")  # the page itself loads without the key
    p.wait_for_selector("#keyform:not([hidden])")
    assert p.inner_text("#model") == "API key needed"
    p.fill("#key", "wrong-key")
    p.press("#key", "Enter")
    p.wait_for_selector("#error:not([hidden])")
    assert "401" in p.inner_text("#error") and "wrong API key" in p.inner_text("#error")
    assert p.is_visible("#keyform")
    p.fill("#key", KEY)
    p.click("#keysave")
    tab.until(MODEL_SHOWN)
    assert p.is_hidden("#keyform") and p.is_hidden("#error")
    # for this tab only: in sessionStorage, never in localStorage
    assert p.evaluate("sessionStorage.getItem('llamajet.key')") == KEY
    assert KEY not in json.dumps(p.evaluate("Object.assign({}, localStorage)"))
    tab.set(temperature=0, max_tokens=4)
    p.fill("#input", "Hi")
    p.press("#input", "Enter")
    tab.settle()
    assert tab.conversation()[-1]["role"] == "assistant"
    chat = [r for r in tab.requests if r.url.endswith("/v1/chat/completions")][0]
    assert chat.headers["authorization"] == f"Bearer {KEY}"

    # the route's own error in the page: a prompt over this server's 256-token context
    tab.set(max_tokens=200)
    long_text = "Tell me everything about the history of the city of Paris and its bridges. " * 8
    p.fill("#input", long_text)
    p.press("#input", "Enter")
    p.wait_for_selector("#error:not([hidden])")
    err = p.inner_text("#error")
    assert err.startswith("400: ") and "256" in err, err
    assert p.input_value("#input") == long_text  # nothing lost: the message is back in the box
    assert [m["role"] for m in tab.conversation()] == ["user", "assistant"]
    p.click("#clear")
    # the browser itself logs each refused response; the page logs nothing
    tab.close(allowed_console=("status of 401", "status of 400"))


CRAFTED = ["Hi <script>window.__pwned = 1</script>", " <img src=x onerror=\"window.__pwned = 2\">",
           " [click](javascript:window.__pwned=3)", " [safe](https://example.com/page)",
           " ![pic](https://example.com/pic.png)", " **bold** and `<b>code</b>`\n\n",
           "```html\n<script>window.__pwned = 4</script>\n<b onclick=\"window.__pwned = 5\">never closed"]


def _sse(pieces: list[str]) -> str:
    base = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": M}
    out = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
    out += [{**base, "choices": [{"index": 0, "delta": {"content": t}, "finish_reason": None}]} for t in pieces]
    out.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    return "".join(f"data: {json.dumps(o)}\n\n" for o in out) + "data: [DONE]\n\n"


def test_crafted_model_output_is_text_and_screenshots(browser, srv):
    """Model output the model could write, in the stream's exact shape
    (served by the test in place of the model: a 135M model cannot be made
    to write it on demand), rendered as text: no element from it, no script
    run, no image fetched, only http(s) links."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for name, viewport in (("desktop", DESKTOP), ("phone", PHONE)):
        tab = Tab(browser, viewport)
        p = tab.page
        p.route("**/v1/chat/completions", lambda route: route.fulfill(
            status=200, headers={"content-type": "text/event-stream"}, body=_sse(CRAFTED)))
        p.goto(srv.url + "/")
        tab.until(MODEL_SHOWN)
        p.fill("#input", "Show me some HTML.")
        p.press("#input", "Enter")
        tab.settle()
        msg = p.locator(".msg.assistant .body")
        assert p.evaluate("window.__pwned") is None
        assert msg.locator("script, img, iframe, object, embed, style, b").count() == 0
        assert p.evaluate("""() => [...document.querySelectorAll('.msg.assistant *')]
            .flatMap(e => [...e.attributes].map(a => a.name)).filter(n => n.startsWith('on'))""") == []
        hrefs = [a.get_attribute("href") for a in msg.locator("a").all()]
        assert hrefs == ["https://example.com/page", "https://example.com/pic.png"]  # an image is only a link
        text = msg.inner_text()
        assert "<script>window.__pwned = 1</script>" in text and "onerror=" in text
        assert "[click](javascript:window.__pwned=3)" in text
        assert msg.locator("strong").inner_text() == "bold"
        assert msg.locator("p code").inner_text() == "<b>code</b>"
        # the unclosed fence runs to the end, as code
        assert msg.locator("pre code").inner_text() == ('<script>window.__pwned = 4</script>\n'
                                                        '<b onclick="window.__pwned = 5">never closed')
        msg.locator("a").first.hover()  # (nothing loads on hover either)
        if name == "phone":  # nothing wider than the window; the composer in view
            assert p.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
            box = p.locator("#send").bounding_box()
            assert box["x"] + box["width"] <= PHONE["width"] and box["y"] + box["height"] <= PHONE["height"]
        p.fill("#input", "A second line\nof text, not yet sent")
        path = ARTIFACTS / f"chat-page-{name}.png"
        p.screenshot(path=str(path))
        assert path.stat().st_size > 5000
        assert not any("example.com" in r.url for r in tab.requests)
        p.click("#clear")
        tab.close()
