"""config.toml -> frozen, slotted dataclasses.

Every section is a dataclass; `load_config(path)` walks the TOML tree against
the dataclass fields (`config_build.py`), so an unknown key or a value of the wrong type is a
`ConfigError` that names the file and the dotted key.  Semantic checks live in
each class's `__post_init__` and raise `ValueError`; the loader re-raises them
as `ConfigError` with the key of the section.  Defaults describe the embedded
deployment (`pddgw serve` with no config): every role in one process, the
built-in tiny model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pddgw.config_build import ConfigError, load_toml
from pddgw.core.errors import check as _check
from pddgw.core.roles import Pipeline, Role


class StartupError(RuntimeError):
    """A valid config cannot start here: an address already in use, a peer that never
    answers.  The message names the address or node and what to do; the CLI prints it
    without a traceback (exit status 1, where a ConfigError's is 2)."""


DType = Literal["auto", "float32", "float16", "bfloat16", "float64"]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which weights every role serves."""

    # Hugging Face-format directory (config.json, *.safetensors, tokenizer.json);
    # empty = the built-in tiny model.
    path: str = ""
    # "auto": the checkpoint's, where this machine computes it natively (engines/dtypes.py).
    dtype: DType = "auto"
    # Seed of the built-in tiny model's weights (ignored for `path`).
    tiny_seed: int = 0
    # Cap on prompt + output tokens; 0 = the model's own max_position_embeddings.
    max_model_len: int = 0
    # A named model shape without weights for the cost-model engine: a pddgw.sim.profiles
    # name (e.g. "llama3-70b", "deepseek-v4-pro") or a Hugging Face config.json path;
    # excludes `path`.
    profile: str = ""

    def __post_init__(self) -> None:
        _check(self.max_model_len >= 0, "max_model_len must be >= 0")
        _check(not (self.path and self.profile), "set path or profile, not both")


@dataclass(frozen=True, slots=True)
class CostModelConfig:
    """The hardware a cost-model engine instance models (`implementation = "costmodel"`).

    An instance is `data_parallel` attention ranks of `tensor_parallel` GPUs each
    (`pddgw.sim.roofline.Parallel`), routed experts over `expert_parallel` of them; beyond
    `gpus_per_node` the expert all-to-all crosses the scale-out network.  A dense model:
    tensor_parallel alone.
    """

    # A pddgw.sim.profiles.HARDWARE name (e.g. "H100-SXM", "H200-SXM", "A100-80G").
    hardware: str = "H100-SXM"
    tensor_parallel: int = 1
    # Attention data-parallel ranks (DP-attention); GPUs per instance = tensor_parallel x this.
    data_parallel: int = 1
    # GPUs the routed experts are spread over; 0 = all of the instance's.  Must divide them.
    expert_parallel: int = 0
    gpus_per_node: int = 8
    # Share of the GPUs' memory for weights + KV when num_blocks = 0 (vLLM's default).
    gpu_memory_utilization: float = 0.9
    # FP4 weights on a part without FP4 tensor cores (pddgw.sim.profiles.as_run): "w4a16" keeps
    # the FP4 bytes and computes in BF16 (the engines' default), "fp8_repack" serves an FP8 copy.
    fp4_on_non_native: Literal["w4a16", "fp8_repack"] = "w4a16"

    def __post_init__(self) -> None:
        _check(bool(self.hardware), "hardware must not be empty")
        _check(self.fp4_on_non_native in ("w4a16", "fp8_repack"), "fp4_on_non_native must be w4a16 or fp8_repack")
        _check(1 <= self.tensor_parallel <= 64, "tensor_parallel must be in [1, 64]")
        _check(1 <= self.data_parallel <= 512, "data_parallel must be in [1, 512]")
        _check(1 <= self.gpus_per_node <= 72, "gpus_per_node must be in [1, 72]")
        _check(self.expert_parallel >= 0 and (not self.expert_parallel or self.gpus % self.expert_parallel == 0),
               f"expert_parallel = {self.expert_parallel} must divide the instance's {self.gpus} GPUs "
               f"(tensor_parallel {self.tensor_parallel} x data_parallel {self.data_parallel}), or be 0 (all)")
        _check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]")

    @property
    def gpus(self) -> int:
        """GPUs of one instance."""
        return self.tensor_parallel * self.data_parallel


@dataclass(frozen=True, slots=True)
class VllmEngineConfig:
    """vLLM's own settings for `implementation = "vllm"` (pddgw/engines/vllm_engine.py).

    The rest of [engine] maps onto vLLM's arguments: block_size, num_blocks
    (KV blocks, vLLM's placeholder block added), max_num_seqs,
    max_num_batched_tokens, enable_prefix_caching; model.path and model.dtype
    give the checkpoint and dtype.
    """

    # > 1: vLLM's multiprocessing executor, one worker process per rank on this host (imports
    # staged in /dev/shm, each rank loads its KV heads; exports gather them).
    tensor_parallel: int = 1
    # Must be 1 (pddgw's connector does not split layers across ranks).
    pipeline_parallel: int = 1
    # On CUDA, vLLM's share of GPU memory; on CPU vLLM only checks that this share of the
    # node's memory is free at start (the KV pool's size comes from num_blocks).
    gpu_memory_utilization: float = 0.9
    # No torch.compile / CUDA graphs at start-up (slower steps, start in seconds).
    enforce_eager: bool = False
    # Further vLLM EngineArgs, passed through as given (checked against EngineArgs at start).
    args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(self.tensor_parallel >= 1, "tensor_parallel must be >= 1")
        _check(self.pipeline_parallel >= 1, "pipeline_parallel must be >= 1")
        _check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]")


# A relaying P's default `mixed_step_tokens`: `python -m pddgw.bench.relay` (DeepSeek-V4-Pro on
# 24 H100, 64K-token prompts in 8K chunks a rank) prices its relayed TPOT at 0.04 x the uncapped
# step's and its prefill rate at 0.94 x; 128 buys 0.02 x for 0.80 x.
RELAY_MIXED_STEP_TOKENS = 256


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Paged KV pool and scheduler limits of one engine instance."""

    # Registered Engine implementation (pddgw.engines.base.create_engine):
    # "torch" computes, "vllm" runs vLLM's engine in process, "costmodel" models the time of a
    # real model on real GPUs.
    implementation: str = "torch"
    device: str = "cpu"
    block_size: int = 16
    # KV blocks per layer in the pool; 0 = what the modeled GPUs' memory holds
    # after the weights (cost-model engine only).
    num_blocks: int = 512
    # Running sequences, and tokens computed in one forward step (prefill chunks + extends +
    # decodes), per attention-DP rank (`dp_ranks`), as vLLM's --max-num-seqs and
    # --max-num-batched-tokens with --data-parallel-size (each rank its own scheduler): an
    # instance of dp ranks runs dp x as many, and one sequence's chunk is at most
    # max_num_batched_tokens (it lives on one rank).
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # A step that also decodes computes at most this many tokens besides its decodes (per
    # rank): a relaying prefill node (`[[nodes]] relay`) keeps its relayed requests' TPOT
    # near one such chunk's time instead of a whole max_num_batched_tokens chunk's.  0 = no
    # cap, except on a relaying P: RELAY_MIXED_STEP_TOKENS (docs/operations.md, "A relay on P").
    mixed_step_tokens: int = 0
    enable_prefix_caching: bool = True
    # A decoding request's tokens go to the router every this many (vLLM's and SGLang's
    # --stream-interval), and always at its end; the first token at once.  Larger: fewer
    # frames and less work per token on the way to the client, tokens arriving in bursts.
    stream_interval: int = 1
    # "auto": Triton on CUDA, "cpu" on the CPU (its C decode kernel; "torch" where it does not
    # build), "torch": the reference kernels anywhere (kernels/__init__.py).
    attention_backend: Literal["auto", "triton", "cpu", "torch"] = "auto"
    # Torch engine on CUDA: decode-only steps replay CUDA graphs captured at start for
    # bucketed batch sizes (1, 2, 4, 8, 16, 24, ... up to max_num_seqs; a batch is padded up
    # to its bucket); prefill / extend / mixed steps and larger batches run eagerly.  Needs
    # the Triton attention backend (with the torch one it logs a note and runs eagerly);
    # refused on device "cpu".
    cuda_graphs: bool = False
    # torch intra-op threads of a CPU engine's steps.  1 by default: on a small shared machine,
    # spinning OpenMP workers of several processes slow each other down by an order of
    # magnitude.  The engines of one process with more than one (0 = torch's default) take
    # turns on one compute thread (engines/compute_thread.py), each step with its count; the
    # embedded topology's engines take every core (deploy/serve.py).
    cpu_threads: int = 1
    costmodel: CostModelConfig = field(default_factory=CostModelConfig)
    vllm: VllmEngineConfig = field(default_factory=VllmEngineConfig)

    @property
    def dp_ranks(self) -> int:
        """Attention-DP ranks of one instance: the cost-model engine's data_parallel; the
        torch and vLLM engines run one."""
        return self.costmodel.data_parallel if self.implementation == "costmodel" else 1

    def __post_init__(self) -> None:
        _check(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
               "block_size must be a positive power of two")
        _check(self.num_blocks >= 0, "num_blocks must be >= 0")
        _check(self.max_num_seqs > 0, "max_num_seqs must be > 0")
        _check(self.max_num_batched_tokens >= self.max_num_seqs,
               "max_num_batched_tokens must be >= max_num_seqs")
        _check(self.cpu_threads >= 0, "cpu_threads must be >= 0")
        _check(self.mixed_step_tokens >= 0, "mixed_step_tokens must be >= 0")
        check_stream_interval(self.stream_interval)
        _check(not self.cuda_graphs or self.device.startswith("cuda"),
               f"cuda_graphs = true needs a CUDA device, not device = {self.device!r} "
               "(set cuda_graphs = false, or device = \"cuda\")")


def check_stream_interval(n: int) -> None:
    """ConfigError unless `n` is a stream interval (engine.stream_interval) in 1..1024."""
    _check(1 <= n <= 1024, "stream_interval must be in 1..1024")


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """The router's decision knobs (pddgw/pipeline/policy.py explains each rule).

    Loads are dimensionless: max(queued+running seqs / max_num_seqs,
    KV blocks in use / total), so 1.0 means full.
    """

    # "auto" = decide per request; a fixed value forces every request onto one
    # pipeline (e.g. "P-MD" is the naive cross-DC PD baseline).
    pipeline: Pipeline | Literal["auto"] = "auto"
    # P-MD only if MD's missing KV crosses the WAN (half an RTT + bytes/bandwidth)
    # within this many ms; otherwise RLD covers the wait (P-RLD-MD).
    p_md_max_transfer_ms: float = 200.0
    # P also sends the router the first token the moment it samples it (unless P relays the
    # request itself): the client's first token waits for no KV transfer, and the transfer's wait
    # moves to the second token (TPOT; it misses a TPOT SLO that short answers would have met).
    # Off: the first decoder emits it, as vLLM's and SGLang's disaggregated serving do (and the
    # systems `pddgw sim` and `pddgw plan` compare).  The embedded default turns it on.
    first_token_from_p: bool = False
    # MD at or above this load starts decoding late, so even a request whose KV
    # fits the budget goes through RLD for its first tokens.
    md_busy_load: float = 0.9
    # RLD is a small relay pool: one instance relays at most `rld_max_relays`
    # sequences at once, and their prompts may fill at most `rld_max_kv_share`
    # of its KV blocks.  A request that would cross either limit waits for the
    # WAN instead (P-MD), however slow: a relay that absorbs whatever the WAN
    # cannot carry ends up producing the output (the oscillating pipeline).
    rld_max_relays: int = 8
    rld_max_kv_share: float = 0.9
    # Singular traffic (finished on RLD, "P-RLD"): at least this many prompt
    # tokens missing on MD and at most this many output tokens requested.
    singular_min_uncached_tokens: int = 2048
    singular_max_output_tokens: int = 16
    # Token bucket on singular admissions: every request adds `singular_max_share`
    # credit (capped at `singular_burst`), a singular request spends 1, so over
    # any run of N requests at most max_share * N + burst go P-RLD (max_share 0
    # turns singular routing off).  Overusing P-RLD lets MD's prefix cache fall
    # behind P's (the oscillating pipeline).
    singular_max_share: float = 0.05
    singular_burst: float = 2.0
    # Prefix affinity: with several P or MD instances, ask each (in parallel, one
    # round trip) which of the prompt's blocks it caches and take the longest
    # hit among those below `affinity_max_load` (ties: the least loaded), so a
    # conversation's next turn finds its KV where the last turn left it.
    # false = the least-loaded instance, whatever it caches.
    prefix_affinity: bool = True
    affinity_max_load: float = 0.9
    # An MD's remembered prefix counts only when it covers at least this share of the prompt
    # (SGLang's router: --cache-threshold, 0.3 by default); below it the least-loaded MD.
    # Every conversation's first turn shares the system prompt alone: without the threshold,
    # all new conversations go to the first MD that served one until it is
    # affinity_max_load full, and the others idle.
    affinity_min_match: float = 0.3
    # Handoff mode: "auto" = by load (loaded RLD -> one-shot, loaded MD -> catch-up).
    handoff_mode: Literal["auto", "one-shot", "catch-up"] = "auto"
    # Loads at or above which a role counts as loaded for the handoff choice.
    handoff_rld_loaded: float = 0.75
    handoff_md_loaded: float = 0.75
    # Catch-up: rounds continue while at least this many generated tokens are
    # still unsent; below it the remainder goes as the final one-shot.
    catchup_threshold: int = 64
    # The threshold when MD is loaded: smaller extends keep its batches smooth.
    catchup_threshold_md_loaded: int = 32
    # Largest non-final catch-up chunk (tokens extended in one MD step).
    catchup_max_chunk: int = 256
    # After this many non-final rounds the next round is final whatever is left,
    # so a handoff ends even if MD extends slower than RLD decodes.
    catchup_max_rounds: int = 8
    # MD cache alignment (pipeline/alignment.py) is background WAN traffic: the
    # KV bytes that pending alignments may still move are bounded by this; a new
    # one that would cross it sheds the oldest first (16 GiB: ~14 s of a 10 Gbps WAN).
    alignment_max_backlog_bytes: int = 16 << 30
    # Prior of the WAN link estimator until transfers are observed.
    link_prior_mbps: float = 10_000.0
    link_prior_rtt_ms: float = 30.0
    # Estimator: EWMA weight of each new sample, median window against outliers
    # (a full window all > 25 % off on one side is a level shift, followed at
    # once), and the smallest transfer that counts as a bandwidth sample
    # (smaller ones measure latency, not bandwidth).
    link_ewma_alpha: float = 0.2
    link_median_window: int = 3
    link_min_sample_bytes: int = 65_536

    def __post_init__(self) -> None:
        _check(self.p_md_max_transfer_ms >= 0, "p_md_max_transfer_ms must be >= 0")
        _check(self.md_busy_load > 0, "md_busy_load must be > 0")
        _check(self.rld_max_relays >= 1, "rld_max_relays must be >= 1")
        _check(0.0 < self.rld_max_kv_share <= 1.0, "rld_max_kv_share must be in (0, 1]")
        _check(self.affinity_max_load > 0, "affinity_max_load must be > 0")
        _check(0.0 <= self.affinity_min_match <= 1.0, "affinity_min_match must be in [0, 1]")
        _check(self.singular_min_uncached_tokens >= 1, "singular_min_uncached_tokens must be >= 1")
        _check(self.singular_max_output_tokens >= 0, "singular_max_output_tokens must be >= 0")
        _check(0.0 <= self.singular_max_share <= 1.0, "singular_max_share must be in [0, 1]")
        _check(self.singular_burst >= 1, "singular_burst must be >= 1")
        _check(self.handoff_rld_loaded > 0, "handoff_rld_loaded must be > 0")
        _check(self.handoff_md_loaded > 0, "handoff_md_loaded must be > 0")
        _check(self.catchup_threshold >= 1, "catchup_threshold must be >= 1")
        _check(1 <= self.catchup_threshold_md_loaded <= self.catchup_threshold,
               "catchup_threshold_md_loaded must be in [1, catchup_threshold]")
        _check(self.catchup_max_chunk >= self.catchup_threshold,
               "catchup_max_chunk must be >= catchup_threshold")
        _check(self.catchup_max_rounds >= 1, "catchup_max_rounds must be >= 1")
        _check(self.alignment_max_backlog_bytes >= 0, "alignment_max_backlog_bytes must be >= 0")
        _check(self.link_prior_mbps > 0, "link_prior_mbps must be > 0")
        _check(self.link_prior_rtt_ms >= 0, "link_prior_rtt_ms must be >= 0")
        _check(0.0 < self.link_ewma_alpha <= 1.0, "link_ewma_alpha must be in (0, 1]")
        _check(self.link_median_window >= 1, "link_median_window must be >= 1")
        _check(self.link_min_sample_bytes >= 1, "link_min_sample_bytes must be >= 1")


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """One node of a multi-node deployment (`pddgw serve --node NAME`)."""

    name: str
    role: Role
    # Nodes in different clusters talk over the shaped WAN link, within a
    # cluster over the fabric link.
    cluster: str = "A"
    host: str = "127.0.0.1"
    # Node-link port (the router's is its front door, see [server]).
    port: int = 0
    # Relative hardware cost, for SLA goodput per cost (BCR) reports.
    cost: float = 1.0
    # Overrides [engine] on this node (heterogeneous hardware); absent = [engine].
    engine: EngineConfig | None = None
    # A prefill node that is also its cluster's relay: it decodes the first tokens of the
    # requests it prefills (one engine, one copy of the weights) while their KV crosses
    # the WAN, then hands off to MD as an RLD node does.
    relay: bool = False

    def __post_init__(self) -> None:
        _check(not self.relay or self.role == Role.PREFILL,
               f"node {self.name!r}: relay = true is for a prefill node (this one is {self.role!s})")
        _check(bool(self.name) and self.name.replace("-", "").replace("_", "").isalnum(),
               f"node name {self.name!r} must be letters, digits, '-' or '_'")
        _check(0 <= self.port < 65536, "port must be in [0, 65535]")
        _check(self.cost > 0, "cost must be > 0")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The router's front door (WebSocket chat, health, debug)."""

    host: str = "127.0.0.1"
    port: int = 8000
    # Accepted API keys (Authorization: Bearer KEY); empty = no key required.
    api_keys: tuple[str, ...] = ()
    # Keys that may also steer a request (force its pipeline / handoff mode with the
    # `pddgw` extension); they are accepted API keys too.  Or let everyone steer:
    admin_keys: tuple[str, ...] = ()
    allow_request_steering: bool = False
    max_message_bytes: int = 1 << 20
    max_concurrent_requests: int = 256
    max_streams_per_connection: int = 64
    # A request that has not completed by then ends with an error event.
    request_timeout_s: float = 600.0
    # Requests waiting for KV room on a full decoder (FIFO); one more is refused
    # with an `overloaded` error, as is one that waited max_queue_wait_s.
    max_queued_requests: int = 256
    max_queue_wait_s: float = 120.0
    # No healthy node of a role a request needs (a P restarting): wait this long for one.
    node_wait_s: float = 30.0
    # SIGTERM drains a node (a rolling restart): it takes no new request and its in-flight
    # ones finish or are moved to another node within this bound; then it exits.
    drain_timeout_s: float = 30.0
    # Read timeouts at the front door (api/guard.py).  A new connection's first request
    # head must be complete within header_read_timeout_s; an idle kept-alive connection
    # (also one sending a later request's head) is closed keepalive_timeout_s after its
    # last response.
    header_read_timeout_s: float = 10.0
    keepalive_timeout_s: float = 75.0
    # A request body must arrive at >= body_min_bytes_per_s after a grace period: by
    # t seconds after its head, (t - body_read_grace_s) * body_min_bytes_per_s bytes.
    body_read_grace_s: float = 10.0
    body_min_bytes_per_s: int = 16384
    # A WebSocket that sends no event this long after its upgrade is closed (1008).
    websocket_idle_timeout_s: float = 30.0
    # Open connections from one client address; one more gets 429 and is closed.
    max_connections_per_client: int = 128

    def __post_init__(self) -> None:
        _check(0 <= self.port < 65536, "port must be in [0, 65535]")
        _check(self.header_read_timeout_s > 0, "header_read_timeout_s must be > 0")
        _check(self.keepalive_timeout_s >= self.header_read_timeout_s,
               "keepalive_timeout_s must be >= header_read_timeout_s")
        _check(self.body_read_grace_s > 0, "body_read_grace_s must be > 0")
        _check(self.body_min_bytes_per_s > 0, "body_min_bytes_per_s must be > 0")
        _check(self.websocket_idle_timeout_s > 0, "websocket_idle_timeout_s must be > 0")
        _check(self.max_connections_per_client > 0, "max_connections_per_client must be > 0")
        _check(self.max_queued_requests >= 0, "max_queued_requests must be >= 0")
        _check(self.max_queue_wait_s > 0, "max_queue_wait_s must be > 0")
        _check(self.node_wait_s >= 0, "node_wait_s must be >= 0")
        _check(self.drain_timeout_s > 0, "drain_timeout_s must be > 0")
        _check(self.max_message_bytes >= 1024, "max_message_bytes must be >= 1024")
        _check(self.max_concurrent_requests > 0, "max_concurrent_requests must be > 0")
        _check(self.max_streams_per_connection > 0, "max_streams_per_connection must be > 0")
        _check(self.request_timeout_s > 0, "request_timeout_s must be > 0")
        _check(all(k for k in self.admin_keys), "admin_keys must be non-empty strings")


@dataclass(frozen=True, slots=True)
class LogConfig:
    level: Literal["debug", "info", "warning", "error"] = "info"
    json: bool = False


@dataclass(frozen=True, slots=True)
class ShapingConfig:
    """WAN / fabric emulation of one named link (`[[net.links]]`), applied per direction.

    Bandwidth is either constant (`gbps`) or a step trace `[[t_seconds, gbps], ...]`
    starting at t = 0 (time since the link opened); `trace_period_s > 0` repeats it.
    A frame is delivered one serialization time plus `latency_ms` (one way)
    +- uniform `jitter_ms` after the previous one left; a link's frames of one
    traffic class arrive in order, foreground ones overtake background ones
    (net/shaping.py).
    """

    # Which link this shapes; the wiring code asks `NetConfig.shaping(name)`.
    name: str = "wan"
    gbps: float = 0.0                                 # 0 = unlimited (unless `trace`)
    latency_ms: float = 0.0
    jitter_ms: float = 0.0
    trace: tuple[tuple[float, float], ...] = ()
    trace_period_s: float = 0.0
    seed: int = 0                                     # jitter draws are reproducible
    # One pipe per direction shared by every in-process link of this name
    # between the same two clusters (a datacenter interconnect that all
    # instances share), instead of one pipe per link (a NIC per node pair).
    shared: bool = False

    def __post_init__(self) -> None:
        _check(bool(self.name), "name must not be empty")
        _check(self.gbps >= 0, "gbps must be >= 0")
        _check(self.latency_ms >= 0, "latency_ms must be >= 0")
        _check(0 <= self.jitter_ms <= self.latency_ms, "jitter_ms must be in [0, latency_ms]")
        _check(not (self.trace and self.gbps), "set either gbps or trace, not both")
        for i, step in enumerate(self.trace):
            _check(len(step) == 2, f"trace[{i}] must be [t_seconds, gbps]")
            _check(step[1] >= 0, f"trace[{i}]: gbps must be >= 0")
            _check(step[0] == 0 if i == 0 else step[0] > self.trace[i - 1][0],
                   "trace times must start at 0 and increase")
        _check(self.trace_period_s == 0 or (self.trace and self.trace_period_s > self.trace[-1][0]),
               "trace_period_s must be 0 or exceed the last trace time")

    @property
    def enabled(self) -> bool:
        return bool(self.gbps or self.trace or self.latency_ms)


@dataclass(frozen=True, slots=True)
class RegimeConfig:
    """The emulated WAN in the paper's regime, in decode steps (`[net.regime]`).

    An emulation on small hardware keeps the paper's ratios, not its bandwidth
    (docs/architecture.md, The regime PDD lives in).  When enabled, the embedded deployment
    measures MD's decode step s at start and, with b KV bytes per token, derives: bandwidth =
    b * tokens_per_step / s, one-way latency = rtt_steps * s / 2, P-MD budget = budget_steps * s
    (`deploy/regime.py`).  It fills the "wan" link only when that sets no gbps, latency_ms or
    trace; a multi-process deployment shapes its links as configured.
    """

    enabled: bool = True
    # Prompt tokens whose KV crosses the WAN per decode step: 70B (320 KiB/token)
    # at 10 Gbps with a 30 ms step moves ~115 (~1,150 at 100 Gbps).
    tokens_per_step: float = 115.0
    # WAN RTT in decode steps: ~30 ms over a ~30 ms step.
    rtt_steps: float = 1.0
    # The P-MD transfer budget in decode steps: the paper's 200 ms over 30 ms.
    budget_steps: float = 6.7
    # Decode step to derive from, ms; 0 = measure it at start (batch-1 decode,
    # median).  Fix it for runs that must see the same WAN on any machine.
    step_ms: float = 0.0

    def __post_init__(self) -> None:
        _check(self.tokens_per_step > 0, "tokens_per_step must be > 0")
        _check(self.rtt_steps >= 0, "rtt_steps must be >= 0")
        _check(self.budget_steps >= 0, "budget_steps must be >= 0")
        _check(self.step_ms >= 0, "step_ms must be >= 0")


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """TLS for node links (`wss://`) and, with `front_door`, the router's front door; PEM files.

    File paths may contain `{node}`, replaced by the name of the node the
    process runs (`pddgw serve --node NAME`), so one config serves every node
    with its own certificate (`pddgw keys DIR --config CFG` writes DIR/NAME.crt
    and DIR/NAME.key for each node).  Relative paths are relative to the
    directory the process starts in.
    """

    enabled: bool = False
    cert_file: str = ""        # this node's certificate chain
    key_file: str = ""
    ca_file: str = ""          # CA that signed the peers' certificates ("" = system store)
    mutual: bool = False       # servers demand and verify client certificates
    server_name: str = ""      # name to verify in the server certificate ("" = URL host)
    # Serve the router's front door (and the embedded deployment's) as https/wss
    # too, independent of `enabled`; clients are not asked for certificates.
    front_door: bool = False
    front_cert_file: str = ""  # "" = cert_file
    front_key_file: str = ""   # "" = key_file

    def __post_init__(self) -> None:
        if self.enabled:
            _check(bool(self.cert_file) == bool(self.key_file), "cert_file and key_file go together")
        if self.mutual:
            _check(self.enabled and bool(self.cert_file) and bool(self.ca_file),
                   "mutual TLS needs enabled, cert_file, key_file and ca_file")
        _check(bool(self.front_cert_file) == bool(self.front_key_file),
               "front_cert_file and front_key_file go together")
        if self.front_door:
            _check(bool(self.front_cert_file or self.cert_file),
                   "front_door needs front_cert_file and front_key_file (or cert_file and key_file)")

    def for_node(self, name: str) -> TlsConfig:
        """The paths with `{node}` replaced by `name`."""
        fields = ("cert_file", "key_file", "ca_file", "front_cert_file", "front_key_file")
        return dataclasses.replace(self, **{f: getattr(self, f).replace("{node}", name) for f in fields})

    def front_files(self) -> tuple[str, str, str, str]:
        """(key of the certificate, its path, key of the private key, its path) of the front door."""
        if self.front_cert_file:
            return "net.tls.front_cert_file", self.front_cert_file, "net.tls.front_key_file", self.front_key_file
        return "net.tls.cert_file", self.cert_file, "net.tls.key_file", self.key_file


@dataclass(frozen=True, slots=True)
class NetConfig:
    """Node links (pddgw.net): auth, limits, timeouts, striping, shaping."""

    # Shared deployment secret (>= 16 characters); WebSocket links refuse to run without one.
    secret: str = ""
    secret_file: str = ""      # read the secret from this file instead
    # Parallel connections per WebSocket link; bulk KV frames are striped over them.
    stripes: int = 1
    kv_frame_bytes: int = 1 << 20               # preferred KV chunk size for senders
    max_frame_bytes: int = 8 << 20              # largest frame accepted (KV chunks)
    max_control_bytes: int = 1 << 20            # largest frame of any other kind
    inbound_buffer_bytes: int = 64 << 20        # unread inbound bytes before reading pauses
    max_inflight_requests: int = 1024           # requests a link serves at once; more are refused "overloaded"
    connect_timeout_s: float = 5.0
    auth_timeout_s: float = 5.0
    request_timeout_s: float = 30.0
    send_timeout_s: float = 30.0               # per frame (send_all: each KV frame, not the batch)
    heartbeat_s: float = 2.0                    # 0 = no heartbeats
    dead_after_s: float = 10.0                  # silence after which a peer counts as dead
    reconnect_max_s: float = 2.0                # cap of the reconnect back-off
    tls: TlsConfig = field(default_factory=TlsConfig)
    # The "wan" entry of the default sets no figures of its own: the embedded
    # deployment derives them from its decode step ([net.regime]), since a fixed
    # Gbps value is only right for one model on one machine.
    links: tuple[ShapingConfig, ...] = (ShapingConfig(name="wan"),)
    regime: RegimeConfig = field(default_factory=RegimeConfig)

    def __post_init__(self) -> None:
        _check(not (self.secret and self.secret_file), "set secret or secret_file, not both")
        _check(not self.secret or len(self.secret) >= 16, "secret must have >= 16 characters")
        _check(1 <= self.stripes <= 16, "stripes must be in [1, 16]")
        _check(0 < self.kv_frame_bytes <= self.max_frame_bytes, "kv_frame_bytes must be in (0, max_frame_bytes]")
        _check(self.max_frame_bytes < 1 << 32, "max_frame_bytes must be < 4 GiB")
        _check(4096 <= self.max_control_bytes <= self.max_frame_bytes,
               "max_control_bytes must be in [4096, max_frame_bytes]")
        _check(self.inbound_buffer_bytes >= self.max_frame_bytes, "inbound_buffer_bytes must be >= max_frame_bytes")
        _check(self.max_inflight_requests >= 1, "max_inflight_requests must be >= 1")
        for name in ("connect_timeout_s", "auth_timeout_s", "request_timeout_s", "send_timeout_s",
                     "dead_after_s", "reconnect_max_s"):
            _check(getattr(self, name) > 0, f"{name} must be > 0")
        _check(self.heartbeat_s >= 0, "heartbeat_s must be >= 0")
        _check(self.heartbeat_s == 0 or self.dead_after_s > self.heartbeat_s, "dead_after_s must exceed heartbeat_s")
        names = [s.name for s in self.links]
        _check(len(names) == len(set(names)), "links: duplicate name")

    def shaping(self, name: str) -> ShapingConfig | None:
        """The shaping of link `name`, or None when it is not shaped."""
        for s in self.links:
            if s.name == name and s.enabled:
                return s
        return None

    def load_secret(self) -> str:
        """The deployment secret (reading `secret_file` if set); '' when none is configured."""
        if not self.secret_file:
            return self.secret
        try:
            secret = Path(self.secret_file).read_text().strip()
        except OSError as e:
            raise ConfigError(f"net.secret_file: cannot read {self.secret_file}: {e.strerror}") from None
        if len(secret) < 16:
            raise ConfigError("net.secret_file: secret must have >= 16 characters")
        return secret


@dataclass(frozen=True, slots=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    log: LogConfig = field(default_factory=LogConfig)
    net: NetConfig = field(default_factory=NetConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    # Empty: the embedded deployment, every role in one process.
    nodes: tuple[NodeConfig, ...] = ()

    def __post_init__(self) -> None:
        names = [n.name for n in self.nodes]
        dup = {n for n in names if names.count(n) > 1}
        _check(not dup, f"duplicate node name(s): {', '.join(sorted(dup))}")
        if self.nodes:
            roles = {n.role for n in self.nodes}
            _check(Role.PREFILL in roles, "nodes: no prefill node")
            _check(Role.RLD in roles or Role.MD in roles, "nodes: need at least one rld or md node")
            _check([n.role for n in self.nodes].count(Role.ROUTER) == 1, "nodes: exactly one router")

    def node(self, name: str) -> NodeConfig:
        for n in self.nodes:
            if n.name == name:
                return n
        raise ConfigError(f"nodes: no node named {name!r} (have: {', '.join(n.name for n in self.nodes)})")

    def engine_for(self, node: NodeConfig | None) -> EngineConfig:
        ecfg = node.engine if node is not None and node.engine is not None else self.engine
        if node is not None and node.relay and not ecfg.mixed_step_tokens:
            return dataclasses.replace(ecfg, mixed_step_tokens=RELAY_MIXED_STEP_TOKENS)
        return ecfg


def load_config(path: str | Path | None) -> Config:
    """Load and validate a config file; None gives the embedded default."""
    if path is None:
        return Config()
    return load_toml(path, Config)
