"""The router's stream merger: every output position once, in order (invariant 2).

RLD, MD and re-driven decoders stream `TokenRun`s (pddgw.core.tokens; the
router's stream edge names each one's role) that may overlap (RLD made 0..40, MD's stream starts at 35 after a
catch-up), repeat (a re-drive replays from a position already sent) or
arrive out of order.  `StreamMerger.push` returns the runs that became
emittable: contiguous, starting at the next unsent position, each from one
role.  Sampling is position-keyed, so two sources must agree on every
position; a disagreement is a correctness bug and raises `TokenConflict`
rather than picking a winner.  The first source to deliver a position is
the one credited for it (the RLD token share metric), and its logprobs (when
the request asked for them) are the ones passed on: every position's
logprobs once, in order, like its token.  Two sources' logprobs of one
position are not compared (float rounding may differ between nodes).
"""

from __future__ import annotations

from pddgw.core.ids import TOKEN_ID_LIMIT, in_range
from pddgw.core.tokens import TokenLogprobs, TokenRun
from pddgw.pipeline.state import ROLES, Role


class OrderingError(RuntimeError):
    """A source broke the stream contract."""


class TokenConflict(OrderingError):
    """Two sources produced different tokens for the same output position."""

    def __init__(self, request_id: str, position: int, kept: int, kept_role: Role,
                 got: int, got_role: Role) -> None:
        self.position = position
        self.kept = kept
        self.kept_role = kept_role
        self.got = got
        self.got_role = got_role
        super().__init__(
            f"request {request_id}: position {position} is token {kept} from {kept_role} "
            f"but {got_role} sent {got}")


class StreamGap(OrderingError):
    """The stream was sealed with positions never delivered."""


