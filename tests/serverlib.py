"""Starting `llamajet serve` for tests: in this process (a uvicorn thread on a
loopback socket, so a test can look at the engine's block pool), or as a
real subprocess (for signals)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import uvicorn

from llamajet.server.app import ServerSettings, create_app


class LiveServer:
    def __init__(self, llm, **settings) -> None:
        self.llm = llm
        self.settings = ServerSettings(**{"model_name": "test-model", **settings})
        self.app = create_app(self.settings, llm)
        self.state = self.app.state.llamajet
        # proto IPPROTO_TCP, not socket()'s 0: asyncio sets TCP_NODELAY only on sockets that say TCP, and
        # without it every response waited ~40 ms (Nagle against the client's delayed ACK)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)

    def client(self, **kw):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0,
                      timeout=120, **kw)

    def metric(self, name: str) -> float:
        """The value of an unlabelled-or-model-labelled sample `name` in /metrics."""
        text = httpx.get(self.url + "/metrics").text
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def wait(cond, timeout: float = 30.0) -> bool:
    """Polls cond() until true (True) or timeout seconds pass (False)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


@contextmanager
def hold_engine(eng, after_tokens: int):
    """Holds `eng` (its stepping thread waits before the next step) once a
    running sequence has `after_tokens` output tokens, until release.set()
    or the block's end; yields (held, release), two threading.Events. For
    a test that must act while a stream is still open, however fast or slow
    the machine: a reply trusted to outlast the test's checks once ended
    first in CI."""
    held, release = threading.Event(), threading.Event()
    step = eng.step

    def gated_step():
        if not held.is_set() and any(s.num_output >= after_tokens for s in eng.scheduler.running):
            held.set()
            release.wait(60)
        return step()

    eng.step = gated_step  # the AsyncEngine looks eng.step up at every step
    try:
        yield held, release
    finally:
        release.set()
        del eng.step  # the class's own again


def idle(srv: LiveServer) -> bool:
    """No request running and no KV block held."""
    return srv.metric("llamajet:num_requests_running") == 0 and srv.llm.engine.blocks.num_used == 0


def unclean(srv: LiveServer) -> list[str]:
    """How `srv` differs from a fresh server in what a test may look at (empty: it does not)."""
    eng = srv.llm.engine
    why = []
    if not srv.thread.is_alive():
        why.append("its thread has ended")
    if srv.state.draining:
        why.append("it is draining")
    if srv.state.settings != srv.settings:
        why.append(f"its settings changed: {srv.state.settings}")
    if srv.state.inflight:
        why.append(f"{srv.state.inflight} requests in flight")
    if eng.has_unfinished():
        why.append("the engine has unfinished requests")
    if eng.blocks.num_used:
        why.append(f"{eng.blocks.num_used} KV blocks held")
    if "step" in vars(eng):
        why.append("engine.step is patched")
    return why


@contextmanager
def lend(srv: LiveServer):
    """Lends a server shared by several test modules to one of them (conftest.py's default_server).
    It is handed over as a fresh one would be in everything a test may look at: idle (no request in
    flight, no KV block held, nothing queued), not draining, with the settings it was made with, and
    an empty prefix cache (so, e.g., a module counting computed prompt tokens counts them all); and
    given back the same, or the module's teardown fails: a leftover can neither change another
    module's results nor hide a leak. Counters (metrics, engine.stats) keep counting: tests read
    their differences."""
    assert wait(lambda: not unclean(srv)), f"the shared server is not clean before lending: {unclean(srv)}"
    with srv.llm.engine.lock:
        srv.llm.engine.blocks.reset_cache()
    yield srv
    assert wait(lambda: not unclean(srv)), f"a module gave the shared server back unclean: {unclean(srv)}"


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def spawn(*args: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`llamajet serve ARGS` in a subprocess; returns it once /ready is 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "llamajet.cli", "serve", "--port", str(port), "--log-level", "warning", *args]
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: {proc.stdout.read()[-3000:]}")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("server did not become ready")
