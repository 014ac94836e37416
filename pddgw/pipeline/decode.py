"""The decode side of a node (RLD and MD run the same worker).

States of one request here (`DecodeState`): IMPORTING (`open`; P's KV lands
through `import_kv`), HOLDING (prompt KV complete, nothing sampled: MD waits
for the handoff), DECODING (tokens sampled and emitted in order), HANDING_OFF
(RLD only; rounds in handoff.py), DONE (blocks freed).  A re-drive
(`open_compute`) skips to HOLDING or DECODING; a relaying P's own request
(`open_local`) waits IMPORTING for its prefill, then `adopt` starts it
DECODING on the prefill's blocks.  The request's lifecycle:
docs/architecture.md.

Invariants:
  * position-keyed sampling makes what a node emits identical to what any
    other node would emit, so the router may merge overlapping streams;
  * each session owns its request's output stream from `open` on, so closing
    the session leaves nothing registered in the AsyncEngine;
  * every emitted position carries its `TokenLogprobs` when asked for (P's
    first token with those P sent); handed-off tokens are never emitted here;
  * one reader task per worker (the AsyncEngine step sink) emits a step's
    tokens together, one `TokenRun` per request.

P's KV lands without waiting for engine steps where `kv_destination` allows
(a whole block straight into the pool); other payloads are copied in between
steps, all that arrived in one go.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import replace
from collections.abc import Awaitable, Callable
from enum import IntEnum

import structlog

from pddgw.engines.async_engine import AsyncEngine, EngineStopped, RequestStream
from pddgw.core.sampling import SamplingParams
from pddgw.core.tokens import TokenLogprobs, TokenRun
from pddgw.engines.types import EngineRequest, KVChunk, KVSpan, RequestError, RequestOutput
from pddgw.pipeline.prompt_scores import PromptScores

log = structlog.get_logger(__name__)


class DecodeState(IntEnum):
    IMPORTING = 1
    HOLDING = 2
    DECODING = 3
    HANDING_OFF = 4
    DONE = 5


Emit = Callable[[TokenRun], Awaitable[None]]
# The runs of one engine step (several requests'), in step order.
EmitMany = Callable[[list[TokenRun]], Awaitable[None]]
# Emits within the call what can go at once -> the runs it did not emit (in order).
EmitNow = Callable[[list[TokenRun]], list[TokenRun]]


class _Progress:
    """Wakes whoever waits for a session's progress (`num_computed`, `state`): `notify` is a
    plain call (the reader records a step's outputs without awaiting anything)."""

    __slots__ = ("_waiters",)

    def __init__(self) -> None:
        self._waiters: list[asyncio.Future[None]] = []

    def notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    async def wait_for(self, pred: Callable[[], bool]) -> None:
        while not pred():
            w = asyncio.get_running_loop().create_future()
            self._waiters.append(w)
            await w


class _Session:
    __slots__ = ("rid", "state", "tokens", "reading", "emitted", "frozen", "num_prompt", "num_computed",
                 "progress", "decode_start", "outputs", "want_logprobs", "logprobs", "eager")

    def __init__(self, rid: str, num_prompt: int, outputs: RequestStream | None, want_logprobs: bool = False):
        self.rid = rid
        # The engine's outputs of this request, closed with the session (None: a local relay
        # not adopted yet, `DecodeWorker.adopt`).
        self.outputs = outputs
        self.state = DecodeState.IMPORTING
        self.tokens: list[int] = []      # output positions 0.. known here
        self.want_logprobs = want_logprobs
        # With want_logprobs: parallel to tokens (None for a handed-off token: not emitted here).
        self.logprobs: list[TokenLogprobs | None] = []
        self.reading = False             # its outputs are fed to the worker's reader
        self.emitted = 0                 # positions already passed to emit
        self.frozen = False              # RLD stopped for the final handoff round
        self.num_prompt = num_prompt
        self.num_computed = 0            # tokens (prompt + output) whose KV is in the engine
        self.progress = _Progress()      # notified when num_computed or state changes
        self.decode_start: tuple[float, int] | None = None   # (loop time, tokens) when decoding began
        self.eager = True                # the next token made here goes out at once (stream interval)


class DecodeWorker:
    def __init__(self, aeng: AsyncEngine, emit: Emit, emit_many: EmitMany | None = None,
                 emit_now: EmitNow | None = None, stream_interval: int = 1, engine_runs: bool = False):
        self.aeng = aeng
        # Tokens a decoding request gathers before they go out (vLLM's --stream-interval; the
        # first decoded token and a request's last run go at once), and how many the engine
        # may hold back before it hands them out (1 unless `engine_runs`: MD, where nothing
        # reads a token before its run goes out).
        self.stream_interval = stream_interval
        self.engine_interval = stream_interval if engine_runs else 1
        self.engine = aeng.engine
        self._emit = emit
        self._emit_many = emit_many or self._each
        self._emit_now = emit_now
        # Steps' outputs fed to this worker (AsyncEngine's step sink), until the reader takes
        # them; or a step recorded already, (what is left to emit, failed sessions).
        self._steps: deque[list[tuple[_Session, RequestOutput | BaseException]]
                           | tuple[list[TokenRun], list[_Session]]] = deque()
        self._reader: asyncio.Task[None] | None = None
        self._reader_wake: asyncio.Future[None] | None = None
        self.sessions: dict[str, _Session] = {}
        # Prompt logprobs of compute requests that asked, until the router fetched them (its Cancel).
        self.scored = PromptScores()
        # Chunks whose payload must still be copied into the pool: appended on the loop, taken
        # on the engine thread by `_drain_imports` (posted at most once while one is queued).
        self._imports: deque[KVChunk] = deque()
        self._drain_posted = False
        # Local relays (`open_local`) until their prefill's first token: prompt and sampling.
        self._local: dict[str, tuple[tuple[int, ...], SamplingParams]] = {}

    def _get(self, rid: str) -> _Session:
        s = self.sessions.get(rid)
        if s is None:
            raise RequestError(f"unknown request {rid!r} on this decode node")
        return s

    # ---- P -> decoder: KV import -------------------------------------------------
    async def open(self, rid: str, prompt: tuple[int, ...], sampling: SamplingParams) -> int:
        """Prepare to import the prompt KV; returns how many prompt tokens are cached here."""
        if rid in self.sessions:
            raise RequestError(f"request {rid!r} already open here")
        req = EngineRequest(rid, prompt, sampling, kv_source="import", hold=True,
                            output_interval=self.engine_interval)
        res = await self.aeng.add(req)
        self.sessions[rid] = _Session(rid, len(prompt), self.aeng.stream(rid), sampling.logprobs is not None)
        return res.num_cached_tokens

    def open_local(self, rid: str, prompt: tuple[int, ...], sampling: SamplingParams) -> int:
        """A relaying prefill node opens what it will prefill itself: nothing in the engine yet
        (`adopt` adds it once the prefill has its first token) -> the whole prompt: none of its
        KV comes over a link."""
        if rid in self.sessions:
            raise RequestError(f"request {rid!r} already open here")
        self.sessions[rid] = _Session(rid, len(prompt), None, sampling.logprobs is not None)
        self._local[rid] = (prompt, sampling)
        return len(prompt)

    async def adopt(self, rid: str, first_token: int, first_logprobs: TokenLogprobs | None) -> None:
        """This node's own prefill of a local request has its first token: decode on from it.

        The prompt's full blocks are the prefill's, still held for its other targets, found in
        the prefix cache; the engine computes the last partial block and the first token in one
        extend.  Prompt logprobs stay the prefill's (the router asks P for them).
        """
        s = self._get(rid)
        prompt, sampling = self._local.pop(rid, ((), None))
        if sampling is None or s.state != DecodeState.IMPORTING:
            raise RequestError(f"request {rid!r} is not a local relay waiting for its prefill")
        if s.want_logprobs and first_logprobs is None:
            raise RequestError(f"request {rid!r} asked for logprobs but the first token came without them")
        await self.aeng.add(EngineRequest(rid, prompt, replace(sampling, prompt_logprobs=None),
                                          output_token_ids=(first_token,), output_interval=self.engine_interval))
        if self.sessions.get(rid) is not s:          # cancelled while it was added
            await self.aeng.abort(rid)
            raise RequestError(f"request {rid!r} was cancelled")
        s.outputs = self.aeng.stream(rid)
        s.tokens.append(first_token)
        if s.want_logprobs:
            s.logprobs.append(first_logprobs)
        s.state = DecodeState.DECODING
        s.progress.notify()
        s.decode_start = (asyncio.get_running_loop().time(), len(s.tokens))
        self._read(s)
        await self._emit_new(s)

    def kv_destination(self, span: KVSpan) -> memoryview | None:
        """Where an arriving chunk's payload should be received (the engine's `import_buffer`);
        None unless the request is importing here.  On the loop, before the payload arrives."""
        s = self.sessions.get(span.request_id)
        if s is None or s.state != DecodeState.IMPORTING:
            return None
        return self.engine.import_buffer(span)

    async def import_kv(self, chunk: KVChunk) -> None:
        """Take one arrived chunk; RequestError for one the request cannot take.

        Returns without waiting for the engine: a payload already in its
        place in the pool is committed here and now; any other is queued and
        copied on the engine thread right after the step in progress, with
        every other chunk queued by then (`kv_done` waits for them).
        """
        s = self._get(chunk.request_id)
        if s.state != DecodeState.IMPORTING:
            raise RequestError(f"request {s.rid!r} is {s.state.name}, not importing")
        if self.engine.accept_kv(chunk):       # validated; committed if it landed in place
            return
        self._imports.append(chunk)
        if not self._drain_posted:
            self._drain_posted = True
            if not self.aeng.post(self._drain_imports):
                self._drain_posted = False
                raise EngineStopped("the engine is stopped")

    def past_import(self, rid: str) -> bool:
        """Whether `rid` is open here and takes no KV any more (its import is complete, or it
        computes its prompt here): a chunk for it is a late frame of an earlier attempt."""
        s = self.sessions.get(rid)
        return s is not None and s.state != DecodeState.IMPORTING

    def drop_kv(self, chunk: KVChunk) -> None:
        """A chunk of a request cancelled here: a payload that landed in the pool gives its memory back."""
        with contextlib.suppress(RequestError):
            self.engine.accept_kv(chunk)

    def _drain_imports(self) -> None:
        """Engine thread, between steps: copy every queued chunk into the pool, oldest first."""
        self._drain_posted = False           # from here on a new chunk posts another drain
        while self._imports:
            chunk = self._imports.popleft()
            try:
                self.engine.import_kv(chunk)
            except RequestError as e:
                # Checked on arrival, so the request was cancelled since (or it is a bug).
                log.info("kv_import_dropped", request_id=chunk.request_id, error=str(e))

    async def kv_done(self, rid: str, first_token: int, decode: bool,
                      first_logprobs: TokenLogprobs | None = None) -> None:
        """All prompt KV sent; the first output token (P's) is extended here.

        decode=True (RLD, or MD in P-MD): emit it (with P's `first_logprobs`
        when the request asked for logprobs) and decode on.  decode=False
        (MD in P-RLD-MD): hold until the handoff.
        """
        s = self._get(rid)
        if s.state != DecodeState.IMPORTING:
            raise RequestError(f"request {rid!r} is {s.state.name}, not importing")
        if s.want_logprobs and decode and first_logprobs is None:
            raise RequestError(f"request {rid!r} asked for logprobs but the first token came without them")

        def finish() -> None:
            self._drain_imports()            # every chunk that arrived before this message
            self.engine.finish_import(rid)
            self.engine.append_tokens(rid, (first_token,), final=decode)

        await self.aeng.call(finish)
        s.tokens.append(first_token)
        if s.want_logprobs:
            s.logprobs.append(first_logprobs)
        s.state = DecodeState.DECODING if decode else DecodeState.HOLDING
        s.progress.notify()
        if decode:
            s.decode_start = (asyncio.get_running_loop().time(), len(s.tokens))
        self._read(s)
        if decode:
            await self._emit_new(s)

    # ---- RLD -> MD: token-ID handoff (MD side) ------------------------------------
    async def extend(self, rid: str, start: int, token_ids: tuple[int, ...], final: bool) -> None:
        """Append handed-off tokens at output positions [start, start + k)."""
        s = self._get(rid)
        if s.state != DecodeState.HOLDING:
            raise RequestError(f"request {rid!r} is {s.state.name}, not waiting for a handoff")
        if start != len(s.tokens):
            raise RequestError(f"request {rid!r}: handoff starts at {start}, expected {len(s.tokens)}")
        await self.aeng.call(self.engine.append_tokens, rid, token_ids, final)
        s.tokens += token_ids
        if s.want_logprobs:
            s.logprobs += [None] * len(token_ids)       # RLD emitted them, with their logprobs
        s.emitted = len(s.tokens)          # RLD emitted these; MD emits from here on
        if final:
            s.state = DecodeState.DECODING
            return
        # A catch-up round is done when MD has extended it (all but the held last token),
        # so the next round is small and MD's cache holds what it was sent.
        target = s.num_prompt + len(s.tokens) - 1
        await s.progress.wait_for(lambda: s.num_computed >= target or s.state == DecodeState.DONE)

    # ---- RLD side of the handoff (the rounds: handoff.py) -------------------------------
    async def begin_handoff(self, rid: str) -> _Session:
        """DECODING -> HANDING_OFF; the session's `tokens` grow while rounds run.

        A request still importing (MD had its few missing blocks before RLD had
        the whole prompt over the fabric) is waited for: RLD emits P's token
        first, then hands off at once."""
        s = self._get(rid)
        if s.state == DecodeState.IMPORTING:
            await s.progress.wait_for(lambda: s.state != DecodeState.IMPORTING)
        if s.state != DecodeState.DECODING:
            raise RequestError(f"request {rid!r} is {s.state.name}, cannot hand off")
        s.state = DecodeState.HANDING_OFF
        return s

    def step_seconds(self, rid: str) -> float:
        """Mean seconds per decoded token of `rid` here so far (0 = none decoded yet)."""
        s = self._get(rid)
        if s.decode_start is None:
            return 0.0
        t0, n0 = s.decode_start
        made = len(s.tokens) - n0
        return (asyncio.get_running_loop().time() - t0) / made if made > 0 else 0.0

    async def freeze(self, rid: str) -> int:
        """Stop decoding `rid` and emit every token made; -> the end position."""
        s = self._get(rid)
        s.frozen = True                # RLD's output ends here...
        await self.aeng.abort(rid)
        await self._emit_new(s)        # ...and every token up to it is emitted
        return len(s.tokens)

    async def close(self, rid: str) -> None:
        s = self.sessions.get(rid)
        if s is not None:
            await self._close(s)

    # ---- re-drive and cancel -----------------------------------------------------------
    async def open_compute(self, rid: str, prompt: tuple[int, ...], sampling: SamplingParams,
                           hold: bool) -> int:
        """Compute the prompt here (a re-drive); with hold, wait for the emitted tokens (`extend`)."""
        if rid in self.sessions:
            raise RequestError(f"request {rid!r} already open here")
        await self.aeng.add(EngineRequest(rid, prompt, sampling, hold=hold, output_interval=self.engine_interval))
        s = self.sessions[rid] = _Session(rid, len(prompt), self.aeng.stream(rid), sampling.logprobs is not None)
        s.state = DecodeState.HOLDING if hold else DecodeState.DECODING
        if not hold:
            s.decode_start = (asyncio.get_running_loop().time(), 0)
        self._read(s)
        return 0

    async def cancel(self, rid: str) -> bool:
        s = self.sessions.get(rid)
        if s is None:
            return False
        s.frozen = True
        await self.aeng.abort(rid)
        await self._close(s)
        return True

    # ---- internals ------------------------------------------------------------------------
    def _read(self, s: _Session) -> None:
        """From now on the reader records and emits `s`'s outputs, in order, until it ends."""
        assert s.outputs is not None
        s.reading = True
        s.outputs.feed(self._on_step, s)

    def _on_step(self, got: list[tuple[_Session, RequestOutput | BaseException]]) -> None:
        """The engine's step sink: with nothing queued before it, the step is recorded here and
        its tokens emitted within the call where they can go at once (`EmitNow`); the rest
        is queued for the reader (started when none runs)."""
        if self._emit_now is not None and self._reader is None and not self._steps:
            runs: list[TokenRun] = []
            failed: list[_Session] = []
            for s, out in got:
                if s.reading:
                    self._take(s, out, runs, failed)
            if runs:
                try:
                    runs = self._emit_now(runs)
                except Exception as e:   # (a bug): the reader's emit reports it
                    log.error("decode_emit_now_failed", error=repr(e))
            if not runs and not failed:
                return
            self._steps.append((runs, failed))
        else:
            self._steps.append(got)
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_steps(), name="decode-reader")
        elif self._reader_wake is not None and not self._reader_wake.done():
            self._reader_wake.set_result(None)

    async def _read_steps(self) -> None:
        """The reader: each step's outputs recorded, then its tokens emitted in one go; it ends
        when no session is left (the next step's sink starts another)."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                while self._steps:
                    step = self._steps.popleft()
                    if isinstance(step, tuple):
                        runs, failed = step
                    else:
                        runs, failed = [], []
                        for s, out in step:
                            if s.reading:
                                self._take(s, out, runs, failed)
                    if runs:
                        await self._emit_many(runs)
                    for s in failed:      # its stream ends here: the request is aborted, if live
                        with contextlib.suppress(Exception):
                            if s.outputs is not None:
                                await s.outputs.aclose()
                if not self.sessions:
                    return
                self._reader_wake = loop.create_future()
                await self._reader_wake
                self._reader_wake = None
        finally:
            self._reader = self._reader_wake = None

    def _take(self, s: _Session, out: RequestOutput | BaseException, runs: list[TokenRun],
              failed: list[_Session]) -> None:
        """Record one engine output of `s` (adding what to emit to `runs`); a failure (the engine
        stopped or crashed, or an output that breaks the contract) ends the request here and the
        router re-drives it."""
        if s.frozen:
            s.reading = False
            return
        try:
            if isinstance(out, BaseException):
                raise out
            if not self._on_output(s, out, runs):
                s.reading = False
        except Exception as e:
            s.reading = False
            if not s.frozen:
                log.warning("decode_stream_failed", request_id=s.rid, error=repr(e))
                runs.append(TokenRun(s.rid, len(s.tokens), (), True, "error", error=str(e)))
            self._finish(s)
            failed.append(s)

    async def _each(self, runs: list[TokenRun]) -> None:
        for run in runs:
            await self._emit(run)

    def _on_output(self, s: _Session, out: RequestOutput, runs: list[TokenRun]) -> bool:
        """Record one engine output (what to emit goes to `runs`); False once the request has
        ended here."""
        if out.prompt_logprobs:
            self.scored.put(s.rid, out.prompt_logprobs)
        s.num_computed = out.num_computed_tokens
        s.progress.notify()
        if out.ids:
            assert out.position == len(s.tokens), (out.position, len(s.tokens))
            s.tokens += out.ids
            if s.want_logprobs:
                if len(out.logprobs) != len(out.ids):
                    raise RequestError(f"request {s.rid!r} asked for logprobs; this engine gave "
                                       f"{len(out.logprobs)} for {len(out.ids)} tokens")
                s.logprobs += out.logprobs
        if out.done:
            if out.reason != "abort":
                self._finish(s)
                run = self._take_new(s, finished=True, reason=out.reason or "")
                if run is not None:
                    runs.append(run)
            return False
        if s.state in (DecodeState.DECODING, DecodeState.HANDING_OFF) \
                and (s.eager or len(s.tokens) - s.emitted >= self.stream_interval):
            s.eager = False
            run = self._take_new(s)
            if run is not None:
                runs.append(run)
        return True

    def _take_new(self, s: _Session, finished: bool = False, reason: str = "") -> TokenRun | None:
        """The tokens of `s` not emitted yet, as the run that emits them (None: nothing new)."""
        new = tuple(s.tokens[s.emitted :])
        if not new and not finished:
            return None
        lps: tuple[TokenLogprobs, ...] = ()
        if s.want_logprobs and new:
            got = s.logprobs[s.emitted : len(s.tokens)]
            assert all(lp is not None for lp in got), f"request {s.rid}: emitting tokens without logprobs"
            lps = tuple(got)  # type: ignore[arg-type]
        pos, s.emitted = s.emitted, len(s.tokens)
        return TokenRun(s.rid, pos, new, finished, reason, lps)

    async def _emit_new(self, s: _Session, finished: bool = False, reason: str = "") -> None:
        run = self._take_new(s, finished, reason)
        if run is not None:
            await self._emit(run)

    def _finish(self, s: _Session) -> None:
        """The request has ended here: wake whoever waits on its progress."""
        s.state = DecodeState.DONE
        s.progress.notify()
        self.sessions.pop(s.rid, None)
        self._local.pop(s.rid, None)
        if not self.sessions and self._reader_wake is not None and not self._reader_wake.done():
            self._reader_wake.set_result(None)       # an idle reader with no session left ends

    async def _close(self, s: _Session) -> None:
        self._finish(s)
        s.reading = False      # what the reader still holds of it is dropped
        # However far the request got (importing, or its reader never started), its stream
        # ends here: the engine's entry for it goes, and the request is aborted if still live.
        if s.outputs is not None:
            await s.outputs.aclose()
