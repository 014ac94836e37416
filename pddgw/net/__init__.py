"""Node links: typed messages in binary frames over WebSocket or in-process links.

Knows nothing about models or roles: it carries `pddgw.messages` by their shapes.  Entry points:

* `Link` — the contract every link keeps (send / send_all / request / stream);
  `Priority` — the traffic class of what is sent (foreground overtakes background).
* `WsServer`, `connect` — WebSocket links between processes (auth, TLS, stripes).
* `InProcNetwork`, `inproc_pair` — the same semantics inside one process.
* `ShapingConfig` (config.py) + `shaping.py` — WAN / fabric emulation on any link.
* `errors` — `LinkError` and its subclasses, `CloseCode`.
"""

from pddgw.net.errors import (
    AuthError,
    CloseCode,
    FrameError,
    FrameTooLarge,
    LinkClosed,
    LinkError,
    LinkTimeout,
    RemoteError,
)
from pddgw.net.inproc import InProcLink, InProcNetwork, inproc_pair
from pddgw.net.link import Handler, KvSink, Link, LinkState, LinkStats, LinkStream, Priority, PriorityLike
from pddgw.messages import (
    Ack,
    Cancel,
    Error,
    KVChunk,
    KVSpan,
    LoadReport,
    Message,
    Ping,
    Pong,
    PrefixAnswer,
    PrefixQuery,
    Ready,
    TokenIds,
    TokenItem,
)
from pddgw.net.ws import WsLink, WsServer, connect

__all__ = [
    "Ack", "AuthError", "Cancel", "CloseCode", "Error", "FrameError", "FrameTooLarge", "Handler", "InProcLink",
    "InProcNetwork", "KVChunk", "KvSink", "KVSpan", "Link", "LinkClosed", "LinkError", "LinkState", "LinkStats",
    "LinkStream", "LinkTimeout", "LoadReport", "Message", "Ping", "Pong", "PrefixAnswer", "PrefixQuery", "Priority",
    "PriorityLike", "Ready", "RemoteError", "TokenIds", "TokenItem", "WsLink", "WsServer", "connect", "inproc_pair",
]
