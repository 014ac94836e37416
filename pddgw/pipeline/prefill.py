"""The prefill side: compute the prompt KV and stream it on every path at once.

The prompt is added as a one-token request that keeps its KV (`retain_kv`);
as each step extends the computed range, every target's sender exports the
newly computed tokens of its range (RLD: all it does not cache; MD: its
missing tail) and sends them in chunks (`tokens_per_chunk`).  The request's
lifecycle: docs/architecture.md.

Invariants:
  * targets run in parallel: a slow WAN never holds back the local fabric;
  * a target gets `done(first_token, logprobs)` as soon as it has its whole
    range and the first token is sampled (RLD does not wait for the WAN);
  * `on_first` (the router, when it asked) gets the first token the moment it
    is sampled, before any target's `done`, unless it ends the request; its
    failure costs only that head start;
  * the KV stays pinned until every target is served; a failed target is
    reported and the others go on;
  * chunks are cut at block boundaries, P's and the target's (`block_size`:
    each chunk then lands in a block of the receiver's pool as it is;
    virtual KV at P's alone), and only whole blocks go out until the prompt
    is complete; where the target's link offers the receiver's memory
    (`buffer`, in-process), P's export writes each chunk there, its one copy;
  * `demote` turns what is left of a request's transfers into background
    traffic, frame by frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

import structlog

from pddgw.engines.async_engine import AsyncEngine, RequestStream
from pddgw.core.sampling import SamplingParams
from pddgw.core.tokens import TokenLogprobs
from pddgw.engines.types import EngineRequest, KVChunk, KVSpan, RequestError
from pddgw.net.link import Priority
from pddgw.pipeline.prompt_scores import PromptScores

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class KVTarget:
    """One destination of a request's KV."""

    name: str
    start_token: int                                   # first prompt token it needs
    # Sends chunks in order at the target's priority (striped over the link's
    # connections where it has several); returns when the transport has their
    # bytes (back-pressure), with the seconds they were in service on the wire.
    send: Callable[[list[KVChunk]], Awaitable[float]]
    # All sent; the first output token and, if the request asked, its logprobs.
    done: Callable[[int, TokenLogprobs | None], Awaitable[None]]
    priority: Priority = Priority.FOREGROUND
    block_size: int = 0                                # the KV block of the target's pool (0: P's)
    # Where a chunk's payload may be exported straight into, the receiver's memory
    # (`Link.kv_buffer`; None: the link has none), asked on the loop before each export.
    buffer: Callable[[KVSpan], memoryview | None] | None = None
    sent_bytes: int = 0
    service_s: float = 0.0
    error: str | None = None


# The first output token, and its logprobs when the request asked for them.
First = tuple[int, TokenLogprobs | None]
# Takes the first token and its logprobs as soon as they are sampled.
FirstSink = Callable[[int, TokenLogprobs | None], Awaitable[None]]


@dataclass(slots=True)
class PrefillResult:
    first_token: int
    cached_tokens: int                                 # P's own prefix-cache hit
    targets: dict[str, KVTarget] = field(default_factory=dict)
    first_logprobs: TokenLogprobs | None = None        # when the request asked for logprobs


class _Progress:
    """Computed-token watermark shared by the target senders."""

    def __init__(self) -> None:
        self.computed = 0
        self.finished = False
        self.cond = asyncio.Condition()

    async def update(self, computed: int, finished: bool) -> None:
        async with self.cond:
            self.computed, self.finished = computed, finished or self.finished
            self.cond.notify_all()


# A target's whole range is sent: (target name, its class then, its wire seconds) - for metrics.
TransferObserver = Callable[[str, Priority, float], None]


