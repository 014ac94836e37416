"""The cost-model engine: a real model's *time* on modeled GPUs, no model math.

`engine.implementation = "costmodel"` with `model.profile` (a model shape name or config.json
path) and `engine.costmodel` (hardware and instance shape).  Everything but the forward pass
is the real `PagedEngine` (BlockManager, prefix cache, chunked prefill, preemption, KV
import/export bookkeeping).  The forward pass becomes:

* its duration: the roofline of the scheduled batch (`roofline`), via `step_seconds()`;
* its tokens: position i's token is drawn from the request's (seed, i) alone, uniform over
  the non-EOS ids, so outputs run to max_tokens and every node produces the same token for
  the same position (the same-output invariant holds on every path);
* its logprobs: those of that uniform distribution;
* its KV: exported chunks are `virtual` (full size, no data) in the profile's
  `wire_kv_layout`, so links, the router and the pool count the same bytes.  V4's fixed
  sliding window (`kv_window_bytes`) is held in the pool but not charged on links.

The pool is what the GPUs hold after the weights (`roofline.memory_fit`).  This module lives
in the sim layer so the engines package never imports the simulator; the engine registry
imports it lazily.  Model and assumptions: docs/simulator.md.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pddgw.config import Config, ConfigError, CostModelConfig, EngineConfig, ModelConfig
from pddgw.engines.base import register_engine
from pddgw.engines.model_spec import ModelSpec
from pddgw.engines.paged import PagedEngine, Sampled
from pddgw.engines.sampler import position_uniforms
from pddgw.engines.scheduler import Chunk
from pddgw.engines.sequence import Sequence
from pddgw.engines.tokenizer import ByteTokenizer
from pddgw.core.tokens import TokenLogprobs
from pddgw.engines.types import MAX_LOGPROBS, KVChunk, RequestOutput
from pddgw.sim import profiles
from pddgw.sim.roofline import Parallel, SeqWork, StepCost, decode_step_cost, max_kv_tokens, step_cost

_NO_DATA = memoryview(b"")
# Output positions drawn in one go (`_draws`): a request's whole answer as a rule (none past its
# max_tokens).  Drawing 1,024 in one vector call costs what ~100 draws one at a time did: an
# answer of 1,024 tokens draws ~9 x faster.
_DRAW_MAX = 4096
# Requests whose draws are kept; beyond, they are dropped (and drawn again where needed): a
# safeguard for requests that end before their last token (aborted, handed off); a request's
# entry goes once its last token is drawn.
_DRAWN_MAX = 1 << 14


def kv_dtype(profile: profiles.ModelProfile) -> str:
    """The dtype KV chunks name on links: BF16, the element of every `wire_kv_layout`
    (FP8 KV is carried by a layout of half the width)."""
    return "bfloat16"


def parallel(cm: CostModelConfig) -> Parallel:
    """The instance shape an engine.costmodel section configures."""
    return Parallel(tp=cm.tensor_parallel, dp=cm.data_parallel, ep=cm.expert_parallel,
                    gpus_per_node=cm.gpus_per_node)


def model_profile(model: ModelConfig) -> profiles.ModelProfile:
    """The configured model shape; ConfigError naming the key when it is missing or unknown."""
    if not model.profile:
        raise ConfigError("model.profile: the cost-model engine needs a model shape "
                          f"(one of: {', '.join(sorted(profiles.MODELS))})")
    try:
        return profiles.model(model.profile)
    except KeyError as e:
        raise ConfigError(f"model.profile: {e.args[0]}") from None


@register_engine("costmodel")
class CostModelEngine(PagedEngine):
    runs_inline = True
    virtual_kv = True

    @classmethod
    def spec_for(cls, model: ModelConfig) -> tuple[ModelSpec, ByteTokenizer, str]:
        """`weights.load_spec_for` of a `model.profile`: the shape's spec, a byte tokenizer and
        the KV dtype its chunks name on links."""
        prof = model_profile(model)
        spec = prof.to_spec()
        return spec, ByteTokenizer(spec.vocab_size), kv_dtype(prof)

    def __init__(self, profile: profiles.ModelProfile, hardware: profiles.HardwareProfile, cfg: EngineConfig,
                 max_model_len: int = 0):
        cm = cfg.costmodel
        self.profile = profile
        self.hardware = hardware
        try:
            self.parallel = parallel(cm)
        except ValueError as e:
            raise ConfigError(f"engine.costmodel: {e}") from None
        self.tp = self.parallel.tp
        num_blocks = cfg.num_blocks
        if not num_blocks:
            try:
                num_blocks = max_kv_tokens(profile, hardware, self.parallel, cm.gpu_memory_utilization,
                                           cfg.max_num_seqs * cfg.dp_ranks) // cfg.block_size
            except ValueError as e:
                raise ConfigError(f"engine.costmodel: {e}") from None
            if num_blocks < 1:
                raise ConfigError(f"engine.costmodel: {profile.name} on {self.parallel.gpus} x {hardware.name} "
                                  "leaves no memory for KV blocks")
        super().__init__(profile.to_spec(), cfg, kv_dtype(profile), num_blocks, max_model_len)
        self._eos_sorted = sorted(t for t in set(self.spec.eos_token_ids) if 0 <= t < self.spec.vocab_size)
        self._non_eos = self.spec.vocab_size - len(self._eos_sorted)
        # Request -> (output position of its first token, the tokens drawn from there); by request,
        # not seed: requests that share a seed (a client's fixed one) decode side by side.
        self._drawn: dict[str, tuple[int, list[int]]] = {}
        # The token distribution is uniform over the non-EOS ids: its log-probabilities.
        eos = set(self._eos_sorted)
        self._uniform_logprob = -math.log(self.spec.vocab_size - len(eos))
        self._top_ids = tuple(t for t in range(min(self.spec.vocab_size, MAX_LOGPROBS + len(eos)))
                              if t not in eos)[:MAX_LOGPROBS]
        self.last_cost: StepCost | None = None
        self.busy_s = 0.0          # modeled seconds spent in forward passes

    @classmethod
    def from_config(cls, config: Config, engine: EngineConfig | None = None,
                    models: Any = None) -> tuple[CostModelEngine, ByteTokenizer]:
        """`models` is not used: a cost model has no weights."""
        ecfg = engine or config.engine
        prof = model_profile(config.model)
        try:
            hw = profiles.hardware(ecfg.costmodel.hardware)
        except KeyError as e:
            raise ConfigError(f"engine.costmodel.hardware: {e.args[0]}") from None
        prof = profiles.as_run(prof, hw, ecfg.costmodel.fp4_on_non_native)
        eng = cls(prof, hw, ecfg, config.model.max_model_len)
        return eng, ByteTokenizer(eng.spec.vocab_size)

    # ---- time -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.last_cost = None
        return super().step()

    def _decode_step(self, outputs: list[RequestOutput]) -> bool:
        """A step of one decode token of every running sequence (most of a simulation's steps)
        in one pass over them, without a Chunk, a SeqWork or a sampled entry each: the same
        tokens, outputs and cost as the general step."""
        seqs = None if self._scoring else self.scheduler.decodes()
        if seqs is None:
            return False
        bs = self.blocks.block_size
        drawn = self._drawn
        lengths = []                          # each sequence's, with this step's token
        for seq in seqs:
            computed = seq.num_computed
            tokens = seq.tokens
            position = len(tokens) - seq.num_prompt
            got = drawn.get(seq.request_id)
            # The common token inline: drawn already, not its run's last, no logprobs asked for.
            if got is not None and 0 <= position - got[0] < len(got[1]) - 1 and seq.sampling.logprobs is None:
                token, lp = got[1][position - got[0]], None
            else:
                token, lp = self._sample(seq)
            seq.num_computed = computed = computed + 1
            lengths.append(computed)
            if computed // bs > seq.num_published:
                self._publish(seq)
            mark = seq.out_mark
            if (lp is None and mark >= 0 and position + 1 - mark < seq.out_every and position + 1 < seq.out_limit
                    and token not in seq.stops):
                tokens.append(token)          # held for its run: what `_sampled` does then
                self._held = True
            else:
                self._sampled(seq, token, lp, outputs)
        self.last_cost = decode_step_cost(self.profile, self.hardware, self.parallel, lengths)
        self.busy_s += self.last_cost.seconds
        return True

    def step_seconds(self) -> float:
        return self.last_cost.seconds if self.last_cost is not None else 0.0

    def _forward(self, chunks: list[Chunk]) -> dict[str, Sampled]:
        work = []
        out: dict[str, Sampled] = {}
        for c in chunks:
            seq = c.seq
            computed = seq.num_computed
            # Context before this step's tokens: what attention reads besides them.
            work.append(SeqWork(c.num_tokens, computed))
            if computed + c.num_tokens == len(seq.tokens) and not seq.hold:      # `_to_sample`
                out[seq.request_id] = self._sample(seq)
        self.last_cost = step_cost(self.profile, self.hardware, self.parallel, work)
        self.busy_s += self.last_cost.seconds
        return out

    def _sample(self, seq: Sequence) -> Sampled:
        """The token (and logprobs, if asked for) of seq's next output position."""
        position = len(seq.tokens) - seq.num_prompt
        drawn = self._drawn
        got = drawn.get(seq.request_id)
        if got is None or not 0 <= position - got[0] < len(got[1]):
            got = self._draws(seq.request_id, seq.sampling.seed, position, seq.out_limit)
        i = position - got[0]
        if i + 1 == len(got[1]):
            del drawn[seq.request_id]        # its last token (as a rule, the answer's)
        k = seq.sampling.logprobs
        return got[1][i], None if k is None else self._logprobs(k)

    def _logprobs(self, k: int | None) -> TokenLogprobs | None:
        """The uniform distribution's logprobs, None when not asked for: every token's is
        -log(vocab - #EOS), the top alternatives the lowest non-EOS ids.
        """
        if k is None:
            return None
        top = self._top_ids[:k]
        return TokenLogprobs(self._uniform_logprob, top, (self._uniform_logprob,) * len(top))

    def token_at(self, seed: int, position: int) -> int:
        """The token of output position `position`: uniform over the non-EOS ids, from (seed, position)."""
        return self._tokens(seed, position, 1)[0]

    def _draws(self, rid: str, seed: int, position: int, limit: int) -> tuple[int, list[int]]:
        """Draw the tokens of output positions [position, limit) (at most _DRAW_MAX) in one go,
        and keep them: -> (position, the tokens)."""
        if len(self._drawn) >= _DRAWN_MAX:
            self._drawn.clear()
        got = self._drawn[rid] = (position, self._tokens(seed, position, max(1, min(limit - position, _DRAW_MAX))))
        return got

    def _tokens(self, seed: int, position: int, n: int) -> list[int]:
        """`token_at` of the positions [position, position + n), in one vector call."""
        u = position_uniforms(torch.full((n,), seed, dtype=torch.int64), torch.arange(position, position + n))
        k = (u * self._non_eos).to(torch.int64)                                             # [n]
        for e in self._eos_sorted:           # the k-th id that is not an EOS id (EOS ids are few, sorted)
            k += k >= e
        return k.tolist()

    # ---- KV: sized, never stored ---------------------------------------------------------
    def _export(self, seq: Sequence, token_start: int, token_end: int, layer_start: int,
                layer_end: int) -> KVChunk:
        return KVChunk(self._layout.span(seq.request_id, (token_start, token_end), (layer_start, layer_end),
                                         virtual=True), _NO_DATA)

    def _import(self, seq: Sequence, chunk: KVChunk, start: int) -> None:
        """Nothing to write: the blocks stand for the KV once the chunk has arrived."""
