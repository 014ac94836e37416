"""The single-node reference: what `pddgw generate --prompt-ids P --json` prints for a prompt.

Invariant 1 (docs/architecture.md, The five invariants) says every path streams exactly this.  Two ways
to get it, the same numbers:

* `generate_cli` / `generate_cli_many` run the command itself (one Python
  start per prompt: the yardstick the way a user would get it);
* `generate_engine` runs its code path in this process (default config, one
  engine per prompt, one request at a time), without the start-up per prompt.

float64 by default: with float32, batch composition can flip a near-tie and
show up as a difference that is not a bug.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Sequence

import orjson

Prompt = tuple[tuple[int, ...], int]        # (prompt ids, max tokens)


def generate_argv(prompt: Sequence[int], max_tokens: int, temperature: float = 0.0, seed: int = 0,
                  dtype: str = "float64") -> list[str]:
    return [sys.executable, "-m", "pddgw", "generate", "--model", "tiny", "--prompt-ids", ",".join(map(str, prompt)),
            "--max-tokens", str(max_tokens), "--dtype", dtype, "--temperature", str(temperature),
            "--seed", str(seed), "--json"]


def _token_ids(stdout: bytes) -> list[int]:
    return orjson.loads(stdout.splitlines()[-1])["token_ids"]


def generate_cli(prompt: Sequence[int], max_tokens: int, temperature: float = 0.0, seed: int = 0,
                 dtype: str = "float64", timeout_s: float = 120.0) -> list[int]:
    """`python -m pddgw generate ... --json` once -> its token ids (CalledProcessError on failure)."""
    out = subprocess.run(generate_argv(prompt, max_tokens, temperature, seed, dtype), capture_output=True,
                         check=True, timeout=timeout_s)
    return _token_ids(out.stdout)


async def generate_cli_many(prompts: Sequence[Prompt], dtype: str = "float64", jobs: int = 2,
                            temperature: float = 0.0, seed: int = 0) -> list[list[int]]:
    """`generate_cli` for each (prompt, max tokens), `jobs` processes at a time."""
    sem = asyncio.Semaphore(jobs)

    async def one(prompt: tuple[int, ...], n: int) -> list[int]:
        async with sem:
            p = await asyncio.create_subprocess_exec(*generate_argv(prompt, n, temperature, seed, dtype),
                                                     stdout=asyncio.subprocess.PIPE,
                                                     stderr=asyncio.subprocess.PIPE)
            stdout, stderr = await p.communicate()
            if p.returncode:
                raise RuntimeError(f"pddgw generate failed (rc {p.returncode}): {stderr.decode()[-2000:]}")
            return _token_ids(stdout)

    return list(await asyncio.gather(*(one(p, n) for p, n in prompts)))


def generate_engine(prompts: Sequence[Prompt], dtype: str = "float64", temperature: float = 0.0,
                    seed: int = 0) -> list[list[int]]:
    """What `generate_cli` gives for each (prompt, max tokens), by the same code path in this process.

    Blocking (model steps): call it off the event loop.
    """
    import torch      # here: the rest of the harness never loads a model

    from pddgw.config import Config, ModelConfig
    from pddgw.engines.base import create_engine
    from pddgw.core.sampling import SamplingParams
    from pddgw.engines.types import EngineRequest
    from pddgw.harness.engines import drain

    cfg = Config(model=ModelConfig(dtype=dtype))          # type: ignore[arg-type]
    with torch.inference_mode():
        return [drain(create_engine(cfg)[0], [EngineRequest("ref", prompt, SamplingParams(
            max_tokens=n, temperature=temperature, seed=seed))]).get("ref", []) for prompt, n in prompts]
