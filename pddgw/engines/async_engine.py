"""Drive an Engine from asyncio without blocking the event loop.

Every engine call (steps and control calls alike) runs on one dedicated
worker thread, in submission order, so the engine needs no locks and a
control call never races a step.  A background task steps while there is
work and fans the outputs out to per-request entries.  An engine that only
models time (`Engine.runs_inline`, the cost model) is called on the loop
itself, its outputs released once the step's modeled duration has passed on
the loop's clock.

A request's output entry has one owner, this class: `add` registers it (a
failed or cancelled add leaves nothing), `stream` attaches its one reader (a
`RequestStream`, or a `StepSink` handed all its requests' outputs once per
step), and it ends exactly once (`_end`): final output handed out, stream
closed early (the request is aborted), `abort`, or the engine stopping.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import structlog

from pddgw.engines import compute_thread
from pddgw.engines.base import Engine
from pddgw.engines.compute_thread import Turn
from pddgw.engines.types import AddResult, EngineRequest, RequestError, RequestOutput

log = structlog.get_logger(__name__)
T = TypeVar("T")

# After a step that advanced nothing (everything blocked on imports or
# capacity), wait this long for a wake-up before stepping again.
_IDLE_POLL_S = 0.005

# A prefill engine on the compute thread queues its next step as its last ends, ahead of the
# relay's and main decode's steps; after this many in a row, behind the steps waiting then
# (one more first when it would compute every prompt token left: a burst ends without waiting).
PREFILL_STREAK = 8


class EngineStopped(RuntimeError):
    """The engine loop stopped (shut down or crashed) while a request was live."""


StepSink = Callable[[list[tuple[Any, "RequestOutput | BaseException"]]], None]
"""Called once per engine step with (key, output) of every request streamed to it that the step
produced output for, in step order; (key, error) when the engine stopped or crashed.  `key` is
what `stream` was given with the sink (the reader's own handle of the request).  Called on the
loop, from the engine's loop task (or `stream`, `stop`): it must not block (queue the work,
wake a task)."""


class _Entry:
    """The outputs of one added request, until they are read to the end or given up."""

    __slots__ = ("queue", "streamed", "sink", "key", "ended")

    def __init__(self) -> None:
        # Outputs not read yet (with a sink: only those produced before the sink was attached).
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.streamed = False
        self.sink: StepSink | None = None
        self.key: Any = None
        self.ended = False


class RequestStream:
    """The outputs of one request, in order, until it finishes (see `AsyncEngine.stream`).

    An async iterator with `aclose`: closing it before the final output (or
    cancelling the task iterating it) aborts the request.  Safe to close
    whether or not it was ever iterated, and more than once.
    """

    def __init__(self, aeng: AsyncEngine, request_id: str, entry: _Entry) -> None:
        self._aeng = aeng
        self.request_id = request_id
        self._entry: _Entry | None = entry

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        entry = self._entry
        if entry is None or entry.ended:
            raise StopAsyncIteration
        if entry.sink is not None:
            raise RuntimeError(f"request {self.request_id!r} is read by a step sink, not iterated")
        try:
            item = await entry.queue.get()
        except BaseException:
            await self.aclose()       # cancelled while waiting: the request is given up
            raise
        if isinstance(item, BaseException):
            self._aeng._end(self.request_id, entry)
            self._entry = None
            raise item
        if item.done:
            self._aeng._end(self.request_id, entry)
            self._entry = None
        return item

    def feed(self, sink: StepSink, key: Any) -> None:
        """Hand this request's outputs to `sink` as (key, output), with the step's others (module
        docstring, 2), instead of iterating: those produced already at once (one call of `sink`,
        from here).  Once, before any iteration; the stream then only closes the entry."""
        entry = self._entry
        if entry is None or entry.ended:
            raise RequestError(f"request {self.request_id!r}: its stream has ended")
        if entry.sink is not None:
            raise RequestError(f"request {self.request_id!r} is fed to a sink already")
        entry.sink, entry.key = sink, key
        early: list[tuple[Any, RequestOutput | BaseException]] = []
        while not entry.queue.empty():
            out = entry.queue.get_nowait()
            early.append((key, out))
            if isinstance(out, BaseException) or out.done:
                self._aeng._end(self.request_id, entry)
                break
        if early:
            sink(early)

    async def aclose(self) -> None:
        entry, self._entry = self._entry, None
        if entry is None or entry.ended:      # (a sink was handed the final output: nothing to abort)
            return
        self._aeng._end(self.request_id, entry)
        if not self._aeng._closed:
            # Shielded: the abort must reach the engine even if we are being cancelled.
            await asyncio.shield(self._aeng._abort_engine(self.request_id))


async def in_passing_thread(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) off the loop, on a thread of its own that ends when fn returns.

    For one-off engine work (building an engine, a probe's steps) in a process whose engines
    compute with OpenMP: a thread that ran a parallel region keeps its team of worker threads
    until it exits, and once a process's teams hold more threads than it has CPUs, libgomp
    wakes every team's workers by futex instead of spinning.  A decode step, which opens a
    few hundred short regions, then took 50 instead of 33 ms (SmolLM2 at batch 16, 2 cores),
    as it did in `pddgw serve` while a default-executor thread kept the team it had loaded
    the weights with.
    """
    ex = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pddgw-once")
    try:
        return await asyncio.get_running_loop().run_in_executor(ex, fn, *args)
    finally:
        ex.shutdown(wait=False)         # the thread ends after fn, never holding the loop meanwhile


