"""Batches of requests timed on pddgw's TorchEngine, transformers' `generate` and vLLM, same weights.

A side's `run(prompts, output_len, sampling=None)` -> `Run`: seconds until every request had
its first token, to the end, and the output ids (`sampling` None: greedy; pddgw also takes a
`Variant`, and `PddgwSide.breakdown` times one run by phase).  `started` loads every side from
one `build_checkpoint` and warms it up; `time_cases` runs each `Case` on every side,
interleaved, keeping the median times (their meaning: `pddgw.bench.engine`).

`VllmSide` runs pddgw/harness/vllm_side.py under vLLM's own python (scripts/make_vllm_env.sh;
protocol: that file's docstring) with the same thread count, unpinned (pinned to core 0,
vLLM stalled for seconds per run on a busy 2-core machine).  Where it cannot start or answer,
`VllmUnavailable` says why with its log's tail (PDDGW_VLLM_LOG=FILE keeps the whole log).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import select
import statistics
import subprocess
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from pddgw.core.sampling import SamplingParams
from pddgw.engines.model_spec import ModelSpec
from pddgw.engines.tokenizer import ByteTokenizer
from pddgw.engines.torch_engine import TorchEngine
from pddgw.engines.types import EngineRequest
from pddgw.engines.weights import DTYPES, load_model
from pddgw.harness.engines import engine_config, patched, random_prompts

SEED = 0
Variant = Literal["penalties", "json_schema"]      # more asked of pddgw's sampler (`request_params`)


def build_checkpoint(spec: ModelSpec, directory: str) -> None:
    """A seeded random Llama of a plain-Llama spec (`model_spec.llama_spec`: RoPE and head size
    as transformers' defaults) saved by transformers (float32 safetensors), no EOS."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**{**spec.to_hf_config(), "eos_token_id": None, "pad_token_id": 0}))
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * r)
            elif "embed_tokens" in name:
                p.copy_(r)
            elif name == "lm_head.weight":
                # Logit std ~4 over 32000 ids: top-1 vs top-2 gaps dwarf float32
                # differences between the two implementations.
                p.copy_(4.0 * r / p.shape[1] ** 0.5)
            else:
                p.copy_(r / p.shape[1] ** 0.5)
    model.save_pretrained(directory)


@dataclass(frozen=True, slots=True)
class Sampling:
    """The sampled cases' settings (no top-k: the top-p-only path of the sampler)."""

    temperature: float = 0.8
    top_p: float = 0.95
    seed: int = SEED            # request i gets seed + i

    def params(self, i: int, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=self.temperature,
                              top_p=self.top_p, seed=self.seed + i)


def json_schema(min_chars: int) -> str:
    """The json_schema variant's grammar: a 3-field object whose first field is a string of at
    least `min_chars` characters (an output of fewer tokens cannot finish it)."""
    return json.dumps({"type": "object", "properties": {
        "name": {"type": "string", "minLength": min_chars}, "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age", "tags"]})


def request_params(i: int, output_len: int, sampling: Sampling | None = None,
                   variant: Variant | None = None) -> SamplingParams:
    """Request i's sampling: greedy with EOS ignored, or `sampling`'s, with the variant's penalties or
    JSON-schema mask (EOS then ends the object) on top."""
    if sampling is None:
        return SamplingParams(max_tokens=output_len, ignore_eos=True)
    params = sampling.params(i, output_len)
    if variant == "penalties":
        return dataclasses.replace(params, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5)
    if variant == "json_schema":
        return dataclasses.replace(params, ignore_eos=False, grammar=("json_schema", json_schema(output_len)))
    return params


@dataclass(frozen=True, slots=True)
class Run:
    """One timed generation: seconds to the point every request had its first token, and to the end."""

    to_first: float
    total: float
    tokens: tuple[tuple[int, ...], ...]    # output ids per request

    def seconds(self, kind: str) -> float:
        return self.to_first if kind == "prefill" else self.total - self.to_first


