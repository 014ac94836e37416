"""Router -> worker messages: open, prefill, hand off, query and cancel requests.

Requests are answered (`Link.request`): PrefixQuery -> PrefixAnswer, Submit ->
Opened, Prefill -> PrefillDone, HandOff -> HandedOff, StateQuery -> NodeState,
PromptLogprobsQuery -> Logprobs.  Demote and Cancel are one-way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pddgw.core.errors import check as _check
from pddgw.core.ids import TOKEN_ID_LIMIT
from pddgw.core.sampling import SamplingParams
from pddgw.messages.fields import (HASH_LIMIT, MAX_BLOCK_TOKENS, MAX_HASHES, MAX_ID_CHARS, MAX_TARGETS,
                                   MAX_TEXT_CHARS, MAX_TOKEN_IDS, _bools, _flag, _int_tuple, _number, _sampling,
                                   _text, _uint)


@dataclass(frozen=True, slots=True)
class PrefixQuery:
    """Which of these chained block hashes (uint64, in prompt order) do you hold?"""

    request_id: str
    hashes: tuple[int, ...]
    tag: Literal["prefix_query"] = "prefix_query"

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id")
        _int_tuple(self, "hashes", self.hashes, MAX_HASHES, HASH_LIMIT)


@dataclass(frozen=True, slots=True)
class Submit:
    """Open a request on a decode node.

    kv="import": P will stream the prompt KV past this node's cached prefix,
    then KvDone, which says whether to decode at once (RLD; MD in P-MD) or
    hold until a final handoff (MD in P-RLD-MD), so `hold` is ignored.
    kv="compute": the node computes the prompt itself (a re-drive); with
    hold=True the tokens already emitted then arrive as one final Extend.
    kv="local": a relaying prefill node (`[[nodes]] relay`) decodes what it
    prefills itself: the prompt KV is the one its own Prefill of this request
    computes (a target named after the node itself), nothing crosses a link.
    `supersedes`: requests to cancel here first (background alignments this
    one makes moot), so the prefix this request finds includes what they
    had already imported.
    """

    request_id: str
    kv: Literal["import", "compute", "local"]
    hold: bool
    prompt: tuple[int, ...]
    supersedes: tuple[str, ...] = ()
    sampling: SamplingParams = field(kw_only=True)
    tag: Literal["submit"] = "submit"

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id", empty=False)
        _check(self.kv in ("import", "compute", "local"), "kv must be 'import', 'compute' or 'local'")
        _flag(self.hold, "hold")
        _sampling(self.sampling)
        _int_tuple(self, "prompt", self.prompt, MAX_TOKEN_IDS, TOKEN_ID_LIMIT)
        _check(len(self.prompt) > 0, "prompt must not be empty")
        _check(type(self.supersedes) in (tuple, list) and len(self.supersedes) <= MAX_TARGETS,
               f"supersedes must list at most {MAX_TARGETS} request ids")
        object.__setattr__(self, "supersedes", tuple(self.supersedes))
        for r in self.supersedes:
            _text(r, "supersedes[]", empty=False)


@dataclass(frozen=True, slots=True)
class Prefill:
    """Compute the prompt on P; stream its KV to `targets` from `starts` on (parallel).

    `holds[i]`: target i holds after the KV (KvDone.hold), else decodes at once.
    `blocks[i]`: the KV block size (tokens) of target i's pool; P cuts its chunks at
    those blocks too, so each chunk can land in a block of that pool as it is (empty:
    P's own block size for every target).
    `first_to_router`: P also sends the first token to the router the moment it
    is sampled (a TokenItem at position 0, its Logprobs before it), before any
    target's KvDone, unless it ends the request (a stop token).
    """

    request_id: str
    targets: tuple[str, ...]
    starts: tuple[int, ...]
    prompt: tuple[int, ...]
    holds: tuple[bool, ...] = ()
    first_to_router: bool = False
    blocks: tuple[int, ...] = ()
    sampling: SamplingParams = field(kw_only=True)
    tag: Literal["prefill"] = "prefill"

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id", empty=False)
        _check(type(self.targets) in (tuple, list) and 0 < len(self.targets) <= MAX_TARGETS,
               f"targets must list 1..{MAX_TARGETS} node names")
        object.__setattr__(self, "targets", tuple(self.targets))
        for t in self.targets:
            _text(t, "targets[]", MAX_ID_CHARS, empty=False)
        _int_tuple(self, "starts", self.starts, MAX_TARGETS, TOKEN_ID_LIMIT)
        _check(len(self.starts) == len(self.targets), "starts must have one entry per target")
        _sampling(self.sampling)
        _int_tuple(self, "prompt", self.prompt, MAX_TOKEN_IDS, TOKEN_ID_LIMIT)
        _check(len(self.prompt) > 0, "prompt must not be empty")
        _check(all(s <= len(self.prompt) for s in self.starts), "a start is past the prompt's end")
        _bools(self, "holds", self.holds, len(self.targets))
        _flag(self.first_to_router, "first_to_router")
        _int_tuple(self, "blocks", self.blocks, MAX_TARGETS, MAX_BLOCK_TOKENS + 1)
        _check(len(self.blocks) in (0, len(self.targets)), "blocks must have one entry per target")
        _check(all(b > 0 and b & (b - 1) == 0 for b in self.blocks), "blocks must be powers of two")


@dataclass(frozen=True, slots=True)
class Demote:
    """Router -> P: nobody waits for this request's KV any more (RLD answered it);
    what is left of its transfers goes as background traffic, behind live requests."""

    request_id: str
    tag: Literal["demote"] = "demote"

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id", empty=False)


@dataclass(frozen=True, slots=True)
class HandOff:
    """Router -> RLD: hand the request off to MD node `target` by token IDs."""

    request_id: str
    target: str
    mode: Literal["one-shot", "catch-up"]
    threshold: int
    max_chunk: int
    max_rounds: int
    # The router's WAN RTT estimate: RLD's first guess of a round's duration.
    rtt_ms: float = 0.0
    # The operator forced the mode: no one-shot fallback when catch-up cannot converge.
    forced: bool = False
    tag: Literal["hand_off"] = "hand_off"

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id", empty=False)
        _text(self.target, "target", empty=False)
        _check(self.mode in ("one-shot", "catch-up"), "mode must be 'one-shot' or 'catch-up'")
        for name in ("threshold", "max_chunk", "max_rounds"):
            _uint(getattr(self, name), name, 1 << 20)
        _check(1 <= self.threshold <= self.max_chunk and self.max_rounds >= 1,
               "need 1 <= threshold <= max_chunk and max_rounds >= 1")
        _number(self.rtt_ms, "rtt_ms")
        _flag(self.forced, "forced")


@dataclass(frozen=True, slots=True)
class StateQuery:
    """Router -> node: report your state (answered by NodeState)."""

    node: str
    tag: Literal["state_query"] = "state_query"

    def __post_init__(self) -> None:
        _text(self.node, "node")


@dataclass(frozen=True, slots=True)
class PromptLogprobsQuery:
    """router -> the node that computed a request's prompt: its prompt logprobs from prompt
    token `start` (>= 1) on; answered by one `Logprobs` piece of at most
    MAX_LOGPROB_POSITIONS positions (`position`: the prompt index), asked again until all are in."""

    request_id: str
    start: int
    tag: Literal["prompt_logprobs_query"] = "prompt_logprobs_query"

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id", empty=False)
        _uint(self.start, "start", 1 << 31)
        _check(self.start >= 1, "start must be >= 1 (prompt token 0 has no logprob)")


@dataclass(frozen=True, slots=True)
class Cancel:
    """Stop working on `request_id`; ends a `Link.stream`."""

    request_id: str
    reason: str = ""
    tag: Literal["cancel"] = "cancel"

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id")
        _text(self.reason, "reason", MAX_TEXT_CHARS)
