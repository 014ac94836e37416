"""The front door's client-error type, how it quotes client input, and the field checks
every route's decoder shares."""

from __future__ import annotations

import reprlib
from collections.abc import Callable
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


def text_content(content: Any, where: str, part_text: Callable[[Any, str, str], str]) -> str:
    """A message's content as one string: a string as it is, or a list of parts joined, each
    checked and read by `part_text(part, "WHERE[i]", where)` (each API has its own part shape);
    otherwise ApiError "WHERE must be a string or a list of text parts" with param `where`."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part_text(part, f"{where}[{i}]", where) for i, part in enumerate(content))
    raise ApiError(f"{where} must be a string or a list of text parts", where)
