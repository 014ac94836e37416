"""Engines driven in this process, for the benchmarks that measure one and their tests.

`patched` swaps a module's function for a wrapper of it for a while (the
engine looks its functions up at call time, so timers and logit captures
see every call).  torch is imported inside the functions: most users of the
harness never load it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any, TypeVar

from pddgw.config import EngineConfig
from pddgw.engines.base import Engine
from pddgw.engines.types import EngineRequest, SamplingParams

BLOCK_SIZE = 16      # the engine benchmarks' KV block (tokens)
T = TypeVar("T")


def add_torch_args(parser: argparse.ArgumentParser, device_help: str = "cpu or cuda[:N]") -> None:
    """--threads and --device, for the benchmarks that run torch (then `parse_torch_args`)."""
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: as is)")
    parser.add_argument("--device", default="cpu", help=device_help)


def chosen_settings(args: argparse.Namespace, quick: T, full: T, **flags: Any) -> T:
    """--quick's settings or the full ones, with the fields of the flags given (non-zero) replaced."""
    return dataclasses.replace(quick if args.quick else full, **{k: v for k, v in flags.items() if v})


def parse_torch_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
                     nonnegative: Sequence[str] = ("threads",)) -> argparse.Namespace:
    """Parse; refuse negative `nonnegative` counts and unseen CUDA; set torch's threads if given."""
    import torch

    args = parser.parse_args(argv)
    if any(getattr(args, n) < 0 for n in nonnegative):
        flags = [f"--{n.replace('_', '-')}" for n in nonnegative]
        parser.error(" and ".join(filter(None, (", ".join(flags[:-1]), flags[-1]))) + " must be >= 0")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this torch build sees no CUDA device")
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def random_prompts(seed: int, count: int, length: int | tuple[int, int],
                   ids: tuple[int, int]) -> list[list[int]]:
    """`count` prompts of token ids in [ids[0], ids[1]), from one generator seeded `seed`: each
    `length` long, or (lo, hi): lengths drawn in [lo, hi] first, then the ids."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lens = ([length] * count if isinstance(length, int)
            else torch.randint(length[0], length[1] + 1, (count,), generator=g).tolist())
    return [torch.randint(ids[0], ids[1], (n,), generator=g).tolist() for n in lens]


def engine_config(max_num_seqs: int, longest: int, device: str, max_num_batched_tokens: int = 0,
                  **overrides: Any) -> EngineConfig:
    """A TorchEngine config whose pool holds `max_num_seqs` sequences of `longest` tokens (plus
    the spare block), so no run preempts; by default all their tokens fit one step, on the
    caller's thread count (`--threads`: cpu_threads 0)."""
    return EngineConfig(block_size=BLOCK_SIZE, num_blocks=max_num_seqs * -(-longest // BLOCK_SIZE) + 1,
                        max_num_seqs=max_num_seqs, device=device,
                        max_num_batched_tokens=max_num_batched_tokens or max_num_seqs * longest,
                        **{"cpu_threads": 0, **overrides})


def drain(engine: Engine, arrivals: Sequence[EngineRequest] = ()) -> dict[str, list[int]]:
    """Step to the end, adding `arrivals` one per step -> tokens per request; then check the pool."""
    out: dict[str, list[int]] = {}
    pending = list(arrivals)
    while pending or engine.has_work():
        if pending:
            engine.add_request(pending.pop(0))
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.ids)
    engine.check_integrity()
    return out


@contextlib.contextmanager
def patched(module: ModuleType, name: str, wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """`module.name` replaced by `wrap(module.name)` inside the block, restored after."""
    real = getattr(module, name)
    setattr(module, name, wrap(real))
    try:
        yield
    finally:
        setattr(module, name, real)


class Decoding:
    """Sequences decoding on an async engine throughout a measurement (a busy node).

    `await start()` adds one request per prompt ("load-0", "load-1", ...; 32K
    tokens, EOS ignored) and returns once every one has its first token;
    `tokens` counts the decode outputs since; `await stop()` cancels them.
    """

    def __init__(self, aeng: Any, prompts: Sequence[tuple[int, ...]]) -> None:
        self.aeng, self.prompts = aeng, prompts
        self.tokens = 0
        self.tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        started = []
        for i, prompt in enumerate(self.prompts):
            rid = f"load-{i}"
            await self.aeng.add(EngineRequest(rid, prompt, SamplingParams(max_tokens=1 << 15, ignore_eos=True)))
            first = asyncio.get_running_loop().create_future()
            started.append(first)
            self.tasks.append(asyncio.create_task(self._read(self.aeng.stream(rid), first)))
        await asyncio.gather(*started)          # every sequence is decoding

    async def _read(self, outputs: Any, first: asyncio.Future) -> None:
        try:
            async for out in outputs:
                if out.ids:
                    self.tokens += 1
                    if not first.done():
                        first.set_result(None)
        finally:
            await outputs.aclose()

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
