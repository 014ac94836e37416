"""Fuzzing the front door of a real `pddgw serve` process (the embedded deployment, built-in tiny model).

Hypothesis generates batches of hostile client events -- random JSON, every
`response.create` field with a wrong type or out of range, huge and negative
numbers, unknown event types, binary frames, invalid UTF-8, deeply nested
JSON, prompts past the context length, cancels of unknown ids -- mixed with
small valid requests, sent back to back on one WebSocket.  Each
bad event gets exactly one `error` event naming the problem, each valid one
completes, event sequence numbers never skip, the last request of every
batch completes (the connection keeps serving) and the process lives.
Frames that break the WebSocket protocol itself close their own connection
with the RFC 6455 code, and only that one.  Every test ends with the
deployment holding nothing (`wait_quiescent`) and no traceback in the
server's log.

Hypothesis runs derandomized, with no example database: CI sees the same
examples on every run.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from pddgw.api.responses import _CREATE_KEYS
from pddgw.harness.launch import Processes
from pddgw.harness.leaks import wait_quiescent
from pddgw.harness.ports import free_port
from tests.api.ws_raw import PING, TEXT, RawWs, frame

ROOT = Path(__file__).resolve().parents[2]
# The built-in tiny model and the embedded default config.
VOCAB = 384
CONTEXT = 4096
MAX_MESSAGE = 1 << 20
I64_MIN, U64_MAX = -(2**63), 2**64 - 1        # the integers JSON (orjson) carries exactly
ROLES = ("system", "developer", "user", "assistant")
CREATE_KEYS = _CREATE_KEYS     # the decoder's own set: a generated unknown key is never a real one


# ---- the server process and a connection per test ----------------------------------------------------


@dataclass
class Served:
    proc: subprocess.Popen
    port: int
    log: Path
    # What a test left in use: it stays in use, so later tests cannot check quiescence again.
    leaked: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    port = free_port()
    procs = Processes(tmp_path_factory.mktemp("frontdoor"))
    procs.add("serve", ["serve", "--model", "tiny", "--host", "127.0.0.1", "--port", str(port)], port, cwd=ROOT)
    procs.start()
    try:
        yield Served(procs.nodes["serve"].proc, port, procs.dir / "serve.log")
    finally:
        procs.stop()


class Conn:
    """One WebSocket to the front door; checks every event it reads."""

    def __init__(self, session: aiohttp.ClientSession, ws: aiohttp.ClientWebSocketResponse, url: str):
        self.session = session
        self.ws = ws
        self.url = url
        self.seq = 0
        self.streams = 0

    def stream_id(self) -> str:
        self.streams += 1
        return f"fz{self.streams}"

    async def send(self, doc: Any, binary: bool = False) -> None:
        data = doc if isinstance(doc, bytes) else orjson.dumps(doc)
        if binary or isinstance(doc, bytes):
            await self.ws.send_bytes(data)
        else:
            await self.ws.send_str(data.decode())

    async def event(self, timeout: float = 120.0) -> dict:
        msg = await self.ws.receive(timeout=timeout)
        assert msg.type == aiohttp.WSMsgType.TEXT, msg
        ev = orjson.loads(msg.data)
        assert ev["sequence_number"] == self.seq + 1, (ev, self.seq)
        self.seq += 1
        if ev["type"] == "error":
            check_error_shape(ev)
        return ev

    async def terminal(self) -> dict:
        while (ev := await self.event())["type"] not in ("error", "response.completed"):
            pass
        return ev

    async def state(self) -> dict:
        async with self.session.get(self.url + "/debug/state") as r:
            assert r.status == 200
            return await r.json()


def check_error_shape(ev: dict) -> None:
    assert set(ev) <= {"type", "sequence_number", "stream_id", "response_id", "error"}, ev
    err = ev["error"]
    assert set(err) == {"type", "code", "message", "param"} and err["type"] == err["code"], ev
    assert isinstance(err["message"], str) and 0 < len(err["message"]) < 1000, ev


@pytest.fixture(scope="module")
def runner() -> Iterator[asyncio.Runner]:
    # One loop for the module: hypothesis calls the test once per example, each runs its part on this loop.
    with asyncio.Runner() as r:
        yield r


@pytest.fixture
def conn(served: Served, runner: asyncio.Runner) -> Iterator[Conn]:
    """A connection for one test: all of a hypothesis test's examples run on it, one after another."""
    async def open_() -> Conn:
        session = aiohttp.ClientSession()
        return Conn(session, await session.ws_connect(served.url + "/v1/responses"), served.url)

    c = runner.run(open_())
    yield c
    runner.run(c.ws.close())
    runner.run(c.session.close())