class AsyncEngine:
    """`turn`: where this engine's steps queue on the process's compute thread, for an engine
    that `shares_compute_thread` (its other calls go first); others get a thread of their own."""

    def __init__(self, engine: Engine, name: str = "engine", turn: Turn = Turn.DECODE):
        self.engine = engine
        self.name = name
        self.turn = turn
        self._compute = compute_thread.shared() if engine.shares_compute_thread else None
        self._executor = None if self._compute is not None else \
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"pddgw-{name}")
        self._entries: dict[str, _Entry] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def pending(self) -> int:
        """Requests whose output entry is registered (added and not yet streamed to the end)."""
        return len(self._entries)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) on the engine thread, between steps."""
        if self._closed:
            raise EngineStopped(f"{self.name} is stopped")
        result = await self._on_engine(fn, *args)
        self._wake.set()
        return result

    def post(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Queue fn(*args) on the engine thread after what is queued already, without waiting.

        An inline engine runs it now.  fn reports its own failures (they are
        only logged here).  -> False if the engine is stopped (fn never runs).
        """
        if self._closed:
            return False
        if self.engine.runs_inline:
            try:
                fn(*args)
            except Exception as e:
                log.error("engine_post_failed", engine=self.name, error=repr(e))
            return True
        try:
            fut = self._submit(Turn.CONTROL, fn, *args)
        except RuntimeError:          # shut down meanwhile
            return False
        fut.add_done_callback(self._log_failure)
        return True

    def _log_failure(self, fut: concurrent.futures.Future) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            log.error("engine_post_failed", engine=self.name, error=repr(fut.exception()))

    def _submit(self, turn: Turn, fn: Callable[..., T], *args: Any,
                behind: bool = False) -> concurrent.futures.Future[T]:
        if self._compute is not None:
            return self._compute.submit(turn, fn, *args, behind=behind)
        assert self._executor is not None
        return self._executor.submit(fn, *args)

    async def _on_engine(self, fn: Callable[..., T], *args: Any, turn: Turn = Turn.CONTROL) -> T:
        if self.engine.runs_inline:
            return fn(*args)
        return await asyncio.wrap_future(self._submit(turn, fn, *args))

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
        if not self.engine.runs_inline:
            # The last call on the engine's thread: what it holds outside this process's objects
            # (vLLM's worker processes, staging files) goes with it.
            await self._on_engine(self.engine.shutdown)
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    async def add(self, request: EngineRequest) -> AddResult:
        """Register a request; its outputs wait in its entry until `stream` reads them.

        The caller then either streams it (`stream`, at once) or gives it up
        (`abort`).  Cancelled while the engine admits it: the engine still
        admits it on its thread, and it is aborted right after.
        """
        rid = request.request_id
        if rid in self._entries:
            raise RequestError(f"request {rid!r} already exists")
        entry = self._entries[rid] = _Entry()
        if self.engine.runs_inline:
            admit = None          # called at once, on the loop: no moment to be cancelled in
        else:
            admit = asyncio.ensure_future(self.call(self.engine.add_request, request))
        try:
            result = await (self.call(self.engine.add_request, request) if admit is None
                            else asyncio.shield(admit))
        except asyncio.CancelledError:
            if admit is None:
                self._end(rid, entry)
            else:
                admit.add_done_callback(lambda f: self._undo_add(rid, entry, f))
            raise
        except BaseException:
            self._end(rid, entry)
            raise
        self.start()
        return result

    def _undo_add(self, rid: str, entry: _Entry, admitted: asyncio.Future) -> None:
        """An add whose caller was cancelled has completed: give the request up."""
        self._end(rid, entry)
        if not admitted.cancelled() and admitted.exception() is None and not self._closed:
            asyncio.get_running_loop().create_task(self._abort_engine(rid), name=f"{self.name}-undo-{rid}")

    def stream(self, request_id: str) -> RequestStream:
        """The outputs of an added request (see `RequestStream`); one stream per request."""
        entry = self._entries.get(request_id)
        if entry is None:
            raise RequestError(f"request {request_id!r} is not registered here (never added, or given up)")
        if entry.streamed:
            raise RequestError(f"request {request_id!r} is streamed already")
        entry.streamed = True
        return RequestStream(self, request_id, entry)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        await self.add(request)
        async with contextlib.aclosing(self.stream(request.request_id)) as outputs:
            async for out in outputs:
                yield out

    async def abort(self, request_id: str) -> bool:
        """Drop the request in the engine (False if the engine did not know it).

        A stream reading it gets the abort output and ends; a request nobody
        streams is given up here (its entry ends)."""
        entry = self._entries.get(request_id)
        if entry is not None and not entry.streamed:
            self._end(request_id, entry)
        return await self.call(self.engine.abort, request_id)

    async def _abort_engine(self, request_id: str) -> None:
        with contextlib.suppress(EngineStopped):
            await self.call(self.engine.abort, request_id)

    def _end(self, request_id: str, entry: _Entry) -> None:
        """The one place an entry ends."""
        if entry.sink is not None:
            entry.ended = True            # its stream object has nothing left to abort
        if self._entries.get(request_id) is entry:
            del self._entries[request_id]

    async def _run(self) -> None:
        eng = self.engine
        loop = asyncio.get_running_loop()
        inline = eng.runs_inline
        try:
            while True:
                self._wake.clear()
                # An inline engine called directly: the same, minus a coroutine per call.
                if not (eng.has_work() if inline else await self._on_engine(eng.has_work)):
                    await self._wake.wait()
                    continue
                if self._compute is not None and self.turn == Turn.PREFILL:
                    await self._prefill_streak()
                    continue
                began = loop.time()
                outputs = eng.step() if inline else await self._on_engine(eng.step, turn=self.turn)
                # The modeled duration counts from the step's start: the host's own time for the
                # step is part of it, as a GPU engine's scheduling overlaps its kernels (on the
                # virtual clock that time is 0, so a simulated run is unchanged).
                left = self.engine.step_seconds() - (loop.time() - began)
                if left > 0:
                    await asyncio.sleep(left)
                self._hand_out(outputs)
                if not outputs and not eng.held_last_step():
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

    async def _prefill_streak(self) -> None:
        """Steps of a prefill engine on the compute thread while it has work, each queued by the
        last as it ends (`_step_and_queue`): a burst of prompts is prefilled back to back instead
        of each step waiting behind the relay's and main decode's between them."""
        fut: concurrent.futures.Future | None = self._submit(self.turn, self._step_and_queue, 1)
        while fut is not None:
            outputs, fut = await asyncio.wrap_future(fut)
            self._hand_out(outputs)

    def _step_and_queue(self, streak: int) -> tuple[list[RequestOutput], concurrent.futures.Future | None]:
        """On the compute thread: one step, then the next queued at once while prompts are left to
        compute (`Engine.prompt_work`; a relaying P's decodes alone wait their turn as before): at
        its own turn, before any lower turn's call can start, or every PREFILL_STREAK steps (one
        more when that one ends every prompt left, `Engine.prompt_ends_next_step`) behind every
        call waiting then (the relay and main decode step once)."""
        if self._closed:
            return [], None
        outputs = self.engine.step()
        if self._closed or not self.engine.prompt_work():
            return outputs, None
        if streak < PREFILL_STREAK or (streak == PREFILL_STREAK and self.engine.prompt_ends_next_step()):
            return outputs, self._submit(self.turn, self._step_and_queue, streak + 1)
        return outputs, self._submit(self.turn, self._step_and_queue, 1, behind=True)

    def _hand_out(self, outputs: list[RequestOutput]) -> None:
        """One step's outputs to their readers: a stream's queue each, a sink's all in one call."""
        sinks: dict[StepSink, list[tuple[Any, RequestOutput | BaseException]]] | None = None
        entries = self._entries
        for out in outputs:
            entry = entries.get(out.request_id)
            if entry is None:
                continue
            sink = entry.sink
            if sink is None:
                entry.queue.put_nowait(out)
                continue
            if sinks is None:
                sinks = {}
            got = sinks.get(sink)
            if got is None:
                got = sinks[sink] = []
            got.append((entry.key, out))
            if out.done:
                self._end(out.request_id, entry)
        if sinks:
            for sink, got in sinks.items():
                sink(got)

    def _fail_all(self, err: BaseException) -> None:
        """Streams raise `err` (and end their entries); entries nobody streams end now."""
        sinks: dict[StepSink, list[tuple[Any, RequestOutput | BaseException]]] = {}
        for rid, entry in list(self._entries.items()):
            if entry.sink is not None:
                sinks.setdefault(entry.sink, []).append((entry.key, err))
                self._end(rid, entry)
            elif entry.streamed:
                entry.queue.put_nowait(err)
            else:
                self._end(rid, entry)
        for sink, got in sinks.items():
            sink(got)
