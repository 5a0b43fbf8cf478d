"""`llamajet serve`: uvicorn over the app, with a graceful drain.

SIGTERM (or SIGINT): stop admitting at once (`/ready` -> 503, new generation
requests -> 503), let the requests in flight finish for up to
`drain_timeout` seconds, then exit 0. A second signal, or the timeout, ends
the requests still running: each stream gets a last chunk with
finish_reason "abort" and `[DONE]`, each non-streamed request its answer so
far with finish_reason "abort"; then the process exits 0.

Kubernetes: give the pod terminationGracePeriodSeconds >= preStop sleep +
drain_timeout + a few seconds (deploy/k8s does).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any, Callable

import uvicorn

from llamajet.server import log as serverlog
from llamajet.server.app import ServerSettings, create_app

log = logging.getLogger("llamajet.server")


class _DrainingServer(uvicorn.Server):
    """uvicorn's Server whose exit signals drain the engine first."""

    def __init__(self, config: uvicorn.Config, app_state) -> None:
        super().__init__(config)
        self.app_state = app_state
        self._signals = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:  # called by uvicorn's signal handler
        self._signals += 1
        if self._loop is None:
            return super().handle_exit(sig, frame)
        if self._signals == 1:
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))
        else:
            self._loop.call_soon_threadsafe(self._force)

    def _force(self) -> None:
        st = self.app_state
        if st.llm is not None:
            n = st.llm.async_engine.abort_all("abort")
            log.warning("drain: ended %d sequences in flight", n)

    async def _drain(self) -> None:
        st = self.app_state
        st.draining = True
        timeout = st.settings.drain_timeout
        log.info("drain: started (SIGTERM or SIGINT): /ready is 503, new requests are refused; %d requests in "
                 "flight, waiting up to %.0f s", st.inflight, timeout)
        try:
            await asyncio.wait_for(st.idle.wait(), timeout)
        except asyncio.TimeoutError:
            self._force()
            try:  # the aborted streams write their last chunks
                await asyncio.wait_for(st.idle.wait(), 5.0)
            except asyncio.TimeoutError:
                pass
        await asyncio.sleep(0.05)  # let the last responses leave
        log.info("drain: done, %d requests still in flight; exiting", st.inflight)
        self.should_exit = True


def serve(settings: ServerSettings, load: Callable[[], Any], host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info") -> int:
    serverlog.setup(log_level)
    app = create_app(settings, load)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                            access_log=False, lifespan="on")
    server = _DrainingServer(config, app.state.llamajet)
    if settings.ui:
        shown = f"[{host}]" if ":" in host else host
        log.info("chat page: http://%s:%d/ (--no-ui turns it off)", shown, port)
    server.run()
    return 0


__all__ = ["serve", "ServerSettings", "signal"]
