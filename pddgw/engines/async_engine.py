"""Drive an Engine from asyncio without blocking the event loop.

Every engine call (steps and control calls alike) runs on one dedicated
worker thread, in submission order, so the engine itself needs no locks and
a control call never races a step.  A background task steps while there is
work and fans the outputs out to per-request streams.  An engine that only
models time (`Engine.runs_inline`, the cost model) is called on the loop
itself, and each step's outputs are released once the step's modeled
duration has passed on the loop's clock: real seconds in a deployment,
virtual ones in `pddgw sim`; its loop is a chain of callbacks
(`_InlineChain`), the task's loop hop for hop at a fraction of its calls.

A request's output entry (its queue; `pending` counts them) has one owner,
this class, and one lifecycle:

  1. `add` registers it (a failed add, or one cancelled while the engine
     admits the request, leaves nothing: the request is aborted as soon as
     the engine has it).
  2. `stream` attaches the one reader; outputs produced before that wait in
     the entry.  The stream object holds the entry from the call on, iterated
     or not.  With a `sink` the reader is that function instead: every step
     hands each sink its requests' outputs in one call (a `StepSink`), not
     one queue item per request (a decode node reads all its requests' tokens
     in one pass per step); the stream object then only closes the entry.
  3. The entry ends exactly once: when its stream has handed out the final
     output (with a sink: when the step hands it over), when its stream is
     closed early (`aclose`, or cancelling the task reading it; the request is
     aborted and its blocks freed), when `abort` ends a request nobody
     streams, or when the engine stops (a sink is handed the error).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import structlog

from pddgw.engines.base import Engine
from pddgw.engines.types import AddResult, EngineRequest, RequestError, RequestOutput

log = structlog.get_logger(__name__)
T = TypeVar("T")

# After a step that advanced nothing (everything blocked on imports or
# capacity), wait this long for a wake-up before stepping again.
_IDLE_POLL_S = 0.005


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
        if item.finished:
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
            if isinstance(out, BaseException) or out.finished:
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


class AsyncEngine:
    def __init__(self, engine: Engine, name: str = "engine"):
        self.engine = engine
        self.name = name
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"pddgw-{name}")
        self._entries: dict[str, _Entry] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._chain: _InlineChain | None = None     # an inline engine's loop (once started)

    @property
    def pending(self) -> int:
        """Requests whose output entry is registered (added and not yet streamed to the end)."""
        return len(self._entries)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) on the engine thread, between steps."""
        if self._closed:
            raise EngineStopped(f"{self.name} is stopped")
        result = await self._on_engine(fn, *args)
        if self._chain is not None:
            self._chain.wake()
        else:
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
            fut = self._executor.submit(fn, *args)
        except RuntimeError:          # shut down meanwhile
            return False
        fut.add_done_callback(self._log_failure)
        return True

    def _log_failure(self, fut: concurrent.futures.Future) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            log.error("engine_post_failed", engine=self.name, error=repr(fut.exception()))

    async def _on_engine(self, fn: Callable[..., T], *args: Any) -> T:
        if self.engine.runs_inline:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def start(self) -> None:
        if self.engine.runs_inline:
            if self._chain is None:
                self._chain = _InlineChain(self, asyncio.get_running_loop())
        elif self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"{self.name}-loop")

    async def stop(self) -> None:
        self._closed = True
        if self._chain is not None:
            await self._chain.stop()
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
            await asyncio.get_running_loop().run_in_executor(self._executor, self.engine.shutdown)
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
        """The one place an entry ends (module docstring, 3)."""
        if entry.sink is not None:
            entry.ended = True            # its stream object has nothing left to abort
        if self._entries.get(request_id) is entry:
            del self._entries[request_id]

    async def _run(self) -> None:
        """The engine loop of a threaded engine (an inline one runs `_InlineChain`, the same
        loop as callbacks)."""
        eng = self.engine
        try:
            while True:
                self._wake.clear()
                if not await self._on_engine(eng.has_work):
                    await self._wake.wait()
                    continue
                outputs = await self._on_engine(eng.step)
                modeled = self.engine.step_seconds()
                if modeled > 0:
                    await asyncio.sleep(modeled)
                self._hand_out(outputs)
                if not outputs:
                    try:
                        await asyncio.wait_for(self._wake.wait(), _IDLE_POLL_S)
                    except TimeoutError:
                        pass
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._crashed(e)

    def _crashed(self, e: Exception) -> None:
        """A bug in the engine: fail every live request loudly (called in the `except` block)."""
        log.exception("engine_loop_crashed", engine=self.name)
        self._closed = True
        self._fail_all(EngineStopped(f"{self.name} crashed: {e!r}"))

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
            if out.finished:
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


class _Poll:
    """One idle poll of `_InlineChain`: `asyncio.wait_for(event.wait(), _IDLE_POLL_S)`'s parts,
    each a flag (the inner task running `event.wait()`, the waiter wait_for sleeps on)."""

    __slots__ = ("timer", "inner", "waiting", "must_cancel", "dead")

    def __init__(self) -> None:
        self.timer: asyncio.TimerHandle | None = None
        self.inner = 0             # the inner task: 0 not started, 1 waiting, 2 woken, 3 done
        self.waiting = 1           # the outer waits on: 1 wait_for's waiter, 2 _cancel_and_wait's, 0 done
        self.must_cancel = False   # cancelled before its first step
        self.dead = False          # the engine stopped: every part of it is a no-op


