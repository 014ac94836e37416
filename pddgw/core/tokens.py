"""Output tokens at a position: the one value every layer from the decoder to the API passes on.

A `TokenRun` is what a decode worker emits per request per engine step; the
wire's `TokenItem` (pddgw.messages) is built from it and turned back into one
in exactly one place each.  `TokenLogprobs` is one position's
log-probabilities, as an engine computes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from pddgw.core.roles import Role

LOGPROB_FLOOR = -9999.0      # what a log-probability of -inf is reported as (vLLM's convention; JSON has no -inf)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The model's log-probabilities at one sampled output position (see `SamplingParams.logprobs`).

    logprob       of the sampled token
    top_ids       the k most probable token ids, most probable first
    top_logprobs  their log-probabilities (non-increasing)
    A log-probability of -inf is LOGPROB_FLOOR.
    """

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class TokenRun:
    """Tokens `ids` at output positions [position, end) of request `request_id`.

    done      the producer's stream of the request ends with this run
    reason    why, with done: "stop" or "length" (the engine's end of the
              output), "error" (the decoder failed the request: `error` says
              why, and `ids` is empty)
    logprobs  one per token when the request asked for them, else empty
    role      the role of the node that produced the run: None on the
              producing node (it does not travel on the wire), set at the
              router's stream edge, which merges by it
    No checks here: a run is built by pddgw itself, or from a wire item its
    constructor validated.
    """

    request_id: str
    position: int
    ids: tuple[int, ...]
    done: bool = False
    reason: str = ""
    logprobs: tuple[TokenLogprobs, ...] = ()
    role: Role | None = None
    error: str = ""

    @property
    def end(self) -> int:
        return self.position + len(self.ids)
