"""One simulated run: a deployment, a workload, a virtual clock.

`run_deployment` builds the deployment as `pddgw serve` builds the embedded one
(`deploy.serve.Embedded`: the real router, policy, state machine and workers over in-process
links, shaped per `[[net.links]]`) with cost-model engines, on the running loop.  A client per
conversation plays its turns against `Router.run` and records what a user sees.  Nothing here
branches the control plane: on a virtual loop every sleep, timeout, transfer and engine step
takes virtual time.  A `Watch` may stop the run once what it is for is settled.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from array import array
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from pddgw.config import Config
from pddgw.sim.costmodel_engine import CostModelEngine
from pddgw.core.sampling import SamplingParams
from pddgw.core.tokens import TokenRun
from pddgw.net.link import Priority
from pddgw.net.shaping import Shaper
from pddgw.deploy.serve import Embedded
from pddgw.pipeline.router import Router, RouterError
from pddgw.sim.workload import Conversation, PromptBuilder, Turn


@dataclass(slots=True)
class RequestResult:
    """What one request did, as the user and the router saw it (times in seconds)."""

    rid: str
    conversation: int
    turn: int
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    target_hit: float                 # the workload's intended prefix hit (share of the prompt)
    output_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None       # mean gap per token after the first
    e2e_s: float | None = None
    pipeline: str | None = None
    handoff_mode: str | None = None
    handoff_stall_ms: float | None = None
    catchup_rounds: int = 0           # non-final handoff rounds
    rld_tokens: int = 0
    md_tokens: int = 0
    md_cached_tokens: int = 0         # MD's prefix hit
    error: str | None = None
    output_digest: str = ""           # of the output token ids (same-output checks without keeping them)
    # Gap before each output token after the first (inter-token latency).
    itl_s: array = field(default_factory=lambda: array("d"))


@dataclass(slots=True)
class RunResult:
    requests: list[RequestResult]
    duration_s: float                 # virtual: first arrival to last answer
    drain_s: float                    # after the last answer, until background transfers ended
    wall_s: float
    wan_kv_bytes: int
    # "name src->dst" -> share of the run the shared wire was serializing
    link_utilisation: dict[str, float]
    # role -> mean share of the run its engines spent in forward passes
    engine_busy: dict[str, float]
    # started / completed / superseded (dropped: the next turn came first) / failed
    alignments: dict[str, int]
    rld_full: int                     # requests sent P-MD because RLD had no room
    # "name src->dst" -> per class ("foreground", "background") bytes and wire seconds,
    # and the QoS proof: background bytes serialized while a foreground frame waited
    wan_classes: dict[str, dict[str, float]]
    redrives: int                     # requests the router restarted on another path
    # role -> recompute preemptions (a full pool evicting a running sequence)
    preemptions: dict[str, int]
    leaked_blocks: int                # KV blocks still in use on any node at the end (must be 0)
    leaked_pins: int
    # A watcher ended the run once its outcome was settled (`Decided`): `requests` holds those
    # that ended before, the rest were cancelled, nothing drained (and `leaked_*` mean nothing).
    decided: bool = False


def served_rps(run: RunResult) -> float:
    """Requests a run served without an error, per second of it."""
    return sum(r.error is None for r in run.requests) / run.duration_s


class Decided(Exception):
    """Raised by a `Watch` when what the run is for is settled: `run_deployment` stops it there."""


class Watch(Protocol):
    """Sees every request as it arrives (its result being filled) and as it ends; may raise `Decided`.
    It reads, never waits or schedules: a run it lets finish is the run without it, event for event."""

    def arrived(self, res: RequestResult) -> None: ...

    def finished(self, res: RequestResult) -> None: ...


def _classes(sh: Shaper) -> dict[str, float]:
    fg, bg = sh.classes[Priority.FOREGROUND], sh.classes[Priority.BACKGROUND]
    return {"foreground_gb": round(fg.bytes_booked / 1e9, 3), "foreground_busy_s": round(fg.busy_s, 3),
            "background_gb": round(bg.bytes_booked / 1e9, 3), "background_busy_s": round(bg.busy_s, 3),
            "bg_bytes_ahead_of_fg": sh.bg_bytes_ahead_of_fg}


def token_digest(token_ids: list[int] | tuple[int, ...]) -> str:
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=12).hexdigest()


async def _one(router: Router, rid: str, prompt: tuple[int, ...], turn: Turn, seed: int,
               res: RequestResult) -> tuple[int, ...]:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    last = t0
    out: list[int] = []

    async def emit(run: TokenRun) -> None:
        nonlocal last
        now = loop.time()
        if res.ttft_s is None:
            res.ttft_s = now - t0
        else:
            res.itl_s.append(now - last)
        if len(run.ids) > 1:
            res.itl_s.extend([0.0] * (len(run.ids) - 1))
        last = now
        out.extend(run.ids)

    try:
        outcome = await router.run(rid, prompt, SamplingParams(max_tokens=turn.max_tokens, temperature=1.0,
                                                               seed=seed), emit)
    except RouterError as e:
        res.error = f"{e.code}: {e}"
        res.output_tokens = len(out)
        return tuple(out)
    rec = outcome.record
    res.output_digest = token_digest(out)
    res.e2e_s = loop.time() - t0
    res.output_tokens = len(out)
    if res.ttft_s is not None and len(out) > 1:
        res.tpot_s = (last - t0 - res.ttft_s) / (len(out) - 1)
    res.pipeline, res.handoff_mode, res.handoff_stall_ms = rec.pipeline, rec.handoff_mode, rec.handoff_stall_ms
    res.catchup_rounds = max(0, len(rec.handoff_positions) - 1)
    by_role = dict(rec.tokens_by_role)
    res.rld_tokens, res.md_tokens = by_role.get("rld", 0), by_role.get("md", 0)
    res.md_cached_tokens = outcome.cached_tokens
    return tuple(out)


# (result to fill, prompt, turn, seed) -> the answer's token ids
Serve = Callable[[RequestResult, tuple[int, ...], Turn, int], Awaitable[tuple[int, ...]]]


async def play_conversation(conv: Conversation, shared_prefix: tuple[int, ...], t0: float, serve: Serve,
                            done: Callable[[RequestResult], None], block_size: int = 0) -> None:
    """One user: wait for the conversation's start (t0 + start_s on the loop's clock), then
    per turn think, build the prompt from the last answer, ask `serve`, report the result;
    an error ends the conversation (the user gives up).  `block_size`: the deployment runs in
    this process with blocks of that size (`PromptBuilder` notes each prompt's hashes)."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, t0 + conv.start_s - loop.time()))
    prompts = PromptBuilder(conv, shared_prefix, block_size)
    for k, turn in enumerate(conv.turns):
        if turn.think_s:
            await asyncio.sleep(turn.think_s)
        prompt = prompts.prompt(k)
        res = RequestResult(f"c{conv.cid}-t{k}", conv.cid, k, loop.time() - t0, len(prompt),
                            turn.max_tokens, turn.hit)
        out = await serve(res, prompt, turn, conv.seed + k)
        done(res)
        if res.error is not None:
            return
        prompts.answered(prompt, out)


async def run_deployment(cfg: Config, conversations: list[Conversation], shared_prefix: tuple[int, ...],
                         on_request: Callable[[RequestResult], None] | None = None,
                         watch: Watch | None = None) -> RunResult:
    """Serve `conversations` on deployment `cfg` (cost-model engines) on the running loop; `watch` may
    end the run early (`RunResult.decided`)."""
    wall0 = time.perf_counter()
    loop = asyncio.get_running_loop()
    emb = Embedded(cfg)
    side = await emb.start()
    router = side.router
    t0 = loop.time()
    results: list[RequestResult] = []

    def done(res: RequestResult) -> None:
        results.append(res)
        if on_request is not None:
            on_request(res)
        if watch is not None:
            watch.finished(res)

    async def serve(res: RequestResult, prompt: tuple[int, ...], turn: Turn, seed: int) -> tuple[int, ...]:
        if watch is not None:
            watch.arrived(res)
        return await _one(router, res.rid, prompt, turn, seed, res)

    bs = cfg.engine.block_size
    users = [asyncio.ensure_future(play_conversation(c, shared_prefix, t0, serve, done, bs)) for c in conversations]
    try:
        decided = False
        try:
            await asyncio.gather(*users)
        except Decided:
            decided = True
            for u in users:
                u.cancel()          # the router cancels each request on its nodes, as for a client gone
            await asyncio.gather(*users, return_exceptions=True)
        t_end = loop.time()
        if not decided:
            await router.drain()
        drain = loop.time() - t_end
        duration = max(t_end - t0, 1e-9)
        engines = {w.name: (w.role, w.engine) for w in emb.workers.values()}
        busy: dict[str, list[float]] = {}
        preempted: dict[str, int] = {}
        leaked = pins = 0
        for role, eng in engines.values():
            if isinstance(eng, CostModelEngine):
                busy.setdefault(role, []).append(eng.busy_s / duration)
            st = eng.stats()
            preempted[role] = preempted.get(role, 0) + st.preemptions
            leaked += st.used_blocks
            pins += st.pins
        # Utilisation over the whole run, background transfers after the last answer included.
        util = {f"{name} {src}->{dst}": round(sh.busy_s / max(duration + drain, 1e-9), 4)
                for (name, src, dst), sh in sorted(emb.net.shapers.items())}
        classes = {f"{name} {src}->{dst}": _classes(sh) for (name, src, dst), sh in sorted(emb.net.shapers.items())}
        results.sort(key=lambda r: (r.arrival_s, r.rid))
        return RunResult(results, duration, drain, time.perf_counter() - wall0, emb.wan_kv_bytes(), util,
                         {r: sum(v) / len(v) for r, v in sorted(busy.items())},
                         dict(router.alignments.counts), router.counts.rld_full,
                         classes, router.counts.redrives, dict(sorted(preempted.items())),
                         leaked, pins, decided)
    finally:
        for u in users:
            u.cancel()
        await emb.stop()