@pytest.fixture
def settled(served: Served, conn: Conn, runner: asyncio.Runner) -> Iterator[None]:
    """After the test: the process lives, logged no traceback, the connection still serves and (unless an
    earlier test already left something in use) the deployment holds nothing."""
    yield
    assert served.proc.poll() is None, served.log_text()[-4000:]
    runner.run(completes(conn))
    log = served.log_text()
    assert "Traceback" not in log, log[-8000:]
    if served.leaked is None:
        try:
            # The tiny model's work is done in well under a second; this only bounds a hang.
            runner.run(wait_quiescent(conn.state, timeout=20.0))
        except AssertionError as e:
            served.leaked = str(e)
            raise


async def completes(conn: Conn, **fields: Any) -> dict:
    sid = conn.stream_id()
    await conn.send({"type": "response.create", "input": "hi", "max_output_tokens": 2, "temperature": 0,
                     "stream_id": sid, **fields})
    ev = await conn.terminal()
    assert (ev["type"], ev.get("stream_id")) == ("response.completed", sid), ev
    return ev


# ---- representative cases, pinned --------------------------------------------------------------------


def create(**fields: Any) -> dict:
    return {"type": "response.create", **fields}


NESTED = b'{"type": "response.create", "input": %s}'
BAD = "invalid_request_error"
TOO_LONG = "context_length_exceeded"


def pinned(event: Any, code: str, param: str | None, message: str, id: str, prepared: bool = False) -> Any:
    """`message`: the message, or its start when it ends with "..."; `prepared`: refused while preparing the
    response (the error names its response_id), not while decoding the event."""
    return pytest.param(event, code, param, message, prepared, id=id)


PINNED = [
    pinned(b'{"type": "response.create", "input": "\xff"}', BAD, None,
           "event is not valid JSON: str is not valid UTF-8...", "invalid-utf8-binary"),
    pinned(NESTED % (b"[" * 2000 + b"]" * 2000), BAD, None, "event is not valid JSON: depth limit exceeded...",
           "nested-2000"),
    pinned(NESTED % (b"[" * 100 + b"]" * 100), BAD, "input[0]",
           "input[0] must be a message, function_call or function_call_output item", "nested-100"),
    pinned(b"\x00\x01binary", BAD, None, "event is not valid JSON: unexpected character...", "binary-garbage"),
    pinned({"type": "response.delete"}, BAD, "type",
           "unknown event type 'response.delete' (expected response.create or response.cancel)", "unknown-type"),
    pinned({"type": "response.cancel", "response_id": "resp_0"}, BAD, "response_id",
           "no response 'resp_0' in flight on this connection", "cancel-unknown"),
    pinned({"type": "response.cancel", "response_id": 7}, BAD, "response_id",
           "'response_id' must be a non-empty string", "cancel-wrong-type"),
    pinned(create(input="x", max_output_tokens=I64_MIN), BAD, "max_output_tokens",
           "'max_output_tokens' must be a positive integer", "max-output-i64-min"),
    pinned(create(input="x", seed=U64_MAX), BAD, "seed",
           "seed must be an integer in [0, 9223372036854775808), got 18446744073709551615",
           "seed-u64-max"),
    pinned(create(input="x", temperature=1e308), BAD, "temperature",
           "temperature must be a number in [0, 2], got 1e+308", "temperature-huge"),
    pinned(create(input="x", metadata={"k" * 100_000: "v"}), BAD, "metadata",
           f"metadata['{'k' * 29}...{'k' * 30}']: keys up to 64 chars, string values up to 512", "metadata-key-huge"),
    pinned(create(prompt_token_ids=[0] * (CONTEXT + 1)), TOO_LONG, "prompt_token_ids",
           f"prompt is {CONTEXT + 1} tokens; the context length is {CONTEXT}", "token-ids-past-context"),
    pinned(create(prompt_token_ids=[1, VOCAB]), BAD, "prompt_token_ids",
           f"prompt_token_ids must be < vocab size {VOCAB}", "token-id-past-vocab", prepared=True),
    pinned(create(input="é" * CONTEXT), TOO_LONG, "input", "prompt is ...", "text-past-context", prepared=True),
    # The largest message the server reads: its input is far past the context length.
    pinned(create(input="a" * (MAX_MESSAGE - len(orjson.dumps(create(input=""))))), TOO_LONG, "input",
           "prompt is ...", "exactly-max-message", prepared=True),
]


