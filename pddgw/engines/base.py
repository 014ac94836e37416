"""The Engine contract, and a registry to pick an implementation by name.

Every role (P, RLD, MD) drives the same contract.  The control surface takes
and returns the tensor-free values of `pddgw.engines.types`, so an engine that
only models time (a cost model for cluster-scale simulation) fits it as well
as the torch engine.  An engine is single-threaded: callers serialise every
call (the async wrapper runs all of them on one worker thread).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence, Set
from enum import IntEnum
from typing import Any

from pddgw.core.ids import in_range
from pddgw.core.sampling import SamplingParams
from pddgw.engines.types import (DTYPE_ITEMSIZE, AddResult, EngineRequest, EngineStats, FinishReason, KVChunk,
                                 KVLayout, KVSpan, RequestError, RequestOutput)


class Engine(ABC):
    """A continuous-batching engine over a paged, prefix-cached KV pool.

    * `add_request` validates (RequestError for what can never be served), matches the
      prompt against the prefix cache and queues it; an "import" request gets all its
      prompt blocks at once (CapacityError if the pool cannot hold them).
    * An import's KV arrives by `import_kv` (or lands in place: `import_buffer`, then
      `accept_kv`); its blocks reach the prefix cache only after `finish_import`.
    * `step` runs one forward mixing prefill chunks, extends and decodes, samples each
      fully computed sequence not on hold, and returns one RequestOutput per request
      it advanced.
    * A request ends on a stop token, max_tokens, the context length or `abort`; its
      blocks are freed at once (full ones stay cached) unless `retain_kv`, then on `release`.
    * Under block pressure it queues or preempts and recomputes; it never crashes.

    Threads: every method runs on the caller's one engine thread, except `import_buffer`
    and `accept_kv`, which the network side calls while a step may be running.
    `shares_compute_thread` True: that thread is the process's one compute thread, on which
    such engines take turns (compute_thread.py); False: a thread of the engine's own.
    Time: `runs_inline` False means `step` takes real time (run it off the event loop);
    True means bookkeeping only, and `step_seconds()` is how long the step stands for.
    """

    runs_inline: bool = False
    shares_compute_thread: bool = False
    # Its KV chunks carry sizes, no data (a cost model): nothing can land in place.
    virtual_kv: bool = False

    def step_seconds(self) -> float:
        """Modeled duration of the last `step` (0 for an engine whose steps take real time)."""
        return 0.0

    def prompt_work(self) -> bool:
        """Whether some request has prompt tokens left to compute: a prefill engine's steps run
        back to back while this holds (async_engine.py, `PREFILL_STREAK`).  This default: while
        it has any work."""
        return self.has_work()

    def prompt_ends_next_step(self) -> bool:
        """Whether the next step would compute every prompt token left: a prefill streak due to
        yield takes that one step first (async_engine.py, `PREFILL_STREAK`).  This default: no."""
        return False

    def held_last_step(self) -> bool:
        """Whether the last `step` sampled tokens it holds back for a later output
        (`EngineRequest.output_interval`): a step that returned nothing still advanced, and the
        next one is due at once.  False for an engine that hands out every token."""
        return False

    @property
    @abstractmethod
    def kv_layout(self) -> KVLayout:
        """Shape of this engine's KV: layers, kv heads, head dim, dtype, block size."""

    @property
    @abstractmethod
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) this engine serves."""

    @abstractmethod
    def add_request(self, request: EngineRequest) -> AddResult:
        """Queue a request; raise RequestError / CapacityError without side effects."""

    @abstractmethod
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; return what changed, finished requests included (sampled
        tokens held back for a run, `EngineRequest.output_interval`, go out with it)."""

    @abstractmethod
    def has_work(self) -> bool:
        """True while some request can make progress in `step`."""

    @abstractmethod
    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its blocks; False if unknown.

        An import keeps the full blocks whose KV had completely arrived in
        the prefix cache (evictable), so a dropped transfer is not wasted.
        """

    @abstractmethod
    def release(self, request_id: str) -> bool:
        """Free the blocks a finished `retain_kv` request still holds; False if unknown."""

    @abstractmethod
    def append_tokens(self, request_id: str, token_ids: Sequence[int], final: bool) -> None:
        """Append handed-off output tokens; they are extended in one forward.

        With final=False the request stays on hold (compute all but the last
        token, do not sample);
        with final=True it samples from the next position on, or finishes at
        once if the last appended token is a stop token or reaches max_tokens
        or the context length.
        """

    @abstractmethod
    def match_prefix(self, block_hashes: Sequence[int], pin_key: str | None = None) -> int:
        """How many leading blocks of these chained hashes this engine holds.

        With a pin_key the matched blocks are pinned (never evicted) until
        `unpin(pin_key)`; the answer is then authoritative for a transfer.
        """

    @abstractmethod
    def unpin(self, pin_key: str) -> bool:
        """Release blocks pinned by `match_prefix`; False if unknown."""

    @abstractmethod
    def export_kv(self, request_id: str, token_start: int, token_end: int,
                  layer_start: int = 0, layer_end: int | None = None) -> KVChunk:
        """KV of a token range of a (running or retained) request, layout independent."""

    def export_kv_into(self, request_id: str, token_start: int, token_end: int, into: memoryview) -> KVChunk:
        """`export_kv` of every layer written into `into`, which becomes the chunk's payload.

        `into`: a writable byte view of exactly the chunk's payload size (the
        receiver's memory, from `Link.kv_buffer`); ValueError for any other.
        Here: exported, then copied; an engine that can gathers straight into it.
        """
        chunk = self.export_kv(request_id, token_start, token_end)
        check_export_buffer(into, chunk.span)
        into[:] = memoryview(chunk.payload).cast("B")
        return KVChunk(chunk.span, into)

    @abstractmethod
    def import_kv(self, chunk: KVChunk) -> None:
        """Write a chunk into an importing request's blocks (any dtype, any source block size).

        Tokens that already came from this engine's prefix cache are skipped.
        """

    def import_buffer(self, span: KVSpan) -> memoryview | None:
        """Thread-safe: where an arriving chunk's payload should be received, or None.

        Called between a chunk's description and its payload.  -> a writable, C-contiguous
        view of exactly `span.nbytes` bytes: ideally the destination in the KV pool (then
        `accept_kv` only marks the tokens present), else a buffer to copy from.  None: the
        caller allocates and `import_kv` reports what is wrong.  Pool memory handed out stays
        reserved until `accept_kv` or `import_kv` takes the chunk or the view is dropped.
        """
        return None

    def accept_kv(self, chunk: KVChunk) -> bool:
        """Thread-safe: validate an arrived chunk and commit it if its payload is already in place.

        Raises RequestError as `import_kv` would for a chunk it refuses.
        -> True: the payload was received into its destination in the pool
        (`import_buffer`) and the tokens are now present (or, if the import
        was aborted meanwhile, the reserved memory is given back): done.
        False: `import_kv` must still copy it, on the engine thread.
        """
        return False

    @abstractmethod
    def finish_import(self, request_id: str) -> None:
        """Every prompt token past the cached prefix has arrived: make the request runnable."""

    @abstractmethod
    def stats(self) -> EngineStats:
        """Block and queue counts."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError unless free + cached + used == total and ref counts agree."""

    def shutdown(self) -> None:  # noqa: B027 (optional hook; default does nothing)
        """Release what the engine holds beyond its Python objects (worker processes, files);
        called once, last, on the engine's thread.  Nothing by default."""



