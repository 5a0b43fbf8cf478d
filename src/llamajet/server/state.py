"""The server's settings and its per-app state (one LLM, the requests in
flight, the metrics), shared by the app, its dependencies and its routes."""

from __future__ import annotations

import asyncio
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from llamajet.server.grammar import Grammars
from llamajet.server.metrics import Metrics


@dataclass(frozen=True)
class ServerSettings:
    model_name: str = "llamajet"      # --served-model-name (the `model` clients must send)
    api_key: str | None = None        # bearer token (or x-api-key) for /v1/*; None = open
    max_queued_requests: int = 256    # requests waiting for admission before 429
    max_body_bytes: int = 4 << 20     # request bodies larger than this get 413
    drain_timeout: float = 30.0       # seconds in-flight requests get after SIGTERM
    retry_after_s: int = 1            # Retry-After on 429
    responses_max_count: int = 1000   # stored /v1/responses kept in memory (oldest evicted)
    responses_max_bytes: int = 256 << 20  # ... and their bytes (responses + conversations, as JSON)
    ui: bool = True                   # the chat page at / (--no-ui turns it off)


class ServerState:
    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.llm: Any = None                   # the llamajet.api.LLM, once loaded and warmed up
        self.grammars: Grammars | None = None
        self.load_error: str | None = None
        self.draining = False
        self.inflight = 0                      # requests not yet answered in full (in_flight)
        self.groups: dict[int, list] = {}      # request key -> its Sequences (loop thread only)
        self.metrics = Metrics(settings.model_name)
        self.fingerprint = "fp_llamajet"
        self.idle = asyncio.Event()            # set while inflight == 0 (drain waits on it)
        self.idle.set()

    @property
    def ready(self) -> bool:
        return self.llm is not None and not self.draining

    @contextmanager
    def in_flight(self):
        """Counts a request as in flight while the block runs (a drain waits
        until none is)."""
        self.inflight += 1
        self.idle.clear()
        try:
            yield
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self.idle.set()

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests: admitted to the batch or not yet."""
        running = waiting = 0
        for group in self.groups.values():
            if group[0].admit_time is None:
                waiting += 1
            elif not all(s.finished for s in group):
                running += 1
        return running, waiting
