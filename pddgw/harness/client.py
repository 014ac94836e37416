"""Load clients of the router's /v1/responses WebSocket: one response, closed-loop load, a whole run.

`respond` sends one `response.create` (token ids in and out) and fills an `Answer` in place
until `response.completed`, `error` or the socket closes, so a cancelled caller keeps what
streamed.  Times are the event loop's clock.

`converse(i, ...)` is client i: until `stop_at`, greedy requests back to back on one socket,
each an `Outcome`: conversations (the `shared` system prompt, then turns re-sending the
conversation so far) and, with probability `singular_share`, a long uncached prompt.
`ask` reads one response into an Outcome: "completed", "error" (its code) or "lost".

`check_outcomes` compares against `references` (what `pddgw generate` gives): streamed tokens
equal the reference (an error's: a prefix), a completion's ids equal the streamed ones,
positions came once in order.  `run_load` is the soak's whole run.  Prompt ids are printable
bytes of the tiny model's vocabulary, [32, 127).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import signal
import sys
import tempfile
import time
from array import array
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from pddgw.harness.cluster import ClusterToml
from pddgw.harness.deployment import Deployment, Fault, FaultRecord, ProcRss, apply_faults, utc
from pddgw.harness.leaks import Leaks, measure_leaks, router_state
from pddgw.harness.reference import Prompt, generate_cli_many, generate_engine


@dataclass(slots=True)
class Answer:
    tokens: list[int] = field(default_factory=list)
    positions_ok: bool = True          # every delta came at the next position, none empty
    response_id: str | None = None     # from response.created
    sent_t: float = 0.0
    first_t: float | None = None       # the first delta
    last_t: float = 0.0                # the latest delta
    # Gap before each token: the first token of a delta waited since the last delta, the rest 0.
    itl: array = field(default_factory=lambda: array("d"))
    end_t: float | None = None         # when `final` came
    final: dict[str, Any] | None = None            # the response.completed or error event
    closed: str | None = None          # the WebSocket message type that ended it early (e.g. "CLOSED")


async def respond(ws: aiohttp.ClientWebSocketResponse, answer: Answer, prompt: Sequence[int], max_tokens: int,
                  temperature: float = 0.0, seed: int = 0) -> Answer:
    """Send one response.create and read its events into `answer` (-> `answer`)."""
    loop = asyncio.get_running_loop()
    answer.sent_t = loop.time()
    await ws.send_bytes(orjson.dumps({"type": "response.create", "prompt_token_ids": prompt,
                                      "max_output_tokens": max_tokens, "temperature": temperature, "seed": seed,
                                      "return_token_ids": True}))
    while True:
        msg = await ws.receive()
        now = loop.time()
        if msg.type not in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
            answer.closed = msg.type.name
            return answer
        ev = orjson.loads(msg.data)
        kind = ev.get("type")
        if kind == "response.created":
            answer.response_id = ev["response"]["id"]
        elif kind == "response.output_text.delta":
            ext = ev["pddgw"]
            ids = ext["token_ids"]
            if ext["position"] != len(answer.tokens) or not ids:
                answer.positions_ok = False
            if answer.first_t is None:
                answer.first_t = now
            else:
                answer.itl.append(now - answer.last_t)
            answer.itl.extend([0.0] * (len(ids) - 1))
            answer.last_t = now
            answer.tokens += ids
        elif kind in ("response.completed", "error"):
            answer.final, answer.end_t = ev, now
            return answer


# ---- closed-loop load ---------------------------------------------------------------

TOKEN_LO, TOKEN_HI = 32, 127                          # printable bytes of the tiny model's vocabulary


@dataclass(frozen=True, slots=True)
class Mix:
    """Prompt shapes: conversations (shared system prompt + own context + turns) and singular prompts."""

    shared_prefix_tokens: int = 128
    context_min: int = 800              # a first turn misses its own context on MD: more than the P-MD
    context_max: int = 1100             # budget carries (~550 tokens in cluster mode, ~713 embedded)
    message_min: int = 15
    message_max: int = 40
    singular_tokens: int = 2200         # > policy.singular_min_uncached_tokens (2048 by default)
    singular_max_output: int = 8        # <= policy.singular_max_output_tokens (16)
    max_prompt_tokens: int = 3800       # start a new conversation before the 4096 context fills


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]


@dataclass(slots=True, kw_only=True)
class Outcome(Answer):
    """One request of the load: what it asked, how it ended, and (the Answer) what streamed, filled as it
    comes (a cancelled request keeps what came before the cancel)."""

    kind: str                                 # "turn" | "singular" | "warmup"
    prompt: tuple[int, ...]
    max_tokens: int
    status: str = "lost"                      # "completed" | "error" | "lost"
    lost_reason: str | None = None            # "timeout" | "socket_closed"
    code: str | None = None
    message: str | None = None
    completed_ids: list[int] | None = None
    pipeline: str | None = None
    handoff_mode: str | None = None
    redrives: int = 0


async def ask(ws: aiohttp.ClientWebSocketResponse, out: Outcome) -> None:
    """One greedy request (seed 0) into `out` (cancellation leaves it lost)."""
    ev = (await respond(ws, out, out.prompt, out.max_tokens, temperature=0, seed=0)).final
    if ev is None:
        out.lost_reason = "socket_closed"
    elif ev["type"] == "response.completed":
        tl = ev["response"].get("pddgw") or {}
        out.status = "completed"
        # Asked for by `respond`: a completion without them fails the check (None != the streamed ids).
        ids = tl.get("output_token_ids")
        out.completed_ids = None if ids is None else list(ids)
        out.pipeline, out.handoff_mode = tl.get("pipeline"), tl.get("handoff_mode")
        out.redrives = len(tl.get("redrives") or ())
    else:
        err = ev.get("error") or {}
        out.status = "error"
        out.code, out.message = str(err.get("code") or err.get("type") or "unknown"), err.get("message")


async def converse(i: int, url: str, session: aiohttp.ClientSession, shared: list[int], stop_at: float,
                   outcomes: list[Outcome], *, seed: int, mix: Mix, singular_share: float, max_tokens: int,
                   turns: int) -> None:
    """Client i: conversations and singular prompts back to back until `stop_at` (loop time)."""
    loop = asyncio.get_running_loop()
    rng = random.Random(seed * 7919 + i)
    history: list[int] | None = None
    turns_left = 0
    ws: aiohttp.ClientWebSocketResponse | None = None
    try:
        while loop.time() < stop_at:
            if ws is None or ws.closed:
                try:
                    ws = await session.ws_connect(url + "/v1/responses", max_msg_size=64 << 20)
                except (aiohttp.ClientError, OSError):
                    await asyncio.sleep(0.5)
                    continue
            if rng.random() < singular_share:
                out = Outcome(kind="singular", prompt=tuple(tokens(rng, mix.singular_tokens)),
                              max_tokens=min(mix.singular_max_output, max_tokens))
            else:
                if history is None or turns_left <= 0 or len(history) + mix.message_max + max_tokens \
                        > mix.max_prompt_tokens:
                    history = shared + tokens(rng, rng.randint(mix.context_min, mix.context_max))
                    turns_left = turns
                prompt = history + tokens(rng, rng.randint(mix.message_min, mix.message_max))
                out = Outcome(kind="turn", prompt=tuple(prompt),
                              max_tokens=rng.randint(max(1, max_tokens // 2), max_tokens))
            outcomes.append(out)
            try:
                await ask(ws, out)
            except (aiohttp.ClientError, OSError, RuntimeError):     # the socket broke under the send
                out.lost_reason = "socket_closed"
                await ws.close()
            if out.kind == "turn":
                if out.status == "completed":
                    history = list(out.prompt) + out.tokens        # the conversation goes on from what came
                    turns_left -= 1
                else:
                    history = None
            if out.status != "completed":
                await asyncio.sleep(0.2)        # an error or a dropped socket: do not spin on a failing path
    finally:
        if ws is not None:
            await ws.close()


async def references(load: Sequence[Outcome], dtype: str, how: str = "engine") -> dict[Prompt, list[int]]:
    """The reference of every (prompt, max tokens) that streamed something or ended; `how`: "engine"
    (`pddgw generate`'s code path in this process, on a worker thread) or "cli" (the command)."""
    distinct = sorted({(o.prompt, o.max_tokens) for o in load if o.status != "lost" or o.tokens})
    if how == "cli":
        refs = await generate_cli_many(distinct, dtype)
    else:
        refs = await asyncio.to_thread(generate_engine, distinct, dtype)
    return dict(zip(distinct, refs))


def check_outcomes(load: Sequence[Outcome], ref: Mapping[Prompt, list[int]], t0: float, unix0: float,
                   limit: int = 10) -> tuple[int, int, list[dict[str, Any]]]:
    """-> (requests with a wrong token, requests whose positions did not come once in order, the first
    `limit` wrong / out-of-order / lost requests as examples; times from `t0`, UTC from `unix0`).
    A lost request without a reason gets "timeout"."""
    examples: list[dict[str, Any]] = []

    def example(o: Outcome, what: str, **extra: Any) -> None:
        if len(examples) < limit:
            examples.append({"what": what, "kind": o.kind,
                             "response_id": o.response_id or (o.final or {}).get("response_id"),
                             "prompt_tokens": len(o.prompt), "max_tokens": o.max_tokens,
                             "sent_s": round(o.sent_t - t0, 3), "sent_utc": utc(unix0 + o.sent_t - t0),
                             "status": o.status, "code": o.code, "pipeline": o.pipeline, "streamed": len(o.tokens),
                             **extra})

    wrong = disorder = 0
    for o in load:
        if o.status == "lost" and not o.tokens:
            continue
        expected = ref[(o.prompt, o.max_tokens)]
        bad = o.tokens != expected if o.status == "completed" else o.tokens != expected[:len(o.tokens)]
        if o.status == "completed" and o.completed_ids != o.tokens:
            bad = True
        if bad:
            wrong += 1
            first = next((k for k, (a, b) in enumerate(zip(o.tokens, expected)) if a != b),
                         min(len(o.tokens), len(expected)))
            example(o, "wrong tokens", first_difference=first, expected_len=len(expected),
                    completed_ids_match=o.completed_ids == o.tokens if o.completed_ids is not None else None)
        if not o.positions_ok:
            disorder += 1
            example(o, "positions not once in order")
    for o in load:
        if o.status == "lost":
            o.lost_reason = o.lost_reason or "timeout"     # no end by the caller's deadline
            example(o, "lost", reason=o.lost_reason)
    return wrong, disorder, examples


class Progress:
    """A tqdm bar over the load's seconds on a terminal (stderr); nothing otherwise."""

    def __init__(self, enabled: bool, total_s: float, desc: str):
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=round(total_s), unit="s", file=sys.stderr, desc=desc, leave=False)

    def update(self, elapsed_s: float, outcomes: list[Outcome]) -> None:
        if self.bar is None:
            return
        c = Counter(o.status for o in outcomes if o.end_t is not None)
        self.bar.n = min(self.bar.total, int(elapsed_s))
        self.bar.set_postfix(done=c["completed"], errors=c["error"], refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---- a whole run: deployment, load, faults, checks ----------------------------------


@dataclass(frozen=True, slots=True)
class LoadRun:
    outcomes: list[Outcome]             # the load's requests (not the warm-up), checked
    faults: list[FaultRecord]           # by time; those not yet due when the load ended: skipped, last
    load_s: float                       # from the start of the load to the last request's end (> 0)
    wrong_tokens: int                   # requests whose tokens differ from the reference
    positions_not_in_order: int         # requests whose positions came twice, skipped or out of order
    examples: list[dict[str, Any]]      # the first wrong / out-of-order / lost requests
    leaks: Leaks
    state: dict[str, Any]               # the router's last /debug/state of the leak check
    stuck_state: dict[str, Any] | None  # /debug/state after the grace period if requests were still open
    rss: dict[str, ProcRss]
    logs: str | None                    # the directory of config.toml and the node logs, when kept
    ok: bool                            # nothing lost, wrong, out of order or leaked; no process crashed


async def run_load(toml: ClusterToml | None, dtype: str, faults: Sequence[Fault], *, clients: int,
                   duration_s: float, grace_s: float, quiet_timeout_s: float, drain_timeout_s: float,
                   reference: str, keep: Path | None, name: str, progress: bool, seed: int, mix: Mix,
                   singular_share: float, max_tokens: int, turns: int) -> LoadRun:
    """A whole run on `Deployment(keep or a temporary directory, toml, dtype)`: start, warm up, `clients`
    `converse` clients for `duration_s` while `apply_faults` runs `faults`, `grace_s` for what is in flight
    (later: lost), the restarts back, `measure_leaks` within `quiet_timeout_s`, RSS at both ends, stop, then
    `references` and `check_outcomes`.  The directory stays (said on stderr) with `keep` or when the run
    failed or raised.  RuntimeError: the deployment did not start or the warm-up failed."""
    loop = asyncio.get_running_loop()
    directory = keep or Path(tempfile.mkdtemp(prefix=f"pddgw-{name}-"))
    directory.mkdir(parents=True, exist_ok=True)
    dep = Deployment(directory, toml, dtype)
    outcomes: list[Outcome] = []
    records: list[FaultRecord] = []
    pending: list[asyncio.Task[None]] = []
    stuck_state: dict[str, Any] | None = None
    ok = False
    try:
        async with contextlib.AsyncExitStack() as stack:
            session = await stack.enter_async_context(aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)))
            stack.push_async_callback(dep.stop)
            await dep.start()
            # Ids below the load's range: the warm-up shares no block with it.
            warm = Outcome(kind="warmup", prompt=tuple(1 + i % 30 for i in range(64)), max_tokens=4)
            async with session.ws_connect(dep.url + "/v1/responses") as ws:
                await asyncio.wait_for(ask(ws, warm), 120)
            if warm.status != "completed":
                raise RuntimeError(f"warm-up request failed: {warm.code} {warm.message}\n{dep.procs.log('router')}")
            dep.sample_rss(end=False)

            shared = tokens(random.Random(seed), mix.shared_prefix_tokens)
            t0, unix0 = loop.time(), time.time()
            stop_at = t0 + duration_s
            bar = Progress(progress, duration_s, name)
            tasks = [asyncio.create_task(converse(
                i, dep.url, session, shared, stop_at, outcomes, seed=seed, mix=mix,
                singular_share=singular_share, max_tokens=max_tokens, turns=turns)) for i in range(clients)]
            schedule = asyncio.create_task(apply_faults(faults, dep, t0, drain_timeout_s, records, pending))
            try:
                while not all(c.done() for c in tasks) and loop.time() < stop_at + grace_s:
                    await asyncio.wait(tasks, timeout=0.5)
                    bar.update(loop.time() - t0, outcomes)
                if not all(c.done() for c in tasks):
                    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                        stuck_state = await router_state(session, dep.url)()   # what holds the lost requests
            finally:
                bar.close()
                for task in (*tasks, schedule):
                    task.cancel()       # past the grace period: what is still open is lost
                await asyncio.gather(*tasks, schedule, return_exceptions=True)
            load_s = max(1e-9, max([o.end_t for o in outcomes if o.end_t is not None], default=loop.time()) - t0)
            for f in faults:
                if not any(r.fault == str(f) for r in records):
                    records.append(FaultRecord(str(f), None, "skipped: the load was over"))
            await asyncio.gather(*pending, return_exceptions=True)
            restarted = [n for n, node in dep.procs.nodes.items() if node.restarts and node.alive]
            leaks, doc = await measure_leaks(router_state(session, dep.url), quiet_timeout_s, restarted)
            dep.sample_rss(end=True)
        # References once per distinct (prompt, max tokens), after the deployment stopped.
        wrong, disorder, examples = check_outcomes(outcomes, await references(outcomes, dtype, reference), t0, unix0)
        rss = dep.rss()
        crashed = any(r.exit_code not in (None, -signal.SIGKILL) for r in rss.values())    # died unbidden
        ok = leaks.quiet and not (wrong or disorder or crashed or any(o.status == "lost" for o in outcomes))
        return LoadRun(outcomes, sorted(records, key=lambda r: (r.at_s is None, r.at_s or 0.0)), load_s, wrong,
                       disorder, examples, leaks, doc, stuck_state, rss,
                       str(directory) if keep is not None or not ok else None, ok)
    finally:
        if not ok:
            print(f"{name}: node logs kept in {directory}", file=sys.stderr)
        elif keep is None:
            shutil.rmtree(directory, ignore_errors=True)