class TrackedEngine(Engine):
    """The part of the contract an engine that keeps its own table of requests shares with
    every other such engine (the paged engines, the vLLM engine): lookups, the admission and
    export checks, `append_tokens`, `abort` and `release`, around a few hooks.

    A subclass sets, in `__init__`: `spec` (its ModelSpec), `_layout`, `_max_model_len`,
    `_eos` (its EOS token ids), `_events` (a list of outputs produced outside `step`) and
    `_live` (request id -> its record).  A record has `status` (an IntEnum; its name says
    where the request is in error messages), `sampling`, `tokens` (prompt + outputs so far,
    a list), `hold` and `num_outputs`.  The subclass says which statuses are `_RETAINED`
    and `_EXTENDABLE`, and supplies `_num_computed`, `_abort`, `_forget` and `_appended`.
    """

    _RETAINED: IntEnum                 # a finished `retain_kv` request, kept until `release`
    _EXTENDABLE: frozenset[IntEnum]    # where `append_tokens` may extend a held request
    spec: Any
    _layout: KVLayout
    _max_model_len: int
    _eos: Set[int] | tuple[int, ...]
    _events: list[RequestOutput]
    _live: dict[str, Any]

    @abstractmethod
    def _num_computed(self, r: Any) -> int:
        """Tokens of the request whose KV this engine holds."""

    @abstractmethod
    def _abort(self, r: Any) -> int:
        """Drop an aborted request wherever it is, free what it holds; -> its tokens computed."""

    @abstractmethod
    def _forget(self, r: Any) -> None:
        """Free what a finished request still holds and drop it from `_live`."""

    @abstractmethod
    def _appended(self, r: Any, final: bool, reason: FinishReason | None) -> None:
        """After `append_tokens` extended a held request: finish it (`reason`) or go on."""

    @property
    def kv_layout(self) -> KVLayout:
        return self._layout

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def _get(self, request_id: str) -> Any:
        r = self._live.get(request_id)
        if r is None:
            raise RequestError(f"unknown request {request_id!r}")
        return r

    def _check_new(self, request: EngineRequest) -> None:
        """RequestError unless a new request can be admitted: an unused id, servable here."""
        if request.request_id in self._live:
            raise RequestError(f"request {request.request_id!r} already exists")
        check_request(request, self._max_model_len, self.spec.vocab_size)
        request.sampling.check_vocab(self.spec.vocab_size)

    def _check_export(self, request_id: str, token_start: int, token_end: int, computed: int,
                      layer_start: int, layer_end: int | None) -> int:
        """RequestError unless an export's ranges lie in the computed tokens and the model's
        layers; -> its layer end (None: the last layer)."""
        num_layers = self.spec.num_layers
        layer_end = num_layers if layer_end is None else layer_end
        if not 0 <= token_start < token_end <= computed:
            raise RequestError(f"request {request_id!r}: tokens [{token_start}, {token_end}) not "
                               f"in computed range [0, {computed})")
        if not 0 <= layer_start < layer_end <= num_layers:
            raise RequestError(f"layers [{layer_start}, {layer_end}) outside [0, {num_layers})")
        return layer_end

    def _finish_reason(self, r: Any, token: int | None) -> FinishReason | None:
        if token is None:
            return None
        return finish_reason(r.sampling, token, self._eos, r.num_outputs, len(r.tokens), self._max_model_len)

    def append_tokens(self, request_id: str, token_ids: Sequence[int], final: bool) -> None:
        r = self._get(request_id)
        if r.status not in self._EXTENDABLE:
            raise RequestError(f"request {request_id!r} is {r.status.name}, cannot extend")
        if not r.hold:
            raise RequestError(f"request {request_id!r} is not on hold: its next tokens are sampled here")
        check_handoff(request_id, token_ids, self.spec.vocab_size, len(r.tokens), r.num_outputs,
                      r.sampling.max_tokens, self._max_model_len)
        r.tokens += token_ids
        r.hold = not final
        reason = self._finish_reason(r, token_ids[-1]) if final and token_ids else None
        if reason is not None:
            # The handed-off tokens already complete the request: nothing to sample.
            self._events.append(RequestOutput(request_id, (), r.num_outputs, self._num_computed(r),
                                              True, reason))
        self._appended(r, final, reason)

    def abort(self, request_id: str) -> bool:
        r = self._live.get(request_id)
        if r is None:
            return False
        was_retained = r.status == self._RETAINED
        computed = self._abort(r)
        if not was_retained:
            self._events.append(RequestOutput(request_id, (), r.num_outputs, computed, True, "abort"))
        return True

    def release(self, request_id: str) -> bool:
        r = self._live.get(request_id)
        if r is None or r.status != self._RETAINED:
            return False
        self._forget(r)
        return True


