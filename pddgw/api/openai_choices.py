"""`n` and vLLM's `best_of`: a request's choices, their seeds, and which are returned.

Choice i is a router request of its own with the same prompt and seed
`choice_seed(seed, i)`: exactly a single request with that seed.  Of the
best_of generated, the n with the highest cumulative logprob are returned,
most likely first (ties to the lower index; greedy: the first n).  Usage
counts the prompt once and every generated choice's completion tokens.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pddgw.api.openai_format import ChatFormat, Format, Result
from pddgw.core.sampling import SEED_LIMIT, SamplingParams
from pddgw.core.tokens import TokenRun

if TYPE_CHECKING:
    from pddgw.api.door import OutputText


def choice_seed(seed: int, index: int) -> int:
    """Choice `index`'s seed: the request's seed + index (mod 2**63).  So choice i of a request
    with seed s samples exactly as a single request with seed s + i."""
    return (seed + index) % SEED_LIMIT


@dataclass(slots=True)
class Choice:
    """One of a request's best_of generated choices: its router request, its seed, its format, its text."""

    index: int
    rid: str
    sampling: SamplingParams
    fmt: Format
    text: OutputText
    runs: list[TokenRun] = field(default_factory=list)
    started: bool = False

    def head(self) -> list[bytes]:
        """The format's head events, before this choice's first (chat: its role chunk)."""
        if self.started:
            return []
        self.started = True
        return self.fmt.head()


def choices_usage(fmt: Format, results: list[Result]) -> dict[str, Any]:
    """Chat / completions usage over every choice: the prompt once, the completions summed (OpenAI's
    and vLLM's count); the prompt's cache hit is choice 0's."""
    if not isinstance(fmt, ChatFormat):
        return {}
    usage = fmt.usage(results[0])
    done = sum(len(r.out.output_ids) for r in results)
    usage.update(completion_tokens=done, total_tokens=usage["prompt_tokens"] + done)
    return usage


def _cumulative_logprob(res: Result) -> float:
    """A choice's rank for `best_of`: its kept tokens' summed log-probabilities (vLLM's cumulative
    logprob, of the model's raw distribution)."""
    if any(len(r.logprobs) != len(r.ids) for r in res.runs):
        # Asked for at prepare: a run without them would rank on a partial sum.
        raise RuntimeError("best_of: a choice's tokens came without their logprobs")
    return math.fsum(lp.logprob for r in res.runs for lp in r.logprobs)


def best_choices(choices: list[Choice], results: list[Result], n: int) -> list[tuple[Choice, Result]]:
    """The n returned of the best_of generated: the most likely first, ties to the lower
    generation index; greedy ones are all the same sequence (their sums may differ in the last
    bits with the batches they ran in), so the first n."""
    pairs = list(zip(choices, results))
    if len(pairs) == n or choices[0].sampling.greedy:
        return pairs[:n]
    return sorted(pairs, key=lambda p: (-_cumulative_logprob(p[1]), p[0].index))[:n]


def merged_body(bodies: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
    """best_of > 1: the first returned choice's object with every returned choice's (each carrying
    its own `pddgw` timeline) and the usage summed over every generated one."""
    return {**bodies[0], "choices": [{**b["choices"][0], "pddgw": b["pddgw"]} for b in bodies], "usage": usage}


async def run_all(coros: list[Coroutine[Any, Any, Result]]) -> list[Result]:
    """Every result, in order; one failing (or this being cancelled) cancels and awaits the others."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
