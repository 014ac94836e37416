"""Workloads for `pddgw sim`: agentic multi-turn conversations, or a Mooncake trace.

A workload is a list of `Conversation`s, each a script of turns a client plays against the
router: wait for its start, send a turn, wait for its answer, think, send the next.

Agentic (`agentic`): turn 0 is the shared system prompt plus fresh material; turn k keeps
the first `hit_k * context` tokens of what the model saw and said in turn k-1 and appends
fresh tokens up to `context_tokens`.  A cache holding turn k-1 (MD) thus hits exactly
`hit_k` of turn k's prompt; P, which never saw the answer, at most the previous prompt.
`hit_k` is drawn per turn from `hit_buckets` ((weight, low, high) bands, uniform within).

Mooncake traces (`load_trace`): one single-turn conversation per request at its timestamp;
each hash id names a fixed 512-token block (equal ids share a prefix).

Arrivals are open-loop (Poisson, or gamma with `gamma_cv`) at `rate / mean turns`
conversations per second; the turns of one conversation are a closed loop.  `agentic` stops
at `requests` requests, or given `horizon_s` starts conversations over that horizon with all
their turns (a goodput probe's fixed window).
"""

from __future__ import annotations

import gzip
import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

from pddgw.core.ids import id_facts, note_bounds
from pddgw.engines.block_manager import ROOT_HASH, chain_hashes
from pddgw.engines.prompt_hashes import note as note_hashes
from pddgw.engines.prompt_hashes import prompt_hashes

TRACE_BLOCK_TOKENS = 512
# Token ids drawn for prompts: clear of the byte range and of special ids.
_TOKEN_LOW, _TOKEN_HIGH = 1000, 30000
# One int object per drawn id, shared by every prompt: fresh ints per prompt would be ~1.8 MB
# per 64K-token prompt, a third of a paper-scenario probe's memory.
_INTERNED = np.array(range(_TOKEN_LOW, _TOKEN_HIGH), dtype=object)