def check_request(request: EngineRequest, max_model_len: int, vocab_size: int) -> None:
    """RequestError unless a new request could ever be served by an engine of this context
    length and vocabulary (the checks every implementation makes before anything is allocated)."""
    rid = request.request_id
    n_prompt, n_out = len(request.prompt_token_ids), len(request.output_token_ids)
    if n_prompt == 0:
        raise RequestError(f"request {rid!r}: empty prompt")
    total = n_prompt + n_out
    if total >= max_model_len:
        raise RequestError(f"request {rid!r}: {total} tokens leave no room for output "
                           f"(context length {max_model_len})")
    if n_out >= request.sampling.max_tokens:
        raise RequestError(f"request {rid!r}: {n_out} output tokens given, max_tokens is "
                           f"{request.sampling.max_tokens}")
    if not 1 <= request.output_interval <= 1024:
        raise RequestError(f"request {rid!r}: output_interval {request.output_interval} outside 1..1024")
    if not (in_range(request.prompt_token_ids, vocab_size) and in_range(request.output_token_ids, vocab_size)):
        bad = next(t for t in (*request.prompt_token_ids, *request.output_token_ids)
                   if type(t) is not int or not 0 <= t < vocab_size)
        raise RequestError(f"request {rid!r}: token id {bad} outside the vocabulary [0, {vocab_size})")


def check_handoff(request_id: str, token_ids: Sequence[int], vocab_size: int, num_tokens: int,
                  num_outputs: int, max_tokens: int, max_model_len: int) -> None:
    """RequestError unless handed-off tokens fit a request of num_tokens tokens (num_outputs
    of them outputs): known ids, within the context length and max_tokens."""
    if any(not 0 <= t < vocab_size for t in token_ids):
        raise RequestError(f"request {request_id!r}: handed-off token id outside [0, {vocab_size})")
    if num_tokens + len(token_ids) > max_model_len:
        raise RequestError(f"request {request_id!r}: handoff exceeds the context length")
    if num_outputs + len(token_ids) > max_tokens:
        raise RequestError(f"request {request_id!r}: handoff exceeds max_tokens")


