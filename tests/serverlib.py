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


def idle(srv: LiveServer) -> bool:
    """No request running and no KV block held."""
    return srv.metric("llamajet:num_requests_running") == 0 and srv.llm.engine.blocks.num_used == 0


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