@dataclass(frozen=True, slots=True)
class Breakdown:
    """pddgw's time per engine step by phase, milliseconds."""

    steps: int
    step_ms: float
    scheduling_ms: float     # step() minus _forward(): scheduler, stopping, prefix-cache publish
    pack_ms: float           # _forward() minus model and sampler: ids, slots, block tables
    attention_ms: float      # store_kv + paged attention kernels, all layers
    model_other_ms: float    # the model call minus attention
    sampling_ms: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
        torch.cuda.synchronize(device)


class PhaseTimer:
    """Seconds spent per phase over one run, per engine step (wraps; never changes results)."""

    PHASES = ("step", "forward", "model", "attention", "sampling")

    def __init__(self, device: torch.device):
        self.device = device
        self.steps: list[dict[str, float]] = []

    def wrap(self, phase: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            _sync(self.device)
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _sync(self.device)
                # Calls outside a step (e.g. a CUDA graph capture at start-up) are not counted;
                # a replayed graph shows as "model other", its attention not seen.
                if self.steps and phase == "step":
                    self.steps[-1]["step"] = time.perf_counter() - t
                elif self.steps:
                    self.steps[-1][phase] += time.perf_counter() - t
        return timed

    def wrap_step(self, fn: Callable) -> Callable:
        """fn = the engine's step: every call opens a new row of phase times."""
        timed = self.wrap("step", fn)

        def step(*args, **kwargs):
            self.steps.append(dict.fromkeys(self.PHASES, 0.0))
            return timed(*args, **kwargs)
        return step

    def breakdown(self, skip_first: bool) -> Breakdown:
        steps = self.steps[1:] if skip_first and len(self.steps) > 1 else self.steps
        n = len(steps)

        def ms(phase: str) -> float:
            return 1e3 * sum(st[phase] for st in steps) / n

        step, fwd, model, attn, samp = (ms(ph) for ph in self.PHASES)
        return Breakdown(steps=n, step_ms=step, scheduling_ms=step - fwd,
                         pack_ms=fwd - model - samp, attention_ms=attn,
                         model_other_ms=model - attn, sampling_ms=samp)


class PddgwSide:
    name = "pddgw"
    variants = True       # the only side that runs variants

    def __init__(self, model, dtype: torch.dtype, device: str = "cpu",
                 engine_overrides: dict | None = None):
        self.model, self.dtype, self.device = model, dtype, device
        self.engine_overrides = engine_overrides or {}

    def run(self, prompts: list[list[int]], output_len: int, timer: PhaseTimer | None = None,
            sampling: Sampling | None = None, variant: Variant | None = None) -> Run:
        """A fresh engine (the prefix cache would serve repeated prompts) with room for the whole
        batch in one step and in the pool."""
        batch, plen = len(prompts), len(prompts[0])
        cfg = engine_config(batch, plen + output_len, self.device, max(batch * plen, batch),
                            **self.engine_overrides)
        params = [request_params(i, output_len, sampling, variant) for i in range(batch)]
        spec, tok = self.model.spec, None
        if any(p.grammar is not None for p in params):
            # The random checkpoint names no EOS and has no tokenizer: its matcher gets the byte
            # vocabulary (ids < 256) and the byte tokenizer's EOS id to end a finished object with.
            tok = ByteTokenizer(spec.vocab_size)
            spec = dataclasses.replace(spec, eos_token_ids=(ByteTokenizer.EOS,))
        engine = TorchEngine(self.model, spec, cfg, self.dtype, tokenizer=tok)
        step = engine.step
        if timer is not None:
            engine._forward = timer.wrap("forward", engine._forward)
            engine.model = timer.wrap("model", engine.model)
            step = timer.wrap_step(engine.step)
        out: dict[str, list[int]] = {f"r{i}": [] for i in range(batch)}
        gc.collect()
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(EngineRequest(f"r{i}", tuple(p), params[i]))
        t_first = None
        while engine.has_work():
            for o in step():
                out[o.request_id] += o.ids
            if t_first is None and all(out.values()):
                t_first = time.perf_counter()
        t_end = time.perf_counter()
        engine.check_integrity()
        tokens = tuple(tuple(out[f"r{i}"]) for i in range(batch))
        if t_first is None or any(len(t) != output_len for t in tokens):
            raise RuntimeError(f"pddgw generated {sorted({len(t) for t in tokens})} tokens per "
                               f"request, expected {output_len}")
        return Run(t_first - t0, t_end - t0, tokens)

    def breakdown(self, prompts: list[list[int]], output_len: int, kind: str,
                  sampling: Sampling | None = None, variant: Variant | None = None) -> Breakdown:
        """One extra run with every phase timed (module functions wrapped for its duration)."""
        import pddgw.engines.model as model_mod
        import pddgw.engines.torch_engine as engine_mod

        timer = PhaseTimer(torch.device(self.device))
        with patched(model_mod, "paged_attention", lambda f: timer.wrap("attention", f)), \
                patched(engine_mod, "sample", lambda f: timer.wrap("sampling", f)):
            self.run(prompts, output_len, timer, sampling, variant)
        return timer.breakdown(skip_first=kind == "decode")


class TransformersSide:
    name = "transformers"

    def __init__(self, model, device: str = "cpu"):
        self.model, self.device = model, device

    def run(self, prompts: Sequence[Sequence[int]], output_len: int, sampling: Sampling | None = None) -> Run:
        """`generate` with a stopping criterion that only records when each step finished; sampled
        like pddgw (top_k 0: generate's default top-k of 50 off) but with its own RNG."""
        from transformers import StoppingCriteria, StoppingCriteriaList

        stamps: list[float] = []

        class _Stamp(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                stamps.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        ids = torch.tensor(prompts, dtype=torch.int64, device=self.device)   # [B, L]
        mask = torch.ones_like(ids)     # equal lengths: left padding is empty
        how: dict = {"do_sample": False}
        if sampling is not None:
            how = {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": 0}
            torch.manual_seed(sampling.seed)
        gc.collect()
        t0 = time.perf_counter()
        with torch.inference_mode():
            gen = self.model.generate(input_ids=ids, attention_mask=mask,
                                      max_new_tokens=output_len, min_new_tokens=output_len,
                                      pad_token_id=0, stopping_criteria=StoppingCriteriaList([_Stamp()]),
                                      **how)
        t_end = time.perf_counter()
        new = gen[:, ids.shape[1]:]                                    # [B, N]
        if new.shape[1] != output_len or len(stamps) != output_len:
            raise RuntimeError(f"transformers generated {new.shape[1]} tokens in {len(stamps)} "
                               f"steps, expected {output_len}")
        return Run(stamps[0] - t0, t_end - t0, tuple(tuple(r) for r in new.tolist()))


VLLM_SIDE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_side.py")


class VllmUnavailable(RuntimeError):
    """The vLLM subprocess could not start or answer; the message says why."""


class VllmSide:
    """vLLM in its own python (pddgw/harness/vllm_side.py), JSON lines over stdin/stdout."""

    name = "vllm"
    samples = False       # vllm_side.py runs greedy only

    def __init__(self, python: str, checkpoint: str, dtype_name: str, threads: int,
                 max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                 enforce_eager: bool = False, start_timeout_s: float = 900.0):
        env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads),   # unless set
               "VLLM_CPU_KVCACHE_SPACE": "1",                 # GiB
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0",         # engine in this one process
               "HF_HUB_OFFLINE": "1"} | dict(os.environ)
        env.pop("PYTHONPATH", None)                                # vLLM's env only, not pddgw's
        # The child's stderr (vLLM's logs): kept for the error message, or in PDDGW_VLLM_LOG.
        log_path = os.environ.get("PDDGW_VLLM_LOG")
        self._log = open(log_path, "w+") if log_path else tempfile.TemporaryFile(mode="w+")
        try:
            self._proc = subprocess.Popen([python, VLLM_SIDE_SCRIPT], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=self._log, text=True,
                                          env=env)
        except OSError as e:
            raise VllmUnavailable(f"cannot start {python}: {e}") from e
        self.info = self._call({"model": checkpoint, "dtype": dtype_name,
                                "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
                                "max_num_batched_tokens": max_num_batched_tokens,
                                "enforce_eager": enforce_eager}, start_timeout_s)

    def _log_tail(self, lines: int = 8) -> str:
        self._log.seek(0)
        tail = [ln for ln in self._log.read().splitlines() if ln.strip()][-lines:]
        return "\n".join(tail)

    def _call(self, msg: dict, timeout_s: float = 900.0) -> dict:
        try:
            self._proc.stdin.write(json.dumps(msg) + "\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass     # the process died; the empty read below says so
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        line = self._proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            why = "timed out" if not ready else f"exited with {self._proc.returncode}"
            raise VllmUnavailable(f"vllm_side {why}:\n{self._log_tail()}")
        reply = json.loads(line)
        if not reply.get("ok"):
            self.close()     # a side that failed is not used again: its caller need not close it
            raise VllmUnavailable(f"{reply.get('error')}\n{self._log_tail()}")
        return reply

    def run(self, prompts: list[list[int]], output_len: int, sampling: None = None) -> Run:
        r = self._call({"op": "run", "prompts": prompts, "output_len": output_len})
        return Run(r["to_first"], r["total"], tuple(tuple(t) for t in r["tokens"]))

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._proc.stdin.write('{"op": "quit"}\n')
                self._proc.stdin.close()
                self._proc.wait(timeout=30)
            except Exception:  # noqa: BLE001 - a stuck child is killed below
                self._proc.kill()
                self._proc.wait()


@dataclass(frozen=True, slots=True)
class Case:
    kind: Literal["decode", "prefill"]
    batch: int
    prompt_len: int
    output_len: int
    sampling: Sampling | None = None     # None: greedy
    variant: Variant | None = None       # sampled cases only

    @property
    def label(self) -> str:
        return (f"{self.kind} b={self.batch}" + (" sampled" if self.sampling else "")
                + (f" +{self.variant}" if self.variant else ""))

    @property
    def prompt_key(self) -> tuple[str, int, int]:
        """Cases with the same key get the same prompts (a sampled case its greedy twin's)."""
        return self.kind, self.batch, self.prompt_len

    def params(self, i: int) -> SamplingParams:
        return request_params(i, self.output_len, self.sampling, self.variant)

    @property
    def measured_tokens(self) -> int:
        return self.batch * (self.prompt_len if self.kind == "prefill" else self.output_len - 1)


def make_prompts(batch: int, length: int, vocab: int, salt: int) -> list[list[int]]:
    return random_prompts(1000 + salt, batch, length, (3, vocab))     # not the low ids: bos/pad/eos


def case_prompts(todo: Sequence[Case], vocab: int) -> list[list[list[int]]]:
    """Prompts per case: one set per `prompt_key`, salted by its order of first use."""
    salts: dict[tuple[str, int, int], int] = {}
    for c in todo:
        salts.setdefault(c.prompt_key, len(salts))
    return [make_prompts(c.batch, c.prompt_len, vocab, salts[c.prompt_key]) for c in todo]


def engine_overrides(cuda_graphs: str | None, device: str) -> tuple[dict, str]:
    """EngineConfig fields for --cuda-graphs ("on", "off", None: the default), and what a report says of it."""
    if cuda_graphs is None:
        return {}, "default"
    if cuda_graphs == "on" and not device.startswith("cuda"):
        return {}, f"on ignored: CUDA graphs need a CUDA device, not {device!r}"
    return {"cuda_graphs": cuda_graphs == "on"}, cuda_graphs


@contextlib.contextmanager
def started(spec: ModelSpec, dtype_name: str, device: str, cuda_graphs: str | None, todo: Sequence[Case],
            vllm_python: str | None, vllm_eager: bool, progress: Callable[[str], None]) -> Iterator[tuple[list, dict]]:
    """pddgw (`engine_overrides`) and transformers on a `build_checkpoint` of `spec`, and with `vllm_python`
    one vLLM engine sized for `todo`'s largest batch, each warmed up -> (the sides, pddgw first; what a report
    says of them: cuda_graphs, transformers_version, transformers_attention, vllm, vllm_version).  A vLLM that
    cannot start or run the model is left out (`vllm` says why); one that runs is closed after the block."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    dtype, warm = DTYPES[dtype_name], make_prompts(2, 8, spec.vocab_size, -1)
    overrides, graphs_note = engine_overrides(cuda_graphs, device)
    vllm, about = None, {"vllm": "not available (--vllm-python not given)", "vllm_version": None}
    with tempfile.TemporaryDirectory(prefix="pddgw-bench-") as d:
        build_checkpoint(spec, d)
        ours, _tok = load_model(d, dtype, device)
        theirs = AutoModelForCausalLM.from_pretrained(d, dtype=dtype).to(device).eval()
        if vllm_python:
            progress(f"starting vLLM ({vllm_python}) ...")
            longest = spec.max_position_embeddings
            try:
                vllm = VllmSide(vllm_python, d, dtype_name, torch.get_num_threads(), longest,
                                max(c.batch for c in todo), max(max(c.batch * c.prompt_len for c in todo), longest),
                                enforce_eager=vllm_eager)
                vllm.run(warm, 3)           # started, but it may not run this model
                about["vllm"] = ("vLLM {vllm_version} (torch {torch_version}), OMP_NUM_THREADS={omp_threads} "
                                 "VLLM_CPU_OMP_THREADS_BIND={threads_bind}, ").format(**vllm.info) + (
                                     "eager" if vllm_eager else "compiled")
                about["vllm_version"] = vllm.info["vllm_version"]
            except VllmUnavailable as e:    # the side has closed itself
                vllm = None
                progress(f"vLLM: not available: {e}")
                about["vllm"] = f"not available ({str(e).splitlines()[0]})"
    about |= {"cuda_graphs": graphs_note, "transformers_version": transformers.__version__,
              "transformers_attention": str(theirs.config._attn_implementation)}
    sides: list = [PddgwSide(ours, dtype, device, overrides), TransformersSide(theirs, device)]
    try:
        for side in sides:
            side.run(warm, 3)
        yield sides + ([vllm] if vllm else []), about
    finally:
        if vllm is not None:
            vllm.close()


def time_cases(sides: Sequence, todo: Sequence[Case], prompts: Sequence[list[list[int]]], repeats: int,
               progress: Callable[[str], None]
               ) -> tuple[dict[tuple[Case, str], float], dict[tuple[Case, str], list[tuple[tuple[int, ...], ...]]]]:
    """-> the median seconds of each (case, side name) (`Run.seconds` of the case's kind), and the
    output ids of each pair, one `Run.tokens` per repeat.  A "pddgw" side is required; a side without
    `samples` sits out the sampled cases, one without `variants` the variant ones."""
    times: dict[tuple[Case, str], list[float]] = defaultdict(list)
    tokens: dict[tuple[Case, str], list[tuple[tuple[int, ...], ...]]] = defaultdict(list)
    for rep in range(repeats):
        for c, p in zip(todo, prompts):
            ran = []
            for side in (sides if rep % 2 == 0 else sides[::-1]):
                if (c.sampling and not getattr(side, "samples", True)) or (
                        c.variant and not getattr(side, "variants", False)):
                    continue
                r = side.run(p, c.output_len, sampling=c.sampling, **({"variant": c.variant} if c.variant else {}))
                times[(c, side.name)].append(r.seconds(c.kind))
                tokens[(c, side.name)].append(r.tokens)
                ran.append(side.name)
            progress(f"repeat {rep + 1}/{repeats} {c.label}: "
                     + ", ".join(f"{n} {times[(c, n)][-1] * 1e3:.0f} ms" for n in ran))
    return {key: statistics.median(t) for key, t in times.items()}, dict(tokens)
