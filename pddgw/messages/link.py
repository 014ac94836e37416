"""The link's own messages: the authentication handshake, heartbeats, replies.

Hello, Challenge, Auth and Welcome open a connection (net/auth.py, net/ws.py);
Ping and Pong measure the RTT and keep a silent peer detectable; Ack and Error
answer a request (an Error raises `RemoteError` at the asker).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pddgw.core.errors import check as _check
from pddgw.messages.fields import MAX_TEXT_CHARS, _nonce, _text, _uint


@dataclass(frozen=True, slots=True)
class Hello:
    """Client -> server, first frame of a connection: who I am, which link and stripe."""

    node: str
    link_id: str                   # shared by every stripe of one link connection
    stripe: int
    stripes: int
    nonce: str                     # client nonce, 64 hex characters
    shaping: str = ""              # name of the link's shaping in the server's config
    tag: Literal["hello"] = "hello"

    def __post_init__(self) -> None:
        _text(self.node, "node", empty=False)
        _text(self.link_id, "link_id", empty=False)
        _uint(self.stripes, "stripes", 17)
        _check(self.stripes >= 1, "stripes must be >= 1")
        _uint(self.stripe, "stripe", self.stripes)
        _nonce(self.nonce, "nonce")
        _text(self.shaping, "shaping")


@dataclass(frozen=True, slots=True)
class Challenge:
    """Server -> client: server nonce and the server's proof that it knows the secret."""

    node: str
    nonce: str
    proof: str                     # hex HMAC-SHA256
    tag: Literal["challenge"] = "challenge"

    def __post_init__(self) -> None:
        _text(self.node, "node", empty=False)
        _nonce(self.nonce, "nonce")
        _nonce(self.proof, "proof")


@dataclass(frozen=True, slots=True)
class Auth:
    """Client -> server: the client's proof."""

    proof: str
    tag: Literal["auth"] = "auth"

    def __post_init__(self) -> None:
        _nonce(self.proof, "proof")


@dataclass(frozen=True, slots=True)
class Welcome:
    """Server -> client: authenticated; the link is open."""

    tag: Literal["welcome"] = "welcome"


@dataclass(frozen=True, slots=True)
class Ping:
    """Heartbeat; answered by a `Pong` carrying the same `sent_ns`."""

    sent_ns: int
    tag: Literal["ping"] = "ping"

    def __post_init__(self) -> None:
        _uint(self.sent_ns, "sent_ns")


@dataclass(frozen=True, slots=True)
class Pong:
    sent_ns: int
    tag: Literal["pong"] = "pong"

    def __post_init__(self) -> None:
        _uint(self.sent_ns, "sent_ns")


@dataclass(frozen=True, slots=True)
class Ack:
    """Acknowledges `request_id` up to `seq` (e.g. KV chunks received and placed)."""

    request_id: str
    seq: int = 0
    detail: str = ""
    tag: Literal["ack"] = "ack"

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id")
        _uint(self.seq, "seq")
        _text(self.detail, "detail", MAX_TEXT_CHARS)


@dataclass(frozen=True, slots=True)
class Error:
    """A failure on the peer; a request answered with it raises `RemoteError`."""

    request_id: str
    code: str
    message: str = ""
    tag: Literal["error"] = "error"

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id")
        _text(self.code, "code", empty=False)
        _text(self.message, "message", MAX_TEXT_CHARS)