def _draw(rng: np.random.Generator, n: int) -> list[int]:
    """n token ids uniform over [_TOKEN_LOW, _TOKEN_HIGH), as the shared int objects."""
    return _INTERNED[rng.integers(_TOKEN_LOW, _TOKEN_HIGH, size=n) - _TOKEN_LOW].tolist()


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of a conversation.

    hit       share of `context` kept from the previous turn (prompt + answer)
    think_s   pause between the previous answer and this request
    prompt    explicit prompt (trace replay); empty = built from the rules above
    """

    context: int
    max_tokens: int
    hit: float = 0.0
    think_s: float = 0.0
    prompt: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Conversation:
    cid: int
    start_s: float
    seed: int
    turns: tuple[Turn, ...]


@dataclass(frozen=True, slots=True)
class AgenticSpec:
    """Parameters of `agentic` (scenario `[workload]`, see the module docstring)."""

    requests: int = 1000
    rate: float = 5.0                     # requests per second (aggregate)
    arrival: str = "poisson"              # "poisson" | "gamma"
    gamma_cv: float = 2.0
    context_tokens: int = 65536
    output_tokens: int = 1024
    shared_prefix_tokens: int = 8192
    turns_min: int = 8
    turns_max: int = 16
    think_s_min: float = 1.0
    think_s_max: float = 10.0
    # (weight, low, high): a follow-up turn keeps a share in [low, high).
    hit_buckets: tuple[tuple[float, float, float], ...] = ((0.78, 0.95, 1.0), (0.22, 0.75, 0.95))

    def __post_init__(self) -> None:
        if self.requests < 1 or self.rate <= 0:
            raise ValueError("requests must be >= 1 and rate > 0")
        if self.arrival not in ("poisson", "gamma"):
            raise ValueError(f"arrival {self.arrival!r} is not 'poisson' or 'gamma'")
        if self.gamma_cv <= 0:
            raise ValueError("gamma_cv must be > 0")
        if self.context_tokens < 1 or self.output_tokens < 1:
            raise ValueError("context_tokens and output_tokens must be >= 1")
        if not 0 <= self.shared_prefix_tokens <= self.context_tokens:
            raise ValueError("shared_prefix_tokens must be in [0, context_tokens]")
        if not 1 <= self.turns_min <= self.turns_max:
            raise ValueError("need 1 <= turns_min <= turns_max")
        if not 0 <= self.think_s_min <= self.think_s_max:
            raise ValueError("need 0 <= think_s_min <= think_s_max")
        if not self.hit_buckets:
            raise ValueError("hit_buckets must not be empty")
        for i, b in enumerate(self.hit_buckets):
            if len(b) != 3 or b[0] <= 0 or not 0 <= b[1] <= b[2] <= 1:
                raise ValueError(f"hit_buckets[{i}] must be [weight > 0, low, high] with 0 <= low <= high <= 1")

    @property
    def mean_turns(self) -> float:
        return (self.turns_min + self.turns_max) / 2


def _gaps(rng: random.Random, n: int, rate: float, arrival: str, cv: float) -> list[float]:
    """n inter-arrival gaps of mean 1/rate (exponential, or gamma with coefficient of variation cv)."""
    if arrival == "poisson":
        return [rng.expovariate(rate) for _ in range(n)]
    shape = 1.0 / (cv * cv)
    return [rng.gammavariate(shape, 1.0 / (rate * shape)) for _ in range(n)]


def agentic(spec: AgenticSpec, seed: int, horizon_s: float | None = None) -> list[Conversation]:
    """Conversations whose turns add up to `spec.requests` requests; with `horizon_s`, every
    conversation that starts before horizon_s (the first at 0), each with all its turns."""
    if horizon_s is not None and horizon_s <= 0:
        raise ValueError(f"horizon_s must be > 0, got {horizon_s}")
    rng = random.Random(seed)
    weights = [b[0] for b in spec.hit_buckets]
    convs: list[Conversation] = []
    left = spec.requests if horizon_s is None else math.inf
    t = 0.0
    conv_rate = spec.rate / spec.mean_turns
    while left > 0 and (horizon_s is None or t < horizon_s):
        n = min(left, rng.randint(spec.turns_min, spec.turns_max))
        turns = []
        for k in range(n):
            hit = 0.0
            if k:
                _, lo, hi = rng.choices(spec.hit_buckets, weights)[0]
                hit = rng.uniform(lo, hi)
            think = rng.uniform(spec.think_s_min, spec.think_s_max) if k else 0.0
            turns.append(Turn(spec.context_tokens, spec.output_tokens, hit, think))
        convs.append(Conversation(len(convs), t, rng.randrange(1 << 62), tuple(turns)))
        left -= n
        t += _gaps(rng, 1, conv_rate, spec.arrival, spec.gamma_cv)[0]
    return convs


class PromptBuilder:
    """Token ids of each turn of one conversation.

    With `block_size` (the simulator), each prompt comes with its chained block hashes and id
    bounds noted (`engines.prompt_hashes.note`, `core.ids.note_bounds`), hashing only the blocks
    past the part kept from the previous prompt; the values equal those computed afresh.
    """

    def __init__(self, conv: Conversation, shared_prefix: tuple[int, ...], block_size: int = 0):
        self.conv = conv
        self.shared = shared_prefix
        self._rng = np.random.default_rng(conv.seed)
        # The previous turn's prompt and answer, apart: a turn keeps a head of the two, copied once.
        self._seen: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        self.block_size = block_size
        self._hashes: tuple[int, ...] = ()  # the previous prompt's chained block hashes (block_size)
        self._lo, self._hi = _TOKEN_LOW, _TOKEN_HIGH - 1     # bounds of every id seen so far

    def _fresh(self, n: int) -> list[int]:
        return _draw(self._rng, n) if n > 0 else []

    def prompt(self, k: int) -> tuple[int, ...]:
        turn = self.conv.turns[k]
        if turn.prompt:
            return turn.prompt
        if k == 0:
            head = self.shared[: turn.context]
        else:
            kept = math.floor(turn.hit * turn.context)
            said, answer = self._seen
            head = said[:kept] if kept <= len(said) else said + answer[: kept - len(said)]
        fresh = self._fresh(turn.context - len(head))
        prompt = head + tuple(fresh) if fresh else head
        if self.block_size:
            self._note(prompt, k, len(head))
        return prompt

    def _note(self, prompt: tuple[int, ...], k: int, kept: int) -> None:
        bs = self.block_size
        # Turn k > 0 begins with the first `kept` ids of the previous prompt + answer, whose
        # prompt's full blocks were hashed; turn 0 with the shared prefix.
        known = prompt_hashes(self.shared, bs) if k == 0 else self._hashes
        known = known[: kept // bs]
        rest = chain_hashes(prompt, bs, known[-1] if known else ROOT_HASH, len(known))
        self._hashes = (*known, *rest)
        note_hashes(prompt, bs, self._hashes)
        note_bounds(prompt, self._lo, self._hi)

    def answered(self, prompt: tuple[int, ...], output: tuple[int, ...]) -> None:
        self._seen = (prompt, tuple(output))
        if self.block_size and output:
            ints, lo, hi = id_facts(output)
            if not ints:               # (never: a router's answers are token ids) noting stops
                self.block_size = 0
            self._lo, self._hi = min(self._lo, lo), max(self._hi, hi)


def shared_prefix(n: int, seed: int) -> tuple[int, ...]:
    return tuple(_draw(np.random.default_rng([seed, 7]), n))


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request of a Mooncake-format trace (one JSON object a line)."""

    line: int                 # 1-based line in the file
    t_s: float                # arrival, seconds from the trace's start (`timestamp` is ms)
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]  # one id per 512-token block of the prompt