class StreamMerger:
    """Merges one request's token pieces into a single gap-free ordered stream.

    `push` is atomic: it either accepts the whole piece or raises without
    changing anything.  `max_ahead` bounds how far past the next unsent
    position a piece may reach, so a broken source cannot grow the buffer
    without limit.
    """

    def __init__(self, request_id: str = "", *, max_ahead: int = 1 << 16) -> None:
        if max_ahead < 1:
            raise ValueError("max_ahead must be >= 1")
        self.request_id = request_id
        self.max_ahead = max_ahead
        self._tokens: list[int] = []  # emitted, index = position
        self._roles: list[Role] = []
        # position -> (token, role, its logprobs or None)
        self._pending: dict[int, tuple[int, Role, TokenLogprobs | None]] = {}
        self._sealed: int | None = None
        self._counts: dict[Role, int] = {}
        self.duplicates = 0  # positions delivered again with the same token

    @property
    def next_position(self) -> int:
        """Positions [0, next_position) have been emitted."""
        return len(self._tokens)

    @property
    def emitted_tokens(self) -> tuple[int, ...]:
        return tuple(self._tokens)

    @property
    def pending(self) -> int:
        """Positions received ahead of a gap, waiting to be emitted."""
        return len(self._pending)

    @property
    def sealed_length(self) -> int | None:
        return self._sealed

    @property
    def complete(self) -> bool:
        return self._sealed is not None and self.next_position == self._sealed

    def tokens_by_role(self) -> dict[Role, int]:
        return dict(self._counts)

    def role_at(self, position: int) -> Role:
        if not 0 <= position < len(self._roles):
            raise IndexError(f"position {position} not emitted")
        return self._roles[position]

    def push(self, run: TokenRun) -> list[TokenRun]:
        """Accept a source's run (its `role` set; its logprobs one per token, or none); return
        the runs it made emittable, in order."""
        tokens = self._tokens
        position, token_ids, role, logprobs = run.position, run.ids, run.role, run.logprobs
        n = len(token_ids)
        if (position == len(tokens) and not self._pending and 0 < n <= self.max_ahead and role in ROLES
                and (self._sealed is None or position + n <= self._sealed)
                and (not logprobs or len(logprobs) == n)
                and in_range(token_ids, TOKEN_ID_LIMIT)):
            # The common piece: tokens at the next position, nothing waiting (a decoder's step,
            # or its stream interval's run): the one run `_drain` would make, without the
            # pending map - the source's run itself unless it ends the source's stream (what
            # is emitted says nothing of that).
            tokens += token_ids
            self._roles += (role,) * n
            self._counts[role] = self._counts.get(role, 0) + n
            if not run.done and run.request_id == self.request_id:
                return [run]
            return [TokenRun(self.request_id, position, tuple(token_ids), logprobs=logprobs, role=role)]
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}")
        if position < 0:
            raise ValueError(f"negative position {position}")
        toks = tuple(token_ids)
        if logprobs and len(logprobs) != len(toks):
            raise ValueError(f"{len(logprobs)} logprobs for {len(toks)} tokens")
        for t in toks:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"token ids must be non-negative ints, got {t!r}")
        end = position + len(toks)
        if end > self.next_position + self.max_ahead:
            raise OrderingError(
                f"request {self.request_id}: piece [{position}, {end}) reaches more than "
                f"{self.max_ahead} past position {self.next_position}")
        if self._sealed is not None and end > self._sealed:
            raise OrderingError(
                f"request {self.request_id}: piece [{position}, {end}) from {role} runs past "
                f"the end of the stream at {self._sealed}")
        # Validate everything first, so a conflict leaves the merger unchanged.
        fresh: list[tuple[int, int, TokenLogprobs | None]] = []
        dups = 0
        for i, t in enumerate(toks):
            p = position + i
            if p < len(self._tokens):
                kept, kept_role = self._tokens[p], self._roles[p]
            elif p in self._pending:
                kept, kept_role, _ = self._pending[p]
            else:
                fresh.append((p, t, logprobs[i] if logprobs else None))
                continue
            if kept != t:
                raise TokenConflict(self.request_id, p, kept, kept_role, t, role)
            dups += 1
        self.duplicates += dups
        for p, t, lp in fresh:
            self._pending[p] = (t, role, lp)
        return self._drain()

    def _drain(self) -> list[TokenRun]:
        """The runs from the next unsent position on: one per stretch of one role (and of
        positions with logprobs or without)."""
        runs: list[TokenRun] = []
        cur: list[int] = []
        lps: list[TokenLogprobs] = []
        cur_key: tuple[Role, bool] | None = None
        start = p = len(self._tokens)

        def close() -> None:
            runs.append(TokenRun(self.request_id, start, tuple(cur), logprobs=tuple(lps),
                                 role=cur_key[0]))  # type: ignore[index]

        while p in self._pending:
            t, r, lp = self._pending.pop(p)
            key = (r, lp is not None)
            if key != cur_key and cur:
                close()
                cur, lps, start = [], [], p
            cur_key = key
            cur.append(t)
            if lp is not None:
                lps.append(lp)
            self._tokens.append(t)
            self._roles.append(r)
            self._counts[r] = self._counts.get(r, 0) + 1
            p += 1
        if cur:
            close()
        return runs

    def seal(self, length: int) -> None:
        """Declare the output `length` tokens long (a decoder finished there).

        Positions below `length` may still be in flight (a slow RLD piece
        behind MD's finish); `complete` turns true when they have all been
        emitted.  Raises OrderingError if a source delivered a position at or
        past `length`; later pushes past it are errors too, earlier ones are
        still checked as duplicates.
        """
        if length < 0:
            raise ValueError("length must be >= 0")
        if self._sealed is not None and self._sealed != length:
            raise OrderingError(
                f"request {self.request_id}: sealed at {self._sealed}, then at {length}")
        beyond = sorted(p for p in self._pending if p >= length)
        if self.next_position > length or beyond:
            first = length if self.next_position > length else beyond[0]
            raise OrderingError(
                f"request {self.request_id}: position {first} was delivered but the output "
                f"ends at {length}")
        self._sealed = length

    def assert_complete(self) -> None:
        """Raise StreamGap unless the stream is sealed and every position emitted.

        Call when no source will send anything more for this request.
        """
        if self._sealed is None:
            raise StreamGap(f"request {self.request_id}: stream never sealed "
                            f"({self.next_position} positions emitted)")
        if self.next_position < self._sealed:
            missing = self.next_position
            raise StreamGap(
                f"request {self.request_id}: output ends at {self._sealed} but position "
                f"{missing} never arrived ({len(self._pending)} pending past the gap)")
