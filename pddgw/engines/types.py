"""Typed values that cross the Engine contract.

None of these hold tensors: a KV chunk carries its payload as a read-only
buffer (memoryview) plus a layout-independent description, so a cost-model
engine and the network layer can handle them without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]
KVSource = Literal["compute", "import"]
DTYPE_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
MAX_LOGPROBS = 20            # top alternatives per position, at most (OpenAI's bound)
LOGPROB_FLOOR = -9999.0      # what a log-probability of -inf is reported as (vLLM's convention; JSON has no -inf)


class RequestError(ValueError):
    """A request can never be served as given (too long, bad params, unknown id)."""


class CapacityError(RuntimeError):
    """Not enough KV blocks right now for a request that cannot wait (an import)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How output tokens are chosen.

    Sampling is position-keyed: the random draw for output position i depends
    only on (seed, i), so any node sampling position i draws the same token
    from the same logits.  temperature == 0 is greedy.

    logprobs (vLLM's convention): None = none; k in [0, MAX_LOGPROBS] = each
    sampled token's log-probability plus the k most probable alternatives
    (`TokenLogprobs`).  They are of the model's raw distribution, log_softmax
    of the logits before temperature, top-k/top-p/min-p (vLLM's default
    "raw_logprobs", OpenAI's), so they do not depend on how the token was drawn.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0          # 0 = no top-k filter
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0      # keep tokens with p >= min_p * p_max; 0 = no min-p filter
    logprobs: int | None = None   # None: no log-probabilities; k: the sampled token's + k top alternatives

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0.0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.seed < 2**63:
            raise RequestError(f"seed must be in [0, 2**63), got {self.seed}")
        lp = self.logprobs
        if lp is not None and (type(lp) is not int or not 0 <= lp <= MAX_LOGPROBS):
            raise RequestError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {lp!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    output_token_ids: tuple[int, ...] = ()
    kv_source: KVSource = "compute"
    retain_kv: bool = False
    hold: bool = False


@dataclass(frozen=True, slots=True)
class AddResult:
    """What `add_request` found: how many prompt tokens came from the prefix cache."""

    request_id: str
    num_cached_tokens: int


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
class RequestOutput:
    """What one engine step did for one request.

    new_token_ids are the tokens sampled this step, the first at output
    position `position`.  num_computed_tokens counts the tokens whose KV is
    in the cache (a P node streams KV out as it grows).  logprobs: one
    `TokenLogprobs` per new token when the request asked for them
    (`SamplingParams.logprobs` not None), else empty.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    position: int
    num_computed_tokens: int
    finished: bool = False
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str              # a key of DTYPE_ITEMSIZE
    block_size: int

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_ITEMSIZE[self.dtype]


@dataclass(frozen=True, slots=True)
class KVSpan:
    """Which KV a chunk carries, known before its payload (see `Engine.import_buffer`).

    Tokens [token_start, token_end) of layers [layer_start, layer_end), laid
    out as `KVChunk.data` is: [layers, 2 (K, V), tokens, kv_heads, head_dim]
    contiguous in `dtype`.
    """

    request_id: str
    token_start: int
    token_end: int
    layer_start: int
    layer_end: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start

    def nbytes(self) -> int:
        return ((self.layer_end - self.layer_start) * 2 * self.num_tokens * self.num_kv_heads
                * self.head_dim * DTYPE_ITEMSIZE[self.dtype])


@dataclass(frozen=True, slots=True)
class KVChunk:
    """KV of tokens [token_start, token_end) of layers [layer_start, layer_end).

    Layout independent: `data` is [layers, 2 (K, V), tokens, kv_heads,
    head_dim] contiguous in `dtype`, whatever block size or pool layout
    produced it.  A `virtual` chunk (from a cost-model engine) has the size
    of that array but carries no data: links charge its full size, so a
    modeled deployment moves a real model's KV volume without allocating it.
    """

    request_id: str
    token_start: int
    token_end: int
    layer_start: int
    layer_end: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    data: memoryview
    virtual: bool = False

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start

    def expected_nbytes(self) -> int:
        """Bytes of the KV this chunk stands for (what crosses a link)."""
        per_value = DTYPE_ITEMSIZE[self.dtype]
        return ((self.layer_end - self.layer_start) * 2 * self.num_tokens
                * self.num_kv_heads * self.head_dim * per_value)

    @property
    def payload_nbytes(self) -> int:
        """Bytes `data` must hold: all of them, or none for a virtual chunk."""
        return 0 if self.virtual else self.expected_nbytes()

    @property
    def span(self) -> KVSpan:
        return KVSpan(self.request_id, self.token_start, self.token_end, self.layer_start, self.layer_end,
                      self.num_kv_heads, self.head_dim, self.dtype)


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