@pytest.mark.parametrize("event,code,param,message,prepared", PINNED)
def test_representative_bad_events_get_these_errors(conn, runner, settled, event, code, param, message, prepared):
    async def go() -> dict:
        await conn.send(event)
        return await conn.event()

    ev = runner.run(go())
    assert (ev["type"], ev["error"]["code"], ev["error"]["param"]) == ("error", code, param), ev
    if message.endswith("..."):
        assert ev["error"]["message"].startswith(message[:-3]), ev
    else:
        assert ev["error"]["message"] == message, ev
    if code == TOO_LONG:
        assert ev["error"]["message"].endswith(f"tokens; the context length is {CONTEXT}"), ev
    assert ("response_id" in ev) == prepared, ev
    assert len(orjson.dumps(ev)) < 1000


def test_cancel_ends_a_response_and_then_its_id_is_unknown(conn, runner, settled):
    async def go() -> tuple[dict, dict]:
        sid = conn.stream_id()
        # ~4,000 tokens take seconds even alone on the machine; the cancel is one event behind.
        await conn.send(create(input="hi", max_output_tokens=CONTEXT, temperature=0, stream_id=sid))
        created = await conn.event()
        assert (created["type"], created["stream_id"]) == ("response.created", sid), created
        rid = created["response"]["id"]
        await conn.send({"type": "response.cancel", "response_id": rid})
        end = await conn.terminal()
        await conn.send({"type": "response.cancel", "response_id": rid})
        return end | {"rid": rid}, await conn.terminal()

    end, again = runner.run(go())
    assert (end["type"], end["error"]["code"], end["response_id"]) == ("error", "cancelled", end["rid"])
    assert (again["error"]["param"], again["error"]["message"]) == (
        "response_id", f"no response '{end['rid']}' in flight on this connection")


@pytest.mark.parametrize("frames,code", [
    ([frame(TEXT, orjson.dumps(create(input="hi")), mask=False)], 1002),
    ([frame(PING, b"hi", mask=False)], 1002),
    ([frame(TEXT, b'{"input": "\xc3\x28"}')], 1007),
    ([frame(TEXT, length=MAX_MESSAGE + 1)], 1009),
], ids=["unmasked-text", "unmasked-ping", "invalid-utf8-text", "over-max-message-bytes"])
def test_protocol_violations_close_only_their_own_connection(served, conn, runner, settled, frames, code):
    async def go() -> tuple[int, list[dict], bool]:
        ws = await RawWs.connect("127.0.0.1", served.port)
        await ws.send(*frames)
        got = await ws.close_code()
        return got, ws.events, await ws.at_eof()

    assert runner.run(go()) == (code, [], True)
    runner.run(completes(conn))


# ---- fuzzing --------------------------------------------------------------------------------------------

ANY = None      # an error whose param is not pinned


@dataclass(frozen=True)
class Hostile:
    doc: Any                            # a JSON document, or raw bytes sent as they are (binary frame)
    code: str | None                    # the error code expected; None: the response completes
    params: frozenset | None = ANY      # the params the error may name
    binary: bool = False
    tagged: bool = True                 # a dict that gets a fresh stream_id, echoed on every answer

    def with_binary(self, binary: bool) -> Hostile:
        return Hostile(self.doc, self.code, self.params, binary, self.tagged)


def bad(doc: Any, *params: str | None, code: str = BAD, tagged: bool = True) -> Hostile:
    return Hostile(doc, code, frozenset(params), tagged=tagged)


def ints(lo: int | None = None, hi: int | None = None) -> st.SearchStrategy:
    return st.integers(I64_MIN if lo is None else lo, U64_MAX if hi is None else hi)


def floats(lo: float | None = None, hi: float | None = None) -> st.SearchStrategy:
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False)


