"""pddgw's position-keyed sampling inside vLLM, as a vLLM logits processor.

vLLM draws a seeded request's tokens from a per-request generator that
advances once per sampled token, so the token at output position i depends
on how many tokens that engine sampled before: a request that moves between
nodes (a handoff) or between engines would change its tokens.  pddgw's draw
depends only on (seed, position) (`pddgw.engines.sampler`).  This processor
makes vLLM sample that way: for every row that carries pddgw's sampling
parameters (`extra_args["pddgw"]`, set by `VllmEngine`), it runs pddgw's own
sampler on the row's logits and leaves only the chosen token finite; the
request is greedy for vLLM (temperature 0), so vLLM takes exactly that
token.  Rows without the key (greedy requests) are left alone.

vLLM computes logprobs from the raw logits, before any logits processor,
so what this does to the logits does not show in them.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from pddgw.engines.sampler import sample_ids
from pddgw.engines.types import SamplingParams

KEY = "pddgw"


def extra_args(sp: SamplingParams, given: int) -> dict[str, Any]:
    """What a vLLM request carries so that this processor samples it: the parameters of the
    draw, and how many output tokens came before vLLM's first (its prompt's tail)."""
    return {KEY: [sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.seed, given]}


class PositionKeyedSampling(LogitsProcessor):
    """See the module docstring."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool):
        # batch row -> (our parameters, output tokens before vLLM's, vLLM's live output list)
        self._rows: dict[int, tuple[SamplingParams, int, list[int]]] = {}

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        return

    def is_argmax_invariant(self) -> bool:
        return False                 # it picks the token: it must run on greedy requests too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._rows, batch_update, self._new)

    @staticmethod
    def _new(params: Any, prompt: list[int] | None, outputs: list[int]):
        args = (params.extra_args or {}).get(KEY)
        if args is None:
            return None
        temperature, top_k, top_p, min_p, seed, given = args
        return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed), \
            given, outputs

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._rows:
            return logits
        rows = sorted(self._rows)
        params = [self._rows[i][0] for i in rows]
        # The position being sampled = outputs before vLLM's + vLLM's so far (a live list).
        positions = [self._rows[i][1] + len(self._rows[i][2]) for i in rows]
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        ids = sample_ids(logits.index_select(0, index), params, positions)          # [R]
        keep = torch.full((len(rows), logits.shape[1]), float("-inf"), dtype=logits.dtype,
                          device=logits.device)
        keep.scatter_(1, ids[:, None], 0.0)
        logits.index_copy_(0, index, keep)
        return logits
