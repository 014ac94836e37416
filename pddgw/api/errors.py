"""The front door's client-error type and how it quotes client input (every route's decoder uses them)."""

from __future__ import annotations

import reprlib
from typing import Any

# Error messages quote what the client sent; a bounded quote keeps a 1 MiB
# field from coming back as a larger error event.
QUOTE_LEN = 64
_quote = reprlib.Repr()
_quote.maxstring = _quote.maxother = _quote.maxlong = QUOTE_LEN
_quote.maxlist = _quote.maxdict = 4
_quote.maxlevel = 2


def brief(value: Any) -> str:
    """repr(value) cut to a few dozen characters, for quoting client input in error messages."""
    return _quote.repr(value)


class ApiError(ValueError):
    """A client event is invalid; `param` names the offending field.

    `stream_id` is the event's own, when it had a valid one, so that a
    client multiplexing responses knows which of its requests failed.
    """

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request_error"):
        super().__init__(message)
        self.param = param
        self.code = code
        self.stream_id: str | None = None


_KIND_NAMES: dict[type, str] = {bool: "a boolean", str: "a string", dict: "an object"}


def optional(d: dict[str, Any], key: str, kind: type, *, name: str | None = None,
             max_len: int | None = None) -> Any:
    """`d[key]` when it is absent (None) or a `kind` (bool, str or dict; a str of at most
    `max_len` characters); otherwise ApiError "'NAME' must be a boolean" (a string ..., an
    object) with param NAME, `key` unless the field is nested."""
    v = d.get(key)
    if v is None or (isinstance(v, kind) and (max_len is None or len(v) <= max_len)):
        return v
    name = name or key
    what = _KIND_NAMES[kind] + ("" if max_len is None else f" of at most {max_len} characters")
    raise ApiError(f"'{name}' must be {what}", name)