def read_mooncake(path: str | Path, limit: int = 0) -> list[TraceRecord]:
    """The first `limit` (0: all) records of a Mooncake-format trace (`.gz`: gzip-compressed);
    ValueError naming the line."""
    out: list[TraceRecord] = []
    with (gzip.open if str(path).endswith(".gz") else open)(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if limit and len(out) >= limit:
                break
            try:
                r = orjson.loads(line)
                out.append(TraceRecord(lineno, r["timestamp"] / 1000.0, int(r["input_length"]),
                                       int(r["output_length"]), tuple(r["hash_ids"])))
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record ({e})") from None
    return out


def gather(t_s: float, burst_s: float) -> float:
    """An arrival at `t_s` moved to the start of its `burst_s`-second span (0: left alone)."""
    return math.floor(t_s / burst_s) * burst_s if burst_s > 0 else t_s


def load_trace(path: str | Path, limit: int = 0, *, output_cap: int = 0, speed: float = 1.0,
               burst_s: float = 0.0, seed: int = 0) -> list[Conversation]:
    """A Mooncake-format trace -> one-turn conversations at its timestamps (divided by `speed`).

    Each hash id becomes a fixed block of 512 token ids drawn from (seed, id), so equal leading
    ids are a shared prefix.  `burst_s` > 0 moves every arrival of each `burst_s` span to the
    span's start: the same requests at the same mean rate, many together.
    """
    blocks: dict[int, list[int]] = {}
    convs: list[Conversation] = []
    for r in read_mooncake(path, limit):
        prompt: list[int] = []
        for h in r.hash_ids:
            if h not in blocks:
                blocks[h] = _draw(np.random.default_rng([seed, h]), TRACE_BLOCK_TOKENS)
            prompt += blocks[h]
        prompt = prompt[: max(1, r.input_length)]
        out = max(1, min(r.output_length, output_cap) if output_cap else r.output_length)
        convs.append(Conversation(len(convs), gather(r.t_s / speed, burst_s), r.line,
                                  (Turn(len(prompt), out, prompt=tuple(prompt)),)))
    return convs
