"""The router's decisions, as pure functions of their inputs.

Every decision returns a frozen result that carries its inputs and a reason
tag, and `as_log()` flattens it for one structured log line, so a surprising
choice can be replayed from the log alone.  Only `SingularLimiter` keeps
state (a token bucket, no clock).  The decisions: the pipeline
(`choose_pipeline`), the MD by prefix affinity (`pick_cached`), the handoff
mode (`choose_handoff_mode`) and each catch-up round (`plan_handoff_round`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from pddgw.config import PolicyConfig
from pddgw.core.roles import Pipeline, Role
from pddgw.pipeline.state import HandoffMode

__all__ = [
    "PolicyConfig", "InstanceLoad", "InstanceChoice", "NoInstanceError", "pick_instance", "pick_cached",
    "PipelineInputs", "PipelineDecision", "relay_pressure", "estimate_transfer_ms", "is_singular_candidate",
    "choose_pipeline", "SingularLimiter", "decide_pipeline",
    "HandoffInputs", "HandoffModeDecision", "choose_handoff_mode",
    "HandoffChunk", "plan_handoff_round",
]


class NoInstanceError(RuntimeError):
    """No healthy instance can serve the request."""


# --------------------------------------------------------------------------
# Loads and instance selection


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """The policy's view of one instance's load: its last `messages.LoadReport` (what the
    node says) joined with what the router knows (role, sequence slots, health)."""

    instance: str
    role: Role
    running: int
    waiting: int
    max_num_seqs: int
    kv_blocks_used: int
    kv_blocks_total: int
    healthy: bool = True

    def __post_init__(self) -> None:
        if self.running < 0 or self.waiting < 0:
            raise ValueError("running and waiting must be >= 0")
        if self.max_num_seqs < 1 or self.kv_blocks_total < 1:
            raise ValueError("max_num_seqs and kv_blocks_total must be >= 1")
        if not 0 <= self.kv_blocks_used <= self.kv_blocks_total:
            raise ValueError("kv_blocks_used must be in [0, kv_blocks_total]")

    @property
    def load(self) -> float:
        """max(sequence slots asked for, KV blocks used) as a fraction of capacity.

        Waiting sequences count, so a queueing instance reads above 1.0.
        """
        return max((self.running + self.waiting) / self.max_num_seqs,
                   self.kv_blocks_used / self.kv_blocks_total)


@dataclass(frozen=True, slots=True)
class InstanceChoice:
    instance: str
    role: Role
    load: float
    # (instance, load) of every eligible candidate, and the ones left out.
    candidates: tuple[tuple[str, float], ...]
    excluded: tuple[str, ...]

    def as_log(self) -> dict[str, object]:
        return {"decision": "instance", "role": self.role, "instance": self.instance,
                "load": self.load, "candidates": [list(c) for c in self.candidates],
                "excluded": list(self.excluded)}


def pick_instance(reports: Iterable[InstanceLoad], role: Role,
                  exclude: Iterable[str] = ()) -> InstanceChoice | None:
    """The least-loaded healthy instance of `role`, or None if there is none.

    `exclude` names instances that already failed this request (re-drives).
    Ties go to fewer running + waiting sequences, then the smaller name, so the
    choice is deterministic.
    """
    skip = frozenset(exclude)
    eligible: list[InstanceLoad] = []
    excluded: list[str] = []
    for r in reports:
        if r.role != role:
            continue
        if not r.healthy or r.instance in skip:
            excluded.append(r.instance)
        else:
            eligible.append(r)
    if not eligible:
        return None
    best = min(eligible, key=lambda r: (r.load, r.running + r.waiting, r.instance))
    return InstanceChoice(best.instance, role, best.load,
                          tuple((r.instance, r.load) for r in eligible), tuple(sorted(excluded)))


def pick_cached(reports: Sequence[InstanceLoad], held: Mapping[str, int], prompt_tokens: int,
                cfg: PolicyConfig) -> str | None:
    """The instance to open on for its cached prefix (among those below `affinity_max_load`,
    all when none is), so a conversation's later turns stay where their KV is; None when no one
    holds `affinity_min_match` of the prompt (the caller takes the least loaded).  `held`:
    prompt tokens each instance is remembered to hold.  Ties: the less loaded, then the name."""
    roomy = [r for r in reports if r.load < cfg.affinity_max_load] or list(reports)
    best = min(roomy, key=lambda r: (-held.get(r.instance, 0), r.load, r.instance), default=None)
    if best is None or held.get(best.instance, 0) < cfg.affinity_min_match * prompt_tokens:
        return None
    return best.instance


def prefill_wait_tokens(backlog: int, dp_ranks: int, uncached: int) -> float:
    """How long a P makes a request wait for its first token, in prompt tokens of one rank: the
    tokens queued ahead of it spread over the instance's attention-DP ranks (each computes its
    own sequences' chunks in the same steps), then its own uncached tokens, which chunk on one
    rank.  Why per rank: counted whole, a DP16 P holding a follow-up's prefix looked slower
    than recomputing it elsewhere (measured first tokens: ~5 s instead of ~0.2 s)."""
    return backlog / max(1, dp_ranks) + uncached


# --------------------------------------------------------------------------
# Pipeline choice


PipelineReason = Literal["md_unavailable", "rld_unavailable", "forced", "singular",
                         "fits_budget", "rld_full", "md_busy", "transfer_over_budget"]


@dataclass(frozen=True, slots=True)
class PipelineInputs:
    prompt_tokens: int
    block_size: int
    # MD's authoritative prefix hit, in full blocks from the start of the prompt.
    md_hit_blocks: int
    # (blocks of the prompt not on MD) x bytes per block: what P sends MD.
    missing_kv_bytes: int
    max_output_tokens: int
    # The WAN link's current estimate (estimator.LinkEstimate).
    bandwidth_bytes_per_s: float
    rtt_ms: float
    # RLD's relay pressure if it took this request (`relay_pressure`; > 1 = no
    # room) and MD's load; None = no healthy instance of that role.
    rld_load: float | None
    md_load: float | None
    # Foreground KV bytes of other requests queued on the WAN ahead of this one
    # (background alignments yield to it and do not count).
    wan_backlog_bytes: int = 0

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.block_size < 1:
            raise ValueError("prompt_tokens and block_size must be >= 1")
        if not 0 <= self.md_hit_blocks <= self.prompt_blocks:
            raise ValueError(f"md_hit_blocks {self.md_hit_blocks} not in [0, {self.prompt_blocks}]")
        if self.missing_kv_bytes < 0 or self.max_output_tokens < 0 or self.wan_backlog_bytes < 0:
            raise ValueError("missing_kv_bytes, max_output_tokens and wan_backlog_bytes must be >= 0")
        if self.bandwidth_bytes_per_s <= 0 or self.rtt_ms < 0:
            raise ValueError("bandwidth must be > 0 and rtt_ms >= 0")

    @property
    def prompt_blocks(self) -> int:
        return -(-self.prompt_tokens // self.block_size)

    @property
    def missing_tokens(self) -> int:
        """Prompt tokens whose KV MD lacks (P computes them for MD)."""
        return max(0, self.prompt_tokens - self.md_hit_blocks * self.block_size)


@dataclass(frozen=True, slots=True)
class PipelineDecision:
    pipeline: Pipeline
    reason: PipelineReason
    # Estimated WAN time of the missing KV, and the P-MD budget it was held to.
    transfer_ms: float
    budget_ms: float
    singular_candidate: bool
    singular_allowed: bool
    inputs: PipelineInputs

    def as_log(self) -> dict[str, object]:
        i = self.inputs
        return {
            "decision": "pipeline", "pipeline": self.pipeline, "reason": self.reason,
            "transfer_ms": round(self.transfer_ms, 3), "budget_ms": self.budget_ms,
            "singular_candidate": self.singular_candidate,
            "singular_allowed": self.singular_allowed,
            "prompt_tokens": i.prompt_tokens, "prompt_blocks": i.prompt_blocks,
            "block_size": i.block_size, "md_hit_blocks": i.md_hit_blocks,
            "missing_tokens": i.missing_tokens, "missing_kv_bytes": i.missing_kv_bytes,
            "max_output_tokens": i.max_output_tokens,
            "bandwidth_bytes_per_s": i.bandwidth_bytes_per_s, "rtt_ms": i.rtt_ms,
            "rld_load": i.rld_load, "md_load": i.md_load, "wan_backlog_bytes": i.wan_backlog_bytes,
        }


def relay_pressure(relays: int, relay_tokens: int, kv_tokens: int, cfg: PolicyConfig) -> float:
    """An RLD instance's fill as a relay: max(relays / `rld_max_relays`,
    prompt tokens relayed / its KV share); `kv_tokens` 0 = pool size unknown yet."""
    kv = relay_tokens / (cfg.rld_max_kv_share * kv_tokens) if kv_tokens else 0.0
    return max(relays / cfg.rld_max_relays, kv)


def estimate_transfer_ms(nbytes: int, bandwidth_bytes_per_s: float, rtt_ms: float) -> float:
    """Time for `nbytes` to land on the far side: one-way latency + serialisation."""
    return rtt_ms / 2.0 + nbytes * 1000.0 / bandwidth_bytes_per_s


def is_singular_candidate(inputs: PipelineInputs, cfg: PolicyConfig) -> bool:
    """Long uncached input, short output: RLD could finish it alone."""
    return (cfg.singular_max_share > 0
            and inputs.missing_tokens >= cfg.singular_min_uncached_tokens
            and inputs.max_output_tokens <= cfg.singular_max_output_tokens)


def choose_pipeline(inputs: PipelineInputs, cfg: PolicyConfig, *,
                    singular_allowed: bool = True) -> PipelineDecision:
    """The pipeline, first matching rule wins.  `singular_allowed`: the rate cap's say.

    1. no healthy MD -> "P-RLD"; no healthy RLD -> "P-MD"; neither -> NoInstanceError.
    2. `cfg.pipeline` not "auto" -> that pipeline (forced).
    3. singular traffic (many prompt tokens missing on MD, few output tokens, RLD has room,
       the limiter has credit) -> "P-RLD".
    4. the missing KV crosses the WAN within `p_md_max_transfer_ms` (behind the foreground
       bytes queued) and MD is below `md_busy_load` -> "P-MD" (fits_budget).
    5. RLD has no room for one more relay -> "P-MD" (rld_full).
    6. the transfer fits but MD is busy -> "P-RLD-MD" (md_busy).
    7. otherwise -> "P-RLD-MD" (transfer_over_budget).
    """
    # This request's KV lands after the foreground bytes queued ahead of it.
    transfer = estimate_transfer_ms(inputs.missing_kv_bytes + inputs.wan_backlog_bytes,
                                    inputs.bandwidth_bytes_per_s, inputs.rtt_ms)
    candidate = is_singular_candidate(inputs, cfg)

    def out(pipeline: Pipeline, reason: PipelineReason) -> PipelineDecision:
        return PipelineDecision(pipeline, reason, transfer, cfg.p_md_max_transfer_ms,
                                candidate, singular_allowed, inputs)

    if inputs.md_load is None and inputs.rld_load is None:
        raise NoInstanceError("no healthy MD and no healthy RLD")
    if inputs.md_load is None:
        return out(Pipeline.P_RLD, "md_unavailable")
    if inputs.rld_load is None:
        return out(Pipeline.P_MD, "rld_unavailable")
    if cfg.pipeline != "auto":
        return out(cfg.pipeline, "forced")
    rld_room = inputs.rld_load <= 1.0
    if candidate and rld_room and singular_allowed:
        return out(Pipeline.P_RLD, "singular")
    fits = transfer <= cfg.p_md_max_transfer_ms
    if fits and inputs.md_load < cfg.md_busy_load:
        return out(Pipeline.P_MD, "fits_budget")
    if not rld_room:
        return out(Pipeline.P_MD, "rld_full")
    return out(Pipeline.P_RLD_MD, "md_busy" if fits else "transfer_over_budget")


class SingularLimiter:
    """Token bucket capping the share of requests routed "P-RLD" as singular.

    Every request routed adds `max_share` credit (capped at `burst`, the
    starting credit); a singular admission spends 1.  Over any run of N
    requests at most `max_share * N + burst` are admitted.
    """

    def __init__(self, max_share: float, burst: float) -> None:
        if not 0.0 <= max_share <= 1.0 or burst < 1.0:
            raise ValueError("max_share must be in [0, 1] and burst >= 1")
        self.max_share = max_share
        self.burst = burst
        self.credit = burst if max_share > 0 else 0.0
        self.requests = 0
        self.admitted = 0

    @classmethod
    def from_config(cls, cfg: PolicyConfig) -> SingularLimiter:
        return cls(cfg.singular_max_share, cfg.singular_burst)

    def observe_request(self) -> None:
        self.requests += 1
        self.credit = min(self.burst, self.credit + self.max_share)

    @property
    def available(self) -> bool:
        # Tolerance: 20 x 0.05 must make a whole credit despite float rounding.
        return self.credit >= 1.0 - 1e-9

    def take(self) -> None:
        if not self.available:
            raise RuntimeError("singular limiter has no credit")
        self.credit = max(0.0, self.credit - 1.0)
        self.admitted += 1


def decide_pipeline(inputs: PipelineInputs, cfg: PolicyConfig,
                    limiter: SingularLimiter) -> PipelineDecision:
    """`choose_pipeline` with the rate cap applied and charged (one call per request)."""
    limiter.observe_request()
    decision = choose_pipeline(inputs, cfg, singular_allowed=limiter.available)
    if decision.reason == "singular":
        limiter.take()
    return decision


# --------------------------------------------------------------------------
# Handoff mode and catch-up rounds


HandoffReason = Literal["forced", "rld_loaded", "md_loaded", "both_loaded", "default"]


@dataclass(frozen=True, slots=True)
class HandoffInputs:
    # Tokens RLD generated when MD became ready (for the log; rounds re-plan).
    generated: int
    rld_load: float
    md_load: float


@dataclass(frozen=True, slots=True)
class HandoffModeDecision:
    mode: HandoffMode
    # Catch-up threshold for `plan_handoff_round` (ignored by one-shot).
    threshold: int
    reason: HandoffReason
    inputs: HandoffInputs

    def as_log(self) -> dict[str, object]:
        i = self.inputs
        return {"decision": "handoff_mode", "mode": self.mode, "threshold": self.threshold,
                "reason": self.reason, "generated": i.generated,
                "rld_load": i.rld_load, "md_load": i.md_load}


def choose_handoff_mode(inputs: HandoffInputs, cfg: PolicyConfig) -> HandoffModeDecision:
    """A loaded RLD prefers one-shot (released soonest), a loaded MD catch-up with the smaller
    `catchup_threshold_md_loaded`; both loaded: the heavier side decides; neither: catch-up
    with `catchup_threshold` (a plain one-shot when fewer tokens were generated)."""
    md_loaded = inputs.md_load >= cfg.handoff_md_loaded
    rld_loaded = inputs.rld_load >= cfg.handoff_rld_loaded
    threshold = cfg.catchup_threshold_md_loaded if md_loaded else cfg.catchup_threshold
    if cfg.handoff_mode != "auto":
        return HandoffModeDecision(cfg.handoff_mode, threshold, "forced", inputs)
    if rld_loaded and md_loaded:
        # Ties release RLD: RLD is the small, scarce pool.
        mode: HandoffMode = "one-shot" if inputs.rld_load >= inputs.md_load else "catch-up"
        return HandoffModeDecision(mode, threshold, "both_loaded", inputs)
    if rld_loaded:
        return HandoffModeDecision("one-shot", threshold, "rld_loaded", inputs)
    if md_loaded:
        return HandoffModeDecision("catch-up", threshold, "md_loaded", inputs)
    return HandoffModeDecision("catch-up", threshold, "default", inputs)


ChunkReason = Literal["one-shot", "under_threshold", "max_rounds", "no_convergence", "catch-up"]


@dataclass(frozen=True, slots=True)
class HandoffChunk:
    """Send output positions [start, end) to MD now; `final`: RLD stops at `end`."""

    start: int
    end: int
    final: bool
    reason: ChunkReason
    generated: int
    rounds_done: int
    mode: HandoffMode
    threshold: int
    # RLD's tokens per round trip the plan assumed.
    per_round: float = 0.0

    @property
    def count(self) -> int:
        return self.end - self.start

    def as_log(self) -> dict[str, object]:
        return {"decision": "handoff_round", "start": self.start, "end": self.end,
                "final": self.final, "reason": self.reason, "generated": self.generated,
                "rounds_done": self.rounds_done, "mode": self.mode, "threshold": self.threshold,
                "per_round": round(self.per_round, 2)}


def plan_handoff_round(*, generated: int, sent: int, rounds_done: int, mode: HandoffMode,
                       threshold: int, max_chunk: int, max_rounds: int,
                       per_round: float = 0.0, forced: bool = False) -> HandoffChunk:
    """The next handoff round, given g=`generated` tokens of which `sent` went already.

    `per_round`: tokens RLD makes while one round is in flight (its measured
    tokens per round trip), i.e. what will be unsent when the round is acked.

    one-shot: everything unsent, final.  catch-up: final when fewer than
    `threshold` remain or `max_rounds` non-final rounds were done, or when
    RLD makes `threshold` or more tokens per round (catch-up would never
    converge: one-shot now; not when catch-up was `forced` by the operator,
    whose rounds end at `max_rounds`).  Otherwise a non-final chunk of the unsent
    tokens, at most `max_chunk` unless the cap would leave the next round
    non-final: sized so that what is left after this round (unsent + made
    meanwhile) is under the threshold, hence the next round is the last.
    """
    if not 0 <= sent <= generated:
        raise ValueError(f"need 0 <= sent ({sent}) <= generated ({generated})")
    if threshold < 1 or max_chunk < threshold or max_rounds < 1 or rounds_done < 0 or per_round < 0:
        raise ValueError("need threshold >= 1, max_chunk >= threshold, max_rounds >= 1, "
                         "rounds_done >= 0, per_round >= 0")

    def out(end: int, final: bool, reason: ChunkReason) -> HandoffChunk:
        return HandoffChunk(sent, end, final, reason, generated, rounds_done, mode, threshold, per_round)

    if mode == "one-shot":
        return out(generated, True, "one-shot")
    remainder = generated - sent
    if remainder < threshold:
        return out(generated, True, "under_threshold")
    if rounds_done >= max_rounds:
        return out(generated, True, "max_rounds")
    if per_round >= threshold and not forced:
        return out(generated, True, "no_convergence")
    # Left after this round = remainder - chunk + per_round; < threshold needs:
    converging = remainder - threshold + math.floor(per_round) + 1
    return out(sent + min(remainder, max(max_chunk, converging)), False, "catch-up")
