"""Stop strings: where an output's text ends, decided on the detokenized text at the router.

Contract (vLLM's `stop`, `include_stop_str_in_output`; OpenAI's `stop`):

  * `parse_stop(value)`: null, a string, or a list of at most `MAX_STOPS` non-empty
    strings of at most `MAX_STOP_CHARS` characters -> a tuple (duplicates dropped,
    order kept); anything else -> ApiError naming `stop`.
  * `StopMatcher.feed(text)` takes the output's text in pieces of any size and returns
    what may be released now.  The output ends at the FIRST character at which any
    stop string is complete (ties: the one starting first), also across pieces: the
    text released ends right before it, or right after it with `include`; `matched`
    is then that string and every later feed returns "".  The cut depends on the
    text alone, never on how it was split (tokens, runs, nodes).
  * Without `include`, text that could still start a stop string (the longest suffix
    that is a proper prefix of one) is held back until it cannot, so a client never
    sees a stop string's head that is later cut; with `include` nothing is held.
  * `check=False` feeds text without looking for stops in it (`min_tokens`): a stop
    completed by a later piece is still found, one wholly inside it never is.
  * `flush()` at the end of an output that matched no stop: the held text.
"""

from __future__ import annotations

from typing import Any

from pddgw.api.errors import ApiError, brief

MAX_STOPS = 16              # stop strings per request, at most (OpenAI allows 4)
MAX_STOP_CHARS = 256        # characters per stop string, at most


def parse_stop(v: Any, field: str = "stop") -> tuple[str, ...]:
    """A request's `stop` (null, a string or a list of strings) -> the stop strings; ApiError naming it."""
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or len(items) > MAX_STOPS:
        raise ApiError(f"'{field}' must be a string or a list of at most {MAX_STOPS} strings, got {brief(v)}",
                       field)
    out: dict[str, None] = {}
    for i, s in enumerate(items):
        where = field if isinstance(v, str) else f"{field}[{i}]"
        if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_CHARS:
            raise ApiError(f"'{where}' must be a non-empty string of at most {MAX_STOP_CHARS} characters, "
                           f"got {brief(s)}", field)
        out[s] = None
    return tuple(out)


class StopMatcher:
    """One output's stop-string matcher (see the module docstring)."""

    __slots__ = ("stops", "include", "matched", "_keep", "_tail", "_total", "_released")

    def __init__(self, stops: tuple[str, ...], include: bool = False):
        self.stops = stops
        self.include = include
        self.matched: str | None = None
        # Characters of text kept to find a stop string that ends in the next piece.
        self._keep = max((len(s) for s in stops), default=1) - 1
        self._tail = ""          # the last `_keep` characters fed (or fewer)
        self._total = 0          # characters fed so far
        self._released = 0       # characters released so far (a prefix of those fed)

    @property
    def held(self) -> int:
        """Characters fed and not yet released."""
        return self._total - self._released

    def feed(self, text: str, check: bool = True) -> str:
        if self.matched is not None or not text:
            return ""
        s = self._tail + text
        base = self._total - len(self._tail)       # s[0] is character `base` of the output
        cut = -1
        if check and self.stops:
            # The first complete occurrence: earliest end, then earliest start.  Only
            # occurrences ending in the new text count; those before were looked for.
            best: tuple[int, int] | None = None
            for stop in self.stops:
                i = s.find(stop, max(0, len(self._tail) - len(stop) + 1))
                if i >= 0:
                    key = (i + len(stop), i)
                    if best is None or key < best:
                        best, self.matched = key, stop
            if best is not None:
                end, start = best
                cut = base + (end if self.include else start)
        total = self._total + len(text)
        if cut >= 0:
            release_to = cut
        elif self.include or not self.stops:
            release_to = total
        else:
            release_to = total - self._stop_prefix(s)
        out = s[self._released - base : max(release_to, self._released) - base]
        self._released = max(release_to, self._released)
        self._total = total
        self._tail = s[-self._keep:] if self._keep else ""
        return out

    def _stop_prefix(self, s: str) -> int:
        """Length of the longest suffix of s that is a proper prefix of a stop string."""
        for n in range(min(self._keep, len(s)), 0, -1):
            suffix = s[-n:]
            if any(len(stop) > n and stop.startswith(suffix) for stop in self.stops):
                return n
        return 0

    def flush(self) -> str:
        """The end of an output that matched no stop string: the held text (then nothing)."""
        if self.matched is not None or not self.held:
            return ""
        out = self._tail[len(self._tail) - self.held:]
        self._released = self._total
        return out
