"""The published LLM-serving measurements the cost model answers to, and what it predicts for each.

The rows live in calibration.toml beside this module (one `[[measurement]]` each, its source
named in `[sources]`), with the work as the source states it and the published number.
`predict` replays that work with `roofline.step_cost`: one prefill step of all prompts (each
computing its prompt - cached tokens on top of a cached prefix), then output - 1 decode steps of
the whole batch.  Kinds: prefill_tok_s, decode_ms, decode_tok_s,
latency_ms (prefill + every decode step), user_tok_s; `per_gpus` for per-node or per-GPU
throughputs.  A model ending in "@fp8" has FP8 weights and KV.  A row whose hardware or model
the profiles do not know (yet) is not predicted: `unavailable` says why.  The profiles'
efficiencies are fitted to these rows only (docs/results/calibration.md).
"""

from __future__ import annotations

import dataclasses
import statistics
import tomllib
from importlib import resources
from typing import Literal

from pddgw.sim import profiles
from pddgw.sim.profiles import ModelProfile
from pddgw.sim.roofline import Parallel, SeqWork, step_cost

Kind = Literal["prefill_tok_s", "decode_ms", "decode_tok_s", "latency_ms", "user_tok_s"]


@dataclasses.dataclass(frozen=True, slots=True)
class Measurement:
    """One published number and the conditions it was measured under."""

    engine: str
    hardware: str      # pddgw.sim.profiles.HARDWARE name
    tp: int
    model: str         # pddgw.sim.profiles.MODELS name
    batch: int         # concurrent sequences
    prompt: int        # prompt tokens per sequence
    output: int        # generated tokens per sequence (1: prefill only)
    kind: Kind
    published: float   # in the unit of `kind`
    conditions: str    # what the source states beyond the columns
    source: str
    # The instance's shape beyond tp (pddgw.sim.roofline.Parallel): DP-attention ranks of tp
    # GPUs each (GPUs = tp x dp), experts over ep of them (0 = all).  Dense rows: 1 and 0.
    dp: int = 1
    ep: int = 0
    # The published throughput is per this many GPUs (8: per node); 0 = the whole instance.
    per_gpus: int = 0
    # Prompt tokens per sequence whose KV was already cached (prefix hits): the prefill step
    # computes prompt - cached tokens on top of them, while a throughput still counts the whole
    # prompt, as a source that counts cache hits in its input tokens does.
    cached: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.cached < self.prompt:
            raise ValueError(f"cached must be in [0, prompt {self.prompt}), got {self.cached}")
        if self.kind != "prefill_tok_s" and self.output < 2:
            raise ValueError(f"a {self.kind} measurement needs output >= 2 (at least one decode step)")
        if self.per_gpus and self.kind not in ("prefill_tok_s", "decode_tok_s"):
            raise ValueError(f"per_gpus applies to throughputs (prefill_tok_s, decode_tok_s), not {self.kind}")

    @property
    def scale(self) -> float:
        """Published unit over the whole instance: per_gpus / gpus (1 = the instance)."""
        return self.per_gpus / (self.tp * self.dp) if self.per_gpus else 1.0

    @property
    def tokens(self) -> int | None:
        """The tokens a throughput counts over the timed span; None for the millisecond kinds."""
        return {"prefill_tok_s": self.batch * self.prompt, "decode_tok_s": self.batch,
                "user_tok_s": self.output}.get(self.kind)


def load_measurements(toml_text: str | None = None) -> tuple[Measurement, ...]:
    """The [[measurement]] rows of calibration.toml (or of toml_text), each source resolved."""
    data = tomllib.loads(toml_text or resources.files("pddgw.sim").joinpath("calibration.toml").read_text("utf-8"))
    if unknown := data.keys() - {"sources", "measurement"}:
        raise ValueError(f"calibration.toml: unknown table(s) {', '.join(sorted(unknown))}")
    known = {f.name for f in dataclasses.fields(Measurement)}
    rows = []
    for i, row in enumerate(data["measurement"], 1):
        where = f"calibration.toml measurement {i} ({row.get('engine')}, {row.get('hardware')}, {row.get('model')})"
        if unknown := row.keys() - known:
            raise ValueError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
        if row.get("source") not in data["sources"]:
            raise ValueError(f"{where}: source {row.get('source')!r} is not in [sources]")
        try:
            rows.append(Measurement(**{**row, "source": data["sources"][row["source"]]}))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None
    return tuple(rows)


MEASUREMENTS: tuple[Measurement, ...] = load_measurements()
# Shapes the calibration needs beyond pddgw.sim.profiles.MODELS.  meta-llama/Llama-2-7b-hf
# config.json: Llama-2-70B's vocabulary on 32 layers of 4096, 32 heads (no GQA), MLP 11008.
EXTRA_MODELS: dict[str, ModelProfile] = {"llama2-7b": dataclasses.replace(
    profiles.model("llama2-70b"), name="llama2-7b", num_layers=32, hidden_size=4096, num_heads=32,
    num_kv_heads=32, intermediate_size=11008)}


def model_profile(name: str) -> ModelProfile:
    """A calibration row's model: a profile (or EXTRA_MODELS) name, "@fp8" for FP8 weights and KV."""
    base = name.removesuffix("@fp8")
    prof = EXTRA_MODELS[base] if base in EXTRA_MODELS else profiles.model(base)
    if base != name:
        prof = dataclasses.replace(prof, name=name, weight_bytes_per_param=1.0, kv_bytes_per_value=1)
    return prof


def unavailable(m: Measurement) -> str | None:
    """Why m cannot be predicted (its hardware or model is not a profile yet), or None when it can."""
    if m.hardware not in profiles.HARDWARE:
        return f"hardware {m.hardware!r} is not in pddgw.sim.profiles.HARDWARE"
    try:
        model_profile(m.model)
    except KeyError:
        return f"model {m.model!r} is not a pddgw.sim.profiles model or shipped config"
    return None


def predict(m: Measurement) -> tuple[float, float, str]:
    """(predicted value in the unit of m.kind, predicted seconds, bound) for the measured work."""
    return predict_with_comm(m)[:3]


def predict_with_comm(m: Measurement) -> tuple[float, float, str, float]:
    """predict's (value, seconds, bound) and the communication seconds of those steps."""
    model, hw, par = model_profile(m.model), profiles.hardware(m.hardware), Parallel(tp=m.tp, dp=m.dp, ep=m.ep)
    prefill = step_cost(model, hw, par, [SeqWork(m.prompt - m.cached, m.cached)] * m.batch)
    # Decode step i (0-based) feeds output token i back in, on top of the prompt and the i earlier outputs.
    decodes = [step_cost(model, hw, par, [SeqWork(1, m.prompt + i)] * m.batch) for i in range(m.output - 1)]
    steps = [prefill] if m.kind == "prefill_tok_s" else decodes
    if m.kind in ("latency_ms", "user_tok_s"):  # the whole request
        seconds = prefill.seconds + sum(c.seconds for c in decodes)
        comm = prefill.comm_s + sum(c.comm_s for c in decodes)
    else:  # one step: the prefill, or the mean decode step
        seconds, comm = statistics.fmean(c.seconds for c in steps), statistics.fmean(c.comm_s for c in steps)
    value = seconds * 1e3 if m.tokens is None else m.tokens / seconds * m.scale
    return value, seconds, "/".join(sorted({c.bound for c in steps})), comm


def measured_seconds(m: Measurement) -> float:
    """The published number as seconds of the same span `predict` times."""
    return m.published / 1e3 if m.tokens is None else m.tokens / (m.published / m.scale)
