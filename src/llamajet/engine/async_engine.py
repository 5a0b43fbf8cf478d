"""AsyncEngine: the Engine driven from asyncio, one stream per request.

    async for ev in async_engine.stream(prompt_ids, params):
        ...   # other requests keep running in the same steps

One driver task per event loop steps the Engine while it has work, each
step in a worker thread (the C++ step releases the GIL, so the loop stays
responsive and takes new requests meanwhile), and hands each sequence's new
events to that request's asyncio.Queue. Requests and aborts reach the engine
through its thread-safe inbox (Engine.post), taken in at the start of the
next step, so only the stepping thread ever changes the engine's state.

One event loop at a time: an AsyncEngine serves the loop of its first
request until that loop is closed, or has stopped with no request of it in
flight (``asyncio.run`` twice in a row is fine). A request from another loop
meanwhile raises ConcurrencyError before anything is queued: asyncio queues
and events belong to one loop, and a second driver would hand events to the
first loop's queues from the wrong thread. Use one LLM (one engine) per loop.

Synchronous drivers may step the same Engine from other threads (the
Engine's lock keeps the steps whole); their steps may advance this
engine's requests too, so after every step the driver forwards the new
events of all its own requests, not only of those its step touched, and
never takes events of sequences it does not stream.
"""

from __future__ import annotations

import asyncio
import threading
from typing import AsyncIterator

from llamajet.engine.engine import Engine
from llamajet.engine.sampling import SamplingParams
from llamajet.engine.sequence import Sequence, StreamEvent
from llamajet.errors import ConcurrencyError


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._queues: dict[int, asyncio.Queue] = {}
        self._streams: dict[int, Sequence] = {}  # the sequences of the queues, by id
        self._loop: asyncio.AbstractEventLoop | None = None
        self._bind_lock = threading.Lock()  # two loops' first requests may race for the binding
        self._wake: asyncio.Event | None = None
        self._driver: asyncio.Task | None = None

    async def stream(self, prompt_ids: list[int], params: SamplingParams,
                     constraint=None, on_open=None) -> AsyncIterator[StreamEvent]:
        """Yields the request's StreamEvents as its tokens are generated (with
        params.n > 1, every choice's, told apart by `index`; it ends when all
        have finished). A bad request raises RequestError before anything is
        queued; leaving the loop early aborts the request (its blocks are
        freed at the next step). on_open(sequences) is called once they
        exist (a server reads their timing and cache counts). From a second
        event loop while the first is in use: ConcurrencyError."""
        self._bind()
        seq = self.engine.new_sequence(prompt_ids, params, constraint)
        group = [seq, *seq.forks]
        if on_open is not None:
            on_open(group)
        q: asyncio.Queue = asyncio.Queue()
        for s in group:
            self._queues[s.id] = q
            self._streams[s.id] = s
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
                self._streams.pop(s.id, None)
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

    def _bind(self) -> None:
        """Makes the running loop this engine's loop, or refuses (see the
        module docstring)."""
        loop = asyncio.get_running_loop()
        with self._bind_lock:
            old = self._loop
            if old is None or old is loop:
                self._loop = loop
                return
            if old.is_closed() or (not old.is_running() and not self._queues):
                self._loop, self._wake, self._driver = loop, None, None  # the old driver died with its loop
                return
        raise ConcurrencyError(
            f"this AsyncEngine serves event loop {old!r} (still {'running' if old.is_running() else 'open'}, "
            f"{len(self._queues)} requests in flight); an AsyncEngine is bound to one event loop: "
            "use it from that loop, or give each loop its own LLM")

    def _kick(self) -> None:
        """Wakes this loop's driver, starting one if needed."""
        if self._driver is None or self._driver.done():
            self._wake = asyncio.Event()
            self._driver = self._loop.create_task(self._drive())
        self._wake.set()

    async def _drive(self) -> None:
        eng = self.engine
        while True:
            # Forward and test for work under the engine's lock: a synchronous
            # driver's step may finish our last request in between, and its
            # events must not wait for a step that never comes. (Uncontended
            # unless sync calls share the engine; then it waits one step.)
            with eng.lock:
                self._forward()
                idle = not eng.has_unfinished()
            if idle:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await asyncio.to_thread(eng.step)
            except Exception as e:  # a failed step fails every request in flight
                with eng.lock:
                    for seq in list(eng.scheduler.running) + list(eng.scheduler.waiting):
                        eng.abort(seq)
                        q = self._queues.get(seq.id)
                        if q is not None:
                            q.put_nowait(e)
                continue

    def _forward(self) -> None:
        """Hands every new event of this engine's requests to their queues:
        the driver's step made them, or a synchronous driver's."""
        for sid, seq in list(self._streams.items()):
            q = self._queues.get(sid)
            while q is not None and seq.events:
                q.put_nowait(seq.events.popleft())
