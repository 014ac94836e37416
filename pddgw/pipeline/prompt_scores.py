"""A node's prompt logprobs, kept for the router until the request's Cancel."""

from __future__ import annotations

from pddgw.core.tokens import TokenLogprobs
from pddgw.engines.types import RequestError
from pddgw.messages import MAX_LOGPROB_POSITIONS, Logprobs, PromptLogprobsQuery, logprob_pieces


class PromptScores:
    """A node's prompt logprobs kept for the router until its Cancel: request id -> one
    `TokenLogprobs` per prompt token 1..n-1.  Bounded: past `limit` requests (a router that
    never came back for them) the oldest go."""

    def __init__(self, limit: int = 1024) -> None:
        self.limit = limit
        self._by_id: dict[str, tuple[TokenLogprobs, ...]] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def put(self, request_id: str, entries: tuple[TokenLogprobs, ...]) -> None:
        self._by_id.pop(request_id, None)
        self._by_id[request_id] = entries
        while len(self._by_id) > self.limit:
            del self._by_id[next(iter(self._by_id))]

    def drop(self, request_id: str) -> None:
        self._by_id.pop(request_id, None)

    def piece(self, query: PromptLogprobsQuery) -> Logprobs:
        """The answer to a query; RequestError when this node has none for it."""
        entries = self._by_id.get(query.request_id)
        if entries is None:
            raise RequestError(f"request {query.request_id!r}: no prompt logprobs here")
        if not query.start <= len(entries):
            raise RequestError(f"request {query.request_id!r}: prompt logprobs start {query.start} "
                               f"past the last prompt token {len(entries)}")
        return logprob_pieces(query.request_id, query.start,
                              entries[query.start - 1 : query.start - 1 + MAX_LOGPROB_POSITIONS])[0]
