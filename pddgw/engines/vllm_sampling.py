"""pddgw's position-keyed sampling inside vLLM, as a vLLM logits processor.

vLLM's seeded generator advances once per sampled token, so a request that
moves between nodes or engines would change its tokens; pddgw's draw depends
only on (seed, position) (`pddgw.engines.sampler`).  For every row carrying
pddgw's parameters (`extra_args["pddgw"]`, set by `VllmEngine`) this runs
pddgw's sampler on the row's logits and leaves only the chosen token finite;
the request is greedy for vLLM, so vLLM takes exactly that token.  Other
rows are left alone.

Penalties, logit_bias, min_tokens and the grammar mask are applied here by
pddgw's `adjust_logits`, never by vLLM: vLLM's prompt includes the output
tokens given before (a handoff, a re-drive), and only this processor knows
how many (`given`), so they count as output as on every other engine.  Each
grammar row keeps a `Constraint` over the served model's vocabulary; one that
does not compile there admits only EOS.  vLLM's logprobs are of the raw
logits, so none of this shows in them.
"""

from __future__ import annotations

import threading
from dataclasses import fields
from typing import Any

import structlog
import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from pddgw.engines.grammar import Constraint, Grammars
from pddgw.engines.penalties import TokenHistory, adjust_logits
from pddgw.engines.sampler import sample_ids
from pddgw.engines.types import RequestError
from pddgw.core.sampling import SamplingParams

KEY = "pddgw"
log = structlog.get_logger(__name__)


def wanted(sp: SamplingParams) -> bool:
    """Whether this processor must pick the request's tokens (else vLLM's greedy pick is ours)."""
    return not sp.greedy or sp.adjusts_logits


def extra_args(sp: SamplingParams, given: int, eos: Any) -> dict[str, Any]:
    """What a vLLM request carries so that this processor samples it: every sampling field by
    name (rebuilt, and so validated, by SamplingParams), how many output tokens came before
    vLLM's first (its prompt's tail), and the model's EOS ids (for min_tokens)."""
    return {KEY: {"params": {f.name: getattr(sp, f.name) for f in fields(sp)}, "given": given,
                  "eos": sorted(eos)}}


class PositionKeyedSampling(LogitsProcessor):
    """See the module docstring."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool):
        # batch row -> (our parameters, output tokens before vLLM's, vLLM's prompt, vLLM's live
        # output list, EOS ids, the grammar's matcher or None)
        self._rows: dict[int, tuple[SamplingParams, int, list[int], list[int], tuple[int, ...],
                                    Constraint | None]] = {}
        model = getattr(getattr(vllm_config, "model_config", None), "model", None)
        self._model_path: str | None = model if isinstance(model, str) else None
        self._grammars: Grammars | None = None
        self._lock = threading.Lock()

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        return

    def is_argmax_invariant(self) -> bool:
        return False                 # it picks the token: it must run on greedy requests too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._rows, batch_update, self._new)

    def _new(self, params: Any, prompt: list[int] | None, outputs: list[int]):
        args = (params.extra_args or {}).get(KEY)
        if args is None:
            return None
        sp = SamplingParams(**args["params"])
        eos = tuple(args["eos"])
        return sp, args["given"], list(prompt or ()), outputs, eos, self._constraint(sp, eos)

    def grammars(self, eos: tuple[int, ...]) -> Grammars:
        """The served model's grammar compiler (built once, on the first grammar)."""
        with self._lock:
            if self._grammars is None:
                from pddgw.engines.weights import load_spec

                spec, tok = load_spec(self._model_path)
                self._grammars = Grammars(tok, spec.vocab_size, eos or spec.eos_token_ids)
            return self._grammars

    def _constraint(self, sp: SamplingParams, eos: tuple[int, ...]) -> Constraint | None:
        if sp.grammar is None:
            return None
        try:
            return self.grammars(eos).constraint(sp.grammar)
        except (RequestError, ValueError) as e:
            # Raising here would fail vLLM's whole step (every request in the batch).
            log.warning("vllm_grammar_refused", error=str(e)[:300])
            broken = Constraint(None, tuple(eos))
            broken.broken = True
            return broken

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._rows:
            return logits
        rows = sorted(self._rows)
        entries = [self._rows[i] for i in rows]
        params = [e[0] for e in entries]
        # The position being sampled = outputs before vLLM's + vLLM's so far (a live list).
        positions = [given + len(outs) for _, given, _, outs, _, _ in entries]
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        x = logits.index_select(0, index)                                                # [R, V]
        if any(p.adjusts_logits for p in params):
            # pddgw's tokens so far: vLLM's prompt is pddgw's prompt + the `given` outputs.
            hist = [TokenHistory(prompt + outs, len(prompt) - given) for _, given, prompt, outs, _, _ in entries]
            x = adjust_logits(x, params, positions, hist, entries[0][4], [e[5] for e in entries],
                              inplace=True)                                              # x is a copy
        ids = sample_ids(x, params, positions)                                           # [R]
        keep = torch.full((len(rows), logits.shape[1]), float("-inf"), dtype=logits.dtype,
                          device=logits.device)
        keep.scatter_(1, ids[:, None], 0.0)
        logits.index_copy_(0, index, keep)
        return logits
