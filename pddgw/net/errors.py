"""Typed link failures and WebSocket close codes.

Every failure a caller of `pddgw.net` can see is a `LinkError`; nothing else
escapes a link operation (timeouts included: `LinkTimeout`, not
`asyncio.TimeoutError`).
"""

from __future__ import annotations

from enum import IntEnum


class CloseCode(IntEnum):
    """Close codes on the wire (RFC 6455 section 7.4; 4000-4999 are ours)."""

    NORMAL = 1000
    GOING_AWAY = 1001
    PROTOCOL_ERROR = 1002
    UNSUPPORTED_DATA = 1003
    ABNORMAL = 1006            # never sent: the connection dropped without a close frame
    TOO_BIG = 1009
    INTERNAL_ERROR = 1011
    AUTH_FAILED = 4001
    AUTH_TIMEOUT = 4002
    BAD_FRAME = 4003
    PEER_SILENT = 4004         # no frame (not even a heartbeat) within dead_after_s


class LinkError(Exception):
    """Base of every error raised by pddgw.net."""


class FrameError(LinkError):
    """Bytes that are not a valid frame (bad header, metadata, sizes or field values)."""


class FrameTooLarge(FrameError):
    """A frame over `max_frame_bytes` / `max_control_bytes`."""


class AuthError(LinkError):
    """The peer failed the challenge/response (or rejected ours)."""


class LinkTimeout(LinkError):
    """An operation did not complete within its timeout."""


class LinkClosed(LinkError):
    """The link is closed or its connection was lost; `code` says why."""

    def __init__(self, reason: str, code: int = CloseCode.ABNORMAL) -> None:
        super().__init__(f"{reason} (close code {int(code)})")
        self.code = int(code)
        self.reason = reason


class RemoteError(LinkError):
    """The peer answered a request (or a stream) with an `Error` message."""

    def __init__(self, code: str, message: str, request_id: str = "") -> None:
        super().__init__(f"{code}: {message}" + (f" [{request_id}]" if request_id else ""))
        self.code = code
        self.message = message
        self.request_id = request_id