class PrefillWorker:
    def __init__(self, aeng: AsyncEngine, chunk_bytes: int = 512 * 1024,
                 on_transfer: TransferObserver | None = None, engine_suffix: str = ""):
        self.aeng = aeng
        # Appended to a request's id in the engine: a relaying P's engine also holds the request's
        # relay under its own id (`DecodeWorker.adopt`).  Exported chunks carry the request's id.
        self.engine_suffix = engine_suffix
        self.on_transfer = on_transfer
        self.engine = aeng.engine
        self.block_size = self.engine.kv_layout.block_size
        self.chunk_bytes = chunk_bytes
        self.inflight: dict[str, list[KVTarget]] = {}
        # Prompt logprobs of requests that asked, until the router fetched them (its Cancel).
        self.scored = PromptScores()

    async def prefill(self, rid: str, prompt: tuple[int, ...], sampling: SamplingParams,
                      targets: list[KVTarget], on_first: FirstSink | None = None) -> PrefillResult:
        if rid in self.inflight:
            raise RequestError(f"request {rid!r} is already prefilling here")
        n = len(prompt)
        for t in targets:
            if not 0 <= t.start_token <= n:
                raise RequestError(f"target {t.name}: start token {t.start_token} outside [0, {n}]")
        # Every sampling field but the length is the request's own: the first token is drawn exactly
        # as a single node would draw it (listing fields dropped min_p once; the stop tokens and
        # ignore_eos stay, as min_tokens masks by them at position 0).
        eid = rid + self.engine_suffix
        req = EngineRequest(eid, prompt, replace(sampling, max_tokens=1, min_tokens=min(sampling.min_tokens, 1)),
                            retain_kv=True)
        self.inflight[rid] = targets
        progress = _Progress()
        first: asyncio.Future[First] = asyncio.get_running_loop().create_future()
        senders: list[asyncio.Task[None]] = []
        outputs: RequestStream | None = None
        try:
            result = await self.aeng.add(req)
            outputs = self.aeng.stream(eid)
            senders = [asyncio.create_task(self._serve_target(rid, n, t, progress, first),
                                           name=f"kv-{rid}-{t.name}") for t in targets]
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    if out.prompt_logprobs:
                        self.scored.put(rid, out.prompt_logprobs)
                    early = out.ids and not first.done()
                    if early:
                        first.set_result((out.ids[0], out.logprobs[0] if out.logprobs else None))
                    await progress.update(min(out.num_computed_tokens, n), out.done)
                    if early and on_first is not None and out.reason != "stop":
                        await _tell_first(rid, on_first, *first.result())
            if not first.done():
                raise RequestError(f"request {rid!r} ended on P without a first token")
            await asyncio.gather(*senders)
            token, lp = first.result()
            return PrefillResult(token, result.num_cached_tokens, {t.name: t for t in targets}, lp)
        finally:
            # To the end even when cancelled again meanwhile (a Cancel and the link's own
            # cancellation): an interrupted abort would leave the retained KV on P for good.
            await _uninterrupted(self._release(rid, first, senders, outputs))

    async def _release(self, rid: str, first: asyncio.Future[First], senders: list[asyncio.Task[None]],
                       outputs: RequestStream | None) -> None:
        if not first.done():
            first.cancel()
        for task in senders:
            task.cancel()
        for task in senders:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # Retained KV is released (or the request aborted) whatever happened.
        if outputs is not None:
            await outputs.aclose()
            await self.aeng.abort(rid + self.engine_suffix)
        self.inflight.pop(rid, None)

    def demote(self, rid: str) -> bool:
        """What is left of `rid`'s transfers goes as background traffic; False if none is in flight."""
        targets = self.inflight.get(rid)
        for t in targets or ():
            t.priority = Priority.BACKGROUND
        return targets is not None

    async def _serve_target(self, rid: str, n: int, target: KVTarget, progress: _Progress,
                            first: asyncio.Future[First]) -> None:
        """Everything one target needs, at its own pace: its KV range, then the first token."""
        try:
            await self._send_all(rid, n, target, progress)
            if self.on_transfer is not None and target.sent_bytes:
                # Before `done`: the decoder cannot start (nor the request end) before this is counted.
                self.on_transfer(target.name, target.priority, target.service_s)
            await target.done(*await asyncio.shield(first))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            target.error = f"{type(e).__name__}: {e}"
            log.warning("kv_target_failed", request_id=rid, target=target.name, error=target.error)

    async def _send_all(self, rid: str, n: int, target: KVTarget, progress: _Progress) -> None:
        """Send [start_token, n) in chunks as the computed watermark passes them."""
        sent = target.start_token
        real = not self.engine.virtual_kv       # virtual KV lands nowhere: P's blocks alone
        bs = math.lcm(self.block_size, target.block_size or self.block_size) if real else self.block_size
        step = tokens_per_chunk(self.engine.kv_layout.bytes_per_token(), bs, self.chunk_bytes, in_place=real)

        def sendable() -> int:
            """Computed tokens that may go out: whole blocks only until the prompt is complete."""
            c = min(progress.computed, n)
            return c if c == n or progress.finished else c - c % bs

        while sent < n:
            async with progress.cond:
                await progress.cond.wait_for(lambda: sendable() > sent or progress.finished)  # noqa: B023
                upto = sendable()
            if upto <= sent:
                raise RequestError(f"request {rid!r} ended on P before tokens [{sent}, {n}) were computed")
            # Everything newly computed goes out as one batch of chunks, cut at multiples of
            # the chunk size (whole blocks when that is a block multiple).
            bounds = []
            a = sent
            while a < upto:
                b = min(upto, (a // step + 1) * step)
                bounds.append((a, b))
                a = b
            chunks = await self.aeng.call(self._export, rid, bounds, self._buffers(rid, bounds, target))
            target.service_s += await target.send(chunks)
            target.sent_bytes += sum(c.nbytes for c in chunks)
            sent = upto

    def _buffers(self, rid: str, bounds: list[tuple[int, int]], target: KVTarget) -> list[memoryview | None]:
        """On the loop: the receiver's memory for each chunk where the target's link offers it, else None."""
        if target.buffer is None or self.engine.virtual_kv:
            return [None] * len(bounds)
        return [target.buffer(self.engine.kv_layout.span(rid, (a, b))) for a, b in bounds]

    def _export(self, rid: str, bounds: list[tuple[int, int]], into: list[memoryview | None]) -> list[KVChunk]:
        """Engine thread: the chunks of these token ranges of `rid`'s prompt, named `rid`, each
        written into its buffer in `into` where it has one."""
        eid = rid + self.engine_suffix
        chunks = [self.engine.export_kv(eid, a, b) if buf is None else self.engine.export_kv_into(eid, a, b, buf)
                  for (a, b), buf in zip(bounds, into, strict=True)]
        if self.engine_suffix:
            chunks = [replace(c, span=replace(c.span, request_id=rid)) for c in chunks]
        return chunks


async def _tell_first(rid: str, on_first: FirstSink, token: int, lp: TokenLogprobs | None) -> None:
    """The head start: a failure here is the router's link's, which the request's own paths hear."""
    try:
        await on_first(token, lp)
    except Exception as e:
        log.warning("first_token_not_sent", request_id=rid, error=f"{type(e).__name__}: {e}")


async def _uninterrupted(coro: Coroutine[Any, Any, None]) -> None:
    """Run `coro` to its end; a cancellation meanwhile is re-raised once it is done."""
    task = asyncio.ensure_future(coro)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    task.result()


def tokens_per_chunk(bytes_per_token: int, block_size: int, chunk_bytes: int, in_place: bool = True) -> int:
    """Tokens per KV chunk for chunks of about `chunk_bytes`.

    One block when a block's KV is within 4x of `chunk_bytes` and payloads
    are real (`in_place`: the receiver can take it into its pool as is);
    else whole blocks while a block is smaller; else (a block too big for one
    frame, or virtual KV) about `chunk_bytes` worth of tokens.
    """
    block_bytes = block_size * bytes_per_token
    if in_place and chunk_bytes // 4 <= block_bytes <= 4 * chunk_bytes:
        return block_size
    if block_bytes < chunk_bytes:
        return chunk_bytes // block_bytes * block_size
    return max(1, chunk_bytes // bytes_per_token)