class _InlineChain:
    """The engine loop of an inline engine (`Engine.runs_inline`: the cost model), as callbacks.

    The same loop as `AsyncEngine._run`: while there is work, step, release
    the outputs once the step's modeled time has passed, hand them out; with
    nothing to do wait for a wake-up (`wake`, what `AsyncEngine.call` does
    after each control call); after a step that produced nothing, wait for a
    wake-up or `_IDLE_POLL_S`, whichever comes first.  As a task that loop
    costs a future, a timer, a handle and a task step per engine step; here a
    step is a timer and a handle.

    Each place where the task suspended and resumed is one hop here (a
    `call_soon`), scheduled exactly where asyncio would schedule the task's
    wake-up: the step's timer wakes the loop one handle later, as a sleeping
    task; a wake-up while idle resumes it one handle later, as an Event waiter;
    the idle poll takes `wait_for`'s hops (its inner task, its waiters, the
    cancel on a timeout) and cancels its timer where `wait_for` does.  So the
    engine's steps and hand-outs fall at the same place among everything else
    the loop runs at one instant, and a simulated run is the same, event for
    event, as with the task.  The callbacks run in one context, copied at the
    start, as a task's steps do.  Once stopped, every callback still scheduled
    is a no-op (timers are cancelled, as the task's were).
    """

    def __init__(self, aeng: AsyncEngine, loop: asyncio.AbstractEventLoop):
        self.aeng = aeng
        self.loop = loop
        self.ctx = contextvars.copy_context()
        self.woken = False                 # the Event's value (cleared at the top of each cycle)
        self.idle = False                  # waiting for a wake-up with nothing to do
        self.poll: _Poll | None = None
        self.timer: asyncio.TimerHandle | None = None     # the step being modeled
        self.stopped = False
        self._soon(self._cycle)            # as a task's first step

    def _soon(self, fn: Callable[..., None], *args: Any) -> None:
        """One hop: what a task's wake-up would be."""
        self.loop.call_soon(fn, *args, context=self.ctx)

    def wake(self) -> None:
        """`Event.set()`: a waiter (idle, or the poll's inner task) resumes one hop later."""
        if self.woken or self.stopped:
            return
        self.woken = True
        if self.idle:
            self.idle = False
            self._soon(self._cycle)
        p = self.poll
        if p is not None and p.inner == 1:
            p.inner = 2
            self._soon(self._inner_step, p)

    def _cycle(self) -> None:
        """The top of the loop."""
        if self.stopped:
            return
        eng = self.aeng.engine
        try:
            while True:
                self.woken = False
                if not eng.has_work():
                    self.idle = True
                    return
                outputs = eng.step()
                modeled = eng.step_seconds()
                if modeled > 0:
                    # asyncio.sleep(modeled): its timer sets a future, whose callback wakes the task.
                    self.timer = self.loop.call_at(self.loop.time() + modeled, self._step_due, outputs,
                                                   context=self.ctx)
                    return
                if not self._handed_out(outputs):
                    return
        except Exception as e:
            self._crash(e)

    def _step_due(self, outputs: list[RequestOutput]) -> None:
        self.timer = None
        if not self.stopped:
            self._soon(self._stepped, outputs)

    def _stepped(self, outputs: list[RequestOutput]) -> None:
        if self.stopped:
            return
        try:
            if not self._handed_out(outputs):
                return
        except Exception as e:
            self._crash(e)
            return
        self._cycle()

    def _handed_out(self, outputs: list[RequestOutput]) -> bool:
        """Hand the step's outputs out; -> False: it produced nothing, the idle poll starts."""
        self.aeng._hand_out(outputs)
        if outputs:
            return True
        # wait_for: its timer first, then the inner task (its first step one hop later).
        self.poll = p = _Poll()
        p.timer = self.loop.call_at(self.loop.time() + _IDLE_POLL_S, self._poll_timeout, p, context=self.ctx)
        self._soon(self._inner_step, p)
        return False

    # ---- the idle poll: wait_for(event.wait(), _IDLE_POLL_S), hop for hop -----------------
    def _inner_step(self, p: _Poll) -> None:
        """A step of the inner task: its first (done at once if the Event is set, else it
        waits), the one after its Event was set, or the one a cancel throws into."""
        if p.dead:
            return
        if p.must_cancel or p.inner == 2 or (p.inner == 0 and self.woken):
            p.inner = 3
            self._soon(self._release, p)       # its done callback: release the outer's waiter
        else:
            p.inner = 1

    def _release(self, p: _Poll) -> None:
        """`_release_waiter`: the outer wakes one hop later (unless its waiter is done)."""
        if p.dead or p.waiting == 0:
            return
        waiting, p.waiting = p.waiting, 0
        self._soon(self._outer_step, p, waiting)

    def _poll_timeout(self, p: _Poll) -> None:
        p.timer = None
        if p.dead or p.waiting != 1:
            return
        p.waiting = 0
        self._soon(self._outer_step, p, 1)

    def _outer_step(self, p: _Poll, woke_from: int) -> None:
        if p.dead:
            return
        if woke_from == 1 and p.inner != 3:
            # Timed out: cancel the inner task and wait for it (`_cancel_and_wait`).
            p.waiting = 2
            if p.inner == 1:                 # its Event future is cancelled: it resumes one hop later
                p.inner = 2
                self._soon(self._inner_step, p)
            else:                            # woken already: its next step raises
                p.must_cancel = True
            return
        # Done (the Event was set, or the cancelled inner task has ended).
        if p.timer is not None:
            p.timer.cancel()
            p.timer = None
        self.poll = None
        self._cycle()

    def _crash(self, e: Exception) -> None:
        self.stopped = True
        self.aeng._crashed(e)

    async def stop(self) -> None:
        """Cancel what is scheduled; then two hops, as cancelling and awaiting the task took."""
        if self.stopped:
            return
        self.stopped = True
        if self.timer is not None:
            self.timer.cancel()
        p = self.poll
        if p is not None:
            p.dead = True
            if p.timer is not None:
                p.timer.cancel()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
