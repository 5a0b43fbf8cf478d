"""AsyncEngine: the Engine driven from asyncio, one stream per request.

    async for ev in async_engine.stream(prompt_ids, params):
        ...   # other requests keep running in the same steps

One driver task per event loop steps the Engine while it has work, each
step in a worker thread (the C++ step releases the GIL, so the loop stays
responsive and takes new requests meanwhile), and hands each sequence's new
events to that request's asyncio.Queue. Requests and aborts reach the engine
through its thread-safe inbox (Engine.post), taken in at the start of the
next step, so only the stepping thread ever changes the engine's state.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from llamajet.engine.engine import Engine
from llamajet.engine.sampling import SamplingParams
from llamajet.engine.sequence import StreamEvent


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._queues: dict[int, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._driver: asyncio.Task | None = None

    async def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[StreamEvent]:
        """Yields the request's StreamEvents as its tokens are generated.
        A bad request raises RequestError before anything is queued; leaving
        the loop early aborts the request (its blocks are freed)."""
        seq = self.engine.new_sequence(prompt_ids, params)
        q: asyncio.Queue = asyncio.Queue()
        self._queues[seq.id] = q
        self.engine.post("add", seq)
        self._kick()
        try:
            while True:
                ev = await q.get()
                if isinstance(ev, BaseException):
                    raise ev
                yield ev
                if ev.finish_reason is not None:
                    return
        finally:
            self._queues.pop(seq.id, None)
            if not seq.finished:
                self.engine.post("abort", seq)  # taken in by the next step, whoever runs it

    def _kick(self) -> None:
        """Wakes this loop's driver, starting one if needed."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._driver is None or self._driver.done():
            self._loop = loop
            self._wake = asyncio.Event()
            self._driver = loop.create_task(self._drive())
        self._wake.set()

    async def _drive(self) -> None:
        eng = self.engine
        while True:
            if not eng.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                touched = await asyncio.to_thread(eng.step)
            except Exception as e:  # a failed step fails every request in flight
                for seq in list(eng.scheduler.running) + list(eng.scheduler.waiting):
                    eng.abort(seq)
                    q = self._queues.get(seq.id)
                    if q is not None:
                        q.put_nowait(e)
                continue
            for seq in touched:
                q = self._queues.get(seq.id)
                while seq.events:
                    ev = seq.events.popleft()
                    if q is not None:
                        q.put_nowait(ev)
