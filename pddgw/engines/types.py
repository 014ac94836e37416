"""Typed values that cross the Engine contract.

None of these hold tensors: a KV chunk (`KVChunk`, pddgw.core.kv, the very
value a link sends) carries its payload as a buffer plus a layout-independent
`KVSpan`, so a cost-model engine and the network layer handle it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# Defined in the bottom layer (pddgw.core); re-exported for the engines' callers and tests.
from pddgw.core.errors import RequestError  # noqa: F401
from pddgw.core.kv import DTYPE_ITEMSIZE, KVChunk, KVSpan  # noqa: F401
from pddgw.core.sampling import MAX_LOGPROBS, SamplingParams  # noqa: F401
from pddgw.core.tokens import LOGPROB_FLOOR, TokenLogprobs  # noqa: F401

FinishReason = Literal["stop", "length", "abort"]
KVSource = Literal["compute", "import"]


class CapacityError(RuntimeError):
    """Not enough KV blocks right now for a request that cannot wait (an import)."""


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One sequence for an engine.

    prompt_token_ids   the prompt.
    output_token_ids   output tokens already generated elsewhere (positions
                       0..k-1): a P-computed first token, or a token-ID handoff.
                       Their KV is computed here in one extend.
    kv_source          "compute": the engine prefills the prompt itself (with
                       prefix-cache hits); "import": the prompt KV past the
                       cached prefix arrives through `import_kv`, and the
                       request waits until `finish_import`.
    retain_kv          keep the blocks after the request finishes, until
                       `release` (a P node holds them until they are sent).
    hold               compute KV but do not sample until `append_tokens(...,
                       final=True)` (MD during a catch-up handoff).
    output_interval    sampled tokens per output, as vLLM's --stream-interval:
                       the first token alone, then `output_interval` at a
                       time, the rest with the final output.  A hint (an
                       engine may hand out every token): readers count
                       tokens, never outputs.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    output_token_ids: tuple[int, ...] = ()
    kv_source: KVSource = "compute"
    retain_kv: bool = False
    hold: bool = False
    output_interval: int = 1


@dataclass(frozen=True, slots=True)
class AddResult:
    """What `add_request` found: how many prompt tokens came from the prefix cache."""

    request_id: str
    num_cached_tokens: int


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one engine step did for one request (its token fields spelt as `TokenRun`'s).

    ids: the tokens sampled this step, the first at output position `position`.
    num_computed_tokens: tokens whose KV is in the cache.  done: the request
    ended here, for `reason`.  logprobs: one per new token when asked for.
    prompt_logprobs: once, in the step that computed the last prompt token, one
    per prompt token 1..n-1, when asked for and the prompt was computed here.
    """

    request_id: str
    ids: tuple[int, ...]
    position: int
    num_computed_tokens: int
    done: bool = False
    reason: FinishReason | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str              # a key of DTYPE_ITEMSIZE
    block_size: int

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_ITEMSIZE[self.dtype]

    def span(self, request_id: str, tokens: tuple[int, int], layers: tuple[int, int] | None = None,
             virtual: bool = False) -> KVSpan:
        """The span of these tokens (and layers; None: every layer) of a request's KV in this layout."""
        return KVSpan.of(request_id, tokens=tokens, layers=layers or (0, self.num_layers),
                         num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                         dtype=self.dtype, virtual=virtual)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_blocks: int
    free_blocks: int
    cached_blocks: int          # unreferenced, hashed, evictable
    used_blocks: int            # referenced by requests or pins
    running: int
    waiting: int
    importing: int
    retained: int
    pins: int
    prefix_hit_tokens: int      # cumulative
    prefix_query_tokens: int    # cumulative
    preemptions: int
