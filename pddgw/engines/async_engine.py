"""Drive an Engine from asyncio without blocking the event loop.

Every engine call (steps and control calls alike) runs on one dedicated
worker thread, in submission order, so the engine itself needs no locks and
a control call never races a step.  A background task steps while there is
work and fans the outputs out to per-request streams.  An engine that only
models time (`Engine.runs_inline`, the cost model) is called on the loop
itself, and each step's outputs are released once the step's modeled
duration has passed on the loop's clock: real seconds in a deployment,
virtual ones in `pddgw sim`.  Closing a stream early (`contextlib.aclosing`
around it, or cancelling the task reading it) aborts the request and frees
its blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import structlog

from pddgw.engines.base import Engine
from pddgw.engines.types import AddResult, EngineRequest, RequestOutput

log = structlog.get_logger(__name__)
T = TypeVar("T")

# After a step that advanced nothing (everything blocked on imports or
# capacity), wait this long for a wake-up before stepping again.
_IDLE_POLL_S = 0.005


class EngineStopped(RuntimeError):
    """The engine loop stopped (shut down or crashed) while a request was live."""


class AsyncEngine:
    def __init__(self, engine: Engine, name: str = "engine"):
        self.engine = engine
        self.name = name
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"pddgw-{name}")
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def pending(self) -> int:
        """Requests whose output queue is registered (added and not yet streamed to the end)."""
        return len(self._queues)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) on the engine thread, between steps."""
        if self._closed:
            raise EngineStopped(f"{self.name} is stopped")
        result = await self._on_engine(fn, *args)
        self._wake.set()
        return result

    async def _on_engine(self, fn: Callable[..., T], *args: Any) -> T:
        if self.engine.runs_inline:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"{self.name}-loop")

    async def stop(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self._fail_all(EngineStopped(f"{self.name} stopped"))
        self._executor.shutdown(wait=True)

    async def add(self, request: EngineRequest) -> AddResult:
        """Register a request (its outputs queue up until `stream` reads them)."""
        self._queues[request.request_id] = asyncio.Queue()
        try:
            result = await self.call(self.engine.add_request, request)
        except BaseException:
            self._queues.pop(request.request_id, None)
            raise
        self.start()
        return result

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of an added request until it finishes; leaving early aborts it."""
        queue = self._queues[request_id]
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished and not self._closed:
                # Shielded: the abort must reach the engine even if we are being cancelled.
                await asyncio.shield(self.call(self.engine.abort, request_id))

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        await self.add(request)
        async with contextlib.aclosing(self.stream(request.request_id)) as outputs:
            async for out in outputs:
                yield out

    async def abort(self, request_id: str) -> bool:
        return await self.call(self.engine.abort, request_id)

    async def _run(self) -> None:
        try:
            while True:
                self._wake.clear()
                if not await self._on_engine(self.engine.has_work):
                    await self._wake.wait()
                    continue
                outputs = await self._on_engine(self.engine.step)
                modeled = self.engine.step_seconds()
                if modeled > 0:
                    await asyncio.sleep(modeled)
                for out in outputs:
                    q = self._queues.get(out.request_id)
                    if q is not None:
                        q.put_nowait(out)
                if not outputs:
                    try:
                        await asyncio.wait_for(self._wake.wait(), _IDLE_POLL_S)
                    except TimeoutError:
                        pass
        except asyncio.CancelledError:
            raise
        except Exception as e:   # a bug in the engine: fail every live request loudly
            log.exception("engine_loop_crashed", engine=self.name)
            self._closed = True
            self._fail_all(EngineStopped(f"{self.name} crashed: {e!r}"))

    def _fail_all(self, err: BaseException) -> None:
        for q in self._queues.values():
            q.put_nowait(err)