def longer_than(n: int) -> st.SearchStrategy:
    """Text of more than n characters (a short draw repeated: long draws overrun hypothesis's buffer)."""
    return st.text(min_size=1, max_size=4).map(lambda t: t * (n // len(t) + 1))


scalars = st.none() | st.booleans() | ints() | floats() | st.text(max_size=12)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)
KINDS: dict[type, st.SearchStrategy] = {
    type(None): st.none(), bool: st.booleans(), int: ints(), float: floats(), str: st.text(max_size=12),
    list: st.lists(json_values, max_size=3), dict: st.dictionaries(st.text(max_size=8), json_values, max_size=3)}


def values(*, but: tuple[type, ...] = (), none: bool = False) -> st.SearchStrategy:
    """JSON values of every type but `but` (null only when `none`; a bool is never taken for an int)."""
    skip = set(but) | (set() if none else {type(None)})
    return st.one_of([s for t, s in KINDS.items() if t not in skip])


BASE = {"type": "response.create", "input": "hi", "max_output_tokens": 1, "temperature": 0}


def field(name: str, value: st.SearchStrategy, param: str | None = None, *, base: dict | None = None,
          code: str = BAD) -> st.SearchStrategy:
    """`name` set to each drawn value on a valid request -> the error naming `param` (default: `name`)."""
    b = BASE if base is None else base
    return value.map(lambda v: bad({**b, name: v}, param or name, code=code, tagged=name != "stream_id"))


TOKENS = {k: v for k, v in BASE.items() if k != "input"}
not_number = values(but=(int, float))
wrong_fields = st.one_of(
    field("input", values(but=(str, list), none=True)),
    field("input", st.lists(values(but=(dict,)), min_size=1, max_size=3), "input[0]"),
    field("input", st.fixed_dictionaries({"role": values(none=True).filter(lambda r: r not in ROLES)})
          .map(lambda m: [m]), "input[0]"),
    field("input", st.fixed_dictionaries({"role": st.just("user"), "content": values(but=(str, list))
                                                                 | st.lists(values(but=(dict,)), min_size=1)})
          .map(lambda m: [m]), "input[0].content"),
    field("input", longer_than(CONTEXT), code=TOO_LONG),
    field("instructions", values(but=(str,))),
    field("prompt_token_ids", values(but=(list,)), base=TOKENS),
    field("prompt_token_ids", st.tuples(st.lists(ints(0, VOCAB - 1), max_size=3),
                                        values(but=(int,)) | ints(hi=-1)).map(lambda t: [*t[0], t[1]]),
          base=TOKENS),
    field("prompt_token_ids", st.lists(ints(VOCAB), min_size=1, max_size=3), base=TOKENS),
    field("prompt_token_ids", st.integers(CONTEXT + 1, CONTEXT + 50).map(lambda n: [1] * n), base=TOKENS,
          code=TOO_LONG),
    field("max_output_tokens", values(but=(int,)) | ints(hi=0)),
    field("temperature", not_number | floats(hi=-1e-300) | floats(lo=2.0000001) | ints(hi=-1) | ints(lo=3)),
    field("top_p", not_number | floats(hi=0.0) | floats(lo=1.0000001) | ints(hi=0) | ints(lo=2)),
    field("seed", values(but=(int,)) | ints(hi=-1) | ints(lo=2**63)),
    field("metadata", values(but=(dict,))),
    field("metadata", st.dictionaries(st.text(max_size=4), st.text(max_size=4), min_size=17, max_size=20)),
    field("metadata", st.dictionaries(st.text(max_size=4), values(but=(str,), none=True), min_size=1, max_size=3)),
    field("metadata", longer_than(64).map(lambda k: {k: "v"})),
    field("metadata", longer_than(512).map(lambda v: {"k": v})),
    field("stream_id", values(but=(str,)) | longer_than(128)),
    field("model", values(but=(str,))),
    field("store", values(but=(bool,))),
    field("stream", values()),
    field("pddgw", values(but=(dict,))),
    field("pddgw", st.dictionaries(st.text(max_size=8).filter(lambda k: k not in ("pipeline", "handoff_mode",
                                                                                "states")),
                                   json_values, min_size=1, max_size=2)),
    field("pddgw", values().filter(lambda v: v not in ("P-MD", "P-RLD-MD", "P-RLD"))
          .map(lambda v: {"pipeline": v}), "pddgw.pipeline"),
    field("pddgw", values().filter(lambda v: v not in ("one-shot", "catch-up"))
          .map(lambda v: {"handoff_mode": v}), "pddgw.handoff_mode"),
    field("pddgw", values(but=(bool,)).map(lambda v: {"states": v}), "pddgw.states"),
    field("return_token_ids", values(but=(bool,))),
    field("type", values(none=True).filter(lambda v: v not in ("response.create", "response.cancel"))),
    st.tuples(st.text(min_size=1, max_size=12).filter(lambda k: k not in CREATE_KEYS),
              json_values).map(lambda kv: bad({**BASE, kv[0]: kv[1]}, kv[0])),
)

# Random JSON; a top-level stream_id is dropped, so answers without one are the untagged events' own.
random_json = json_values.map(lambda v: {k: x for k, x in v.items() if k != "stream_id"} if isinstance(v, dict)
                              else v).filter(lambda v: not (isinstance(v, dict) and v.get("type") in (
                                  "response.create", "response.cancel")))
untagged = st.one_of(
    random_json.map(lambda v: bad(v, None, "type", tagged=False)),
    st.binary(max_size=40).map(lambda b: Hostile(b, BAD, tagged=False)),
    st.binary(min_size=1, max_size=4).map(lambda b: bad(b'{"type": "response.create", "input": "' + b"\xff" + b
                                                         + b'"}', None, tagged=False)),
    st.integers(2, 1500).map(lambda n: bad(NESTED % (b"[" * n + b"]" * n), None, "input[0]", tagged=False)),
    st.text(min_size=1, max_size=20).map(lambda r: bad({"type": "response.cancel", "response_id": r},
                                                       "response_id", tagged=False)),
    values(but=(str,)).map(lambda r: bad({"type": "response.cancel", "response_id": r}, "response_id", tagged=False)),
)

messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(ROLES),
                                           "content": st.text(max_size=20)}), min_size=1, max_size=3)
