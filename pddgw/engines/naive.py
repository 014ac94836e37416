"""The obviously-correct generator the engine is tested against.

No KV cache, no paging, no batching: every step recomputes the whole sequence
with dense causal attention (`LlamaModel.forward_dense`) and takes the argmax
of the last row.  Quadratic per step on purpose; use it only on short
sequences.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pddgw.engines.model import LlamaModel


def naive_greedy(model: LlamaModel, prompt_ids: list[int], max_tokens: int,
                 stop_ids: Iterable[int] = ()) -> list[int]:
    """Greedy continuation of `prompt_ids`: up to `max_tokens` new ids.

    Generation stops after emitting an id in `stop_ids`; that id is included
    as the last element.  Ties in the argmax go to the lowest id.
    """
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    stops = set(stop_ids)
    seq = list(prompt_ids)
    out: list[int] = []
    for _ in range(max_tokens):
        ids = torch.tensor(seq, dtype=torch.int64, device=model.device)
        logits = model.forward_dense(ids)[-1]                  # [vocab]
        tok = int(torch.argmax(logits))
        out.append(tok)
        seq.append(tok)
        if tok in stops:
            break
    return out