def finish_reason(sampling: SamplingParams, token: int, eos: Set[int], num_outputs: int, num_tokens: int,
                  max_model_len: int) -> FinishReason | None:
    """Why a request whose latest token is `token` ends, or None: its stop tokens (EOS unless
    ignored) once min_tokens outputs exist, then max_tokens or the context length."""
    if num_outputs >= sampling.min_tokens and (token in sampling.stop_token_ids
                                               or (token in eos and not sampling.ignore_eos)):
        return "stop"
    if num_outputs >= sampling.max_tokens or num_tokens >= max_model_len:
        return "length"
    return None


def check_kv_span(span: KVSpan, layout: KVLayout, num_prompt: int) -> None:
    """RequestError unless a chunk's span fits an import of a num_prompt-token prompt into
    an engine of this KV layout (any dtype it names, any token range of the prompt)."""
    rid = span.request_id
    if (span.num_kv_heads, span.head_dim) != (layout.num_kv_heads, layout.head_dim):
        raise RequestError(f"request {rid!r}: KV shape heads={span.num_kv_heads} "
                           f"head_dim={span.head_dim} does not match this model's "
                           f"{layout.num_kv_heads}x{layout.head_dim}")
    if span.dtype not in DTYPE_ITEMSIZE:
        raise RequestError(f"request {rid!r}: unknown KV dtype {span.dtype!r}")
    if not 0 <= span.layer_start < span.layer_end <= layout.num_layers:
        raise RequestError(f"request {rid!r}: layers [{span.layer_start}, {span.layer_end}) "
                           f"outside [0, {layout.num_layers})")
    if not 0 <= span.token_start < span.token_end <= num_prompt:
        raise RequestError(f"request {rid!r}: tokens [{span.token_start}, {span.token_end}) "
                           f"outside the prompt [0, {num_prompt})")


def check_export_buffer(into: memoryview, span: KVSpan) -> None:
    """ValueError unless `into` can take the payload of `span` (`Engine.export_kv_into`)."""
    if into.readonly or not into.c_contiguous or into.format != "B" or into.nbytes != span.payload_nbytes:
        raise ValueError(f"export of request {span.request_id!r}: needs a writable contiguous byte view of "
                         f"{span.payload_nbytes} bytes, got {into.nbytes} (readonly={into.readonly})")


# `engine.implementation` -> the module whose import registers it (`register_engine`).  A plug-in
# table, read on first use: a deployment imports only the implementation it runs (vLLM's module
# stays unloaded on a torch node), and the cost-model engine lives in the sim layer above this one,
# with the profiles and roofline it prices steps with, without this package importing upwards.
IMPLEMENTATIONS = {
    "torch": "pddgw.engines.torch_engine",
    "vllm": "pddgw.engines.vllm_engine",       # vLLM itself is imported when one is built
    "costmodel": "pddgw.sim.costmodel_engine",
}
# name -> Engine class; its `from_config(config, engine_config, models)` -> (Engine, Tokenizer)
_REGISTRY: dict[str, type[Engine]] = {}


def register_engine(name: str) -> Callable[[Any], Any]:
    """Class decorator: the class (built by its `from_config(config, engine_config, models)`) becomes
    engine `name`."""
    def deco(cls: Any) -> Any:
        if name in _REGISTRY:
            raise ValueError(f"engine {name!r} registered twice")
        _REGISTRY[name] = cls
        return cls

    return deco


def engine_class(implementation: str) -> type[Engine]:
    """The registered class of an `engine.implementation` name."""
    if implementation not in _REGISTRY and implementation in IMPLEMENTATIONS:
        importlib.import_module(IMPLEMENTATIONS[implementation])
    try:
        return _REGISTRY[implementation]
    except KeyError:
        raise ValueError(f"engine.implementation: unknown engine {implementation!r} "
                         f"(known: {', '.join(sorted(IMPLEMENTATIONS))})") from None


def create_engine(config: Any, engine_config: Any = None, models: Any = None) -> tuple[Engine, Any]:
    """The engine `engine_config.implementation` (default: config.engine's) and its tokenizer;
    `models` (weights.SharedModels), where given, lends the weights already loaded in this process."""
    ecfg = engine_config or config.engine
    return engine_class(ecfg.implementation).from_config(config, ecfg, models)  # type: ignore[attr-defined]
