"""Worker -> worker messages: the prompt KV and the handoff rounds.

P streams `KVChunk`s (pddgw.core.kv) to each decoder, then `KvDone` with the
first token; RLD hands a request to MD by token IDs in `Extend` rounds, each
answered by an Ack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pddgw.core.ids import TOKEN_ID_LIMIT
from pddgw.messages.fields import MAX_TOKEN_IDS, _flag, _int_tuple, _text, _uint


@dataclass(frozen=True, slots=True)
class KvDone:
    """P -> decoder: the prompt KV is all sent; `first_token` (sampled by P) is
    output position 0.  hold=False: decode on at once; True: wait for the handoff."""

    request_id: str
    first_token: int
    hold: bool
    tag: Literal["kv_done"] = "kv_done"

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id", empty=False)
        _uint(self.first_token, "first_token", TOKEN_ID_LIMIT)
        _flag(self.hold, "hold")


@dataclass(frozen=True, slots=True)
class Extend:
    """Output tokens at positions [start, start + len(ids)) for a held request (answered by Ack).

    A handoff round from RLD to MD, or the emitted tokens of a re-drive.
    final=True lifts the hold: the receiver samples from the next position on.
    """

    request_id: str
    start: int
    final: bool
    ids: tuple[int, ...]
    tag: Literal["extend"] = "extend"

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id", empty=False)
        _uint(self.start, "start", 1 << 31)
        _flag(self.final, "final")
        _int_tuple(self, "ids", self.ids, MAX_TOKEN_IDS, TOKEN_ID_LIMIT)


@dataclass(frozen=True, slots=True)
class TokenIds:
    """Token-ID handoff: `ids` are the tokens at positions start, start+1, ... (packed int32)."""

    request_id: str
    start: int
    ids: tuple[int, ...]
    tag: Literal["token_ids"] = "token_ids"

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id")
        _uint(self.start, "start", 1 << 31)
        _int_tuple(self, "ids", self.ids, MAX_TOKEN_IDS, TOKEN_ID_LIMIT)
