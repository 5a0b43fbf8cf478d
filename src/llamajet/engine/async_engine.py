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

    async def stream(self, prompt_ids: list[int], params: SamplingParams,
                     constraint=None, on_open=None) -> AsyncIterator[StreamEvent]:
        """Yields the request's StreamEvents as its tokens are generated (with
        params.n > 1, every choice's, told apart by `index`; it ends when all
        have finished). A bad request raises RequestError before anything is
        queued; leaving the loop early aborts the request (its blocks are
        freed at the next step). on_open(sequences) is called once they
        exist (a server reads their timing and cache counts)."""
        seq = self.engine.new_sequence(prompt_ids, params, constraint)
        group = [seq, *seq.forks]
        if on_open is not None:
            on_open(group)
        q: asyncio.Queue = asyncio.Queue()
        for s in group:
            self._queues[s.id] = q
        self.engine.post("add", seq)
        self._kick()
        done: set[int] = set()  # choices that ended (a forced abort may race a step's last events)
        try:
            while len(done) < len(group):
                ev = await q.get()
                if isinstance(ev, BaseException):
                    raise ev
                if ev.index in done:
                    continue
                if ev.finish_reason is not None:
                    done.add(ev.index)
                yield ev
        finally:
            for s in group:
                self._queues.pop(s.id, None)
            if any(not s.finished for s in group):
                for s in group:
                    self.engine.post("abort", s)  # taken in by the next step, whoever runs it
                if self._wake is not None:
                    self._wake.set()

    def abort_all(self, reason: str = "abort") -> int:
        """Ends every request in flight (from the event loop's thread): each
        stream gets a last event with finish_reason `reason`. Returns how many
        were ended. Used by a server's forced drain."""
        eng, n = self.engine, 0
        pending = [s for what, s in list(eng._inbox) if what == "add"]
        for seq in list(eng.scheduler.running) + list(eng.scheduler.waiting) + pending:
            for s in [seq, *seq.forks]:
                eng.post("abort", s)
                q = self._queues.get(s.id)
                if q is not None:
                    q.put_nowait(StreamEvent(None, "", reason, s.index))
                    n += 1
        if self._wake is not None:
            self._wake.set()
        return n

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