prompts = st.one_of(st.text(max_size=20).map(lambda t: {"input": t}), messages.map(lambda m: {"input": m}),
                    st.lists(ints(0, VOCAB - 1), min_size=1, max_size=8).map(lambda ids: {"prompt_token_ids": ids}))
options = st.fixed_dictionaries(
    {"type": st.just("response.create"), "max_output_tokens": st.integers(1, 3), "return_token_ids": st.booleans()},
    optional={"temperature": floats(0, 2), "top_p": floats(1e-9, 1), "seed": ints(0, 2**63 - 1),
              "metadata": st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
              "model": st.text(max_size=8), "store": st.booleans(), "instructions": st.text(max_size=20)})
valid = st.builds(lambda o, p: Hostile({**o, **p}, None), options, prompts)

events = st.tuples(st.one_of(wrong_fields, untagged, valid), st.booleans()).map(lambda t: t[0].with_binary(t[1]))


async def exchange(conn: Conn, batch: list[Hostile]) -> None:
    """Send the batch back to back, read one end per event, check each against its expectation."""
    tagged: dict[str, Hostile] = {}
    plain: list[Hostile] = []
    for h in batch:
        doc = h.doc
        if h.tagged:
            sid = conn.stream_id()
            doc = {**doc, "stream_id": sid}
            tagged[sid] = h
        else:
            plain.append(h)
        await conn.send(doc, h.binary)
    streams: dict[str, list[dict]] = defaultdict(list)
    errors: list[dict] = []
    left = len(batch)
    while left:
        ev = await conn.event()
        sid = ev.get("stream_id")
        if sid is None:
            assert ev["type"] == "error", ev
            errors.append(ev)
        else:
            streams[sid].append(ev)
        left -= ev["type"] in ("error", "response.completed")
    # Events without a stream_id are answered in the order sent (each is refused as it is decoded).
    assert len(errors) == len(plain), (errors, plain)
    for h, ev in zip(plain, errors, strict=True):
        expect_error(h, ev)
    assert streams.keys() == tagged.keys()
    for sid, h in tagged.items():
        evs = streams[sid]
        if h.code is not None:
            assert len(evs) == 1, evs
            expect_error(h, evs[0])
            continue
        types = [e["type"] for e in evs]
        assert types[0] == "response.created" and types[-1] == "response.completed", types
        assert set(types[1:-1]) <= {"response.output_text.delta"}, types
        resp = evs[-1]["response"]
        assert resp["status"] == "completed"
        n, most = resp["usage"]["output_tokens"], h.doc["max_output_tokens"]
        if h.doc["return_token_ids"]:
            assert n == len(resp["pddgw"]["output_token_ids"]) <= most
        else:      # lean: no ids anywhere
            assert "output_token_ids" not in resp["pddgw"] and n <= most
            assert all("token_ids" not in e["pddgw"] for e in evs if e["type"] == "response.output_text.delta")


def expect_error(h: Hostile, ev: dict) -> None:
    assert ev["type"] == "error", (h, ev)
    assert ev["error"]["code"] == h.code, (h, ev)
    if h.params is not ANY:
        assert ev["error"]["param"] in h.params, (h, ev)


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          # `settled` runs once around all examples, as meant: the checks at the end of the test.
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(batch=st.lists(events, min_size=1, max_size=6))
def test_hostile_events_each_get_one_answer_and_the_connection_keeps_serving(served, conn, runner, settled, batch):
    note(f"batch = {batch!r}")      # the events themselves: the example's printout shows only how they were drawn
    runner.run(exchange(conn, batch))
    runner.run(completes(conn))
    assert served.proc.poll() is None, served.log_text()[-4000:]
