"""Cost-model calibration: the roofline step time against published LLM-serving measurements.

`python -m pddgw.bench.calibration [--json]`

Each published measurement of `pddgw.sim.calibration` (its rows: pddgw/sim/calibration.toml) next to
what the cost model predicts for the same work (`pddgw.sim.calibration.predict`), in the unit its
source publishes.

`ratio` is predicted time / measured time (> 1: the model is slower); `comm_share` is the part of the
predicted steps that is communication (TP all-reduces, EP all-to-alls) not hidden behind compute.
`summary` ("N of M rows within +-25 %") counts the compared rows; a row whose hardware or model is not
a profile yet is listed under `skipped` with the reason, not compared.  Nothing is timed; the output
is deterministic.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

from pddgw.sim.calibration import MEASUREMENTS, Measurement, measured_seconds, predict_with_comm, unavailable
from pddgw.tables import add_output_args, emit, format_table

UNITS: dict[str, str] = {"prefill_tok_s": "prefill tok/s", "decode_ms": "decode ms/step",
                         "decode_tok_s": "decode tok/s", "latency_ms": "request ms", "user_tok_s": "tok/s (1 user)"}


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    setup: str
    kind: str
    unit: str
    published: float
    predicted: float
    ratio: float           # predicted time / measured time
    bound: str             # what bounds the modeled steps: "compute", "memory" or both
    comm_share: float      # communication's share of the predicted time
    engine: str
    hardware: str
    tp: int
    model: str
    batch: int
    prompt: int
    output: int
    conditions: str
    source: str


@dataclasses.dataclass(frozen=True, slots=True)
class Skipped:
    """A measurement the cost model cannot replay yet (its hardware or model is not a profile)."""

    setup: str
    reason: str            # "skipped: ..."
    published: float
    source: str


@dataclasses.dataclass(frozen=True, slots=True)
class Report:
    benchmark: str
    rows: list[Row]        # the compared rows, in calibration.toml's order
    within_20pct: int      # rows with 0.8 <= ratio <= 1.2
    within_25pct: int      # rows with 0.75 <= ratio <= 1.25
    summary: str           # "N of M rows within +-25 %" (M: the compared rows), and the skipped count
    skipped: list[Skipped]


def within(rows: Sequence[Row], tolerance: float) -> int:
    """The rows whose ratio is within +-tolerance of 1 (0.25: 0.75 <= ratio <= 1.25)."""
    return sum(1 - tolerance <= r.ratio <= 1 + tolerance for r in rows)


def _setup(m: Measurement) -> str:
    shape = f"TP{m.tp}" + (f"xDP{m.dp}" if m.dp > 1 else "") + (f" EP{m.ep}" if m.ep else "")
    work = (f"prefill {m.batch}x{m.prompt}" + (f" ({m.cached} cached)" if m.cached else "")
            if m.kind == "prefill_tok_s" else f"batch {m.batch}, {m.prompt} in / {m.output} out")
    return f"{m.engine}, {m.hardware} {shape}, {m.model}, {work}"


def run(measurements: Sequence[Measurement] = MEASUREMENTS) -> Report:
    rows, skipped = [], []
    for m in measurements:
        if (reason := unavailable(m)) is not None:
            skipped.append(Skipped(setup=_setup(m), reason=f"skipped: {reason}", published=m.published,
                                   source=m.source))
            continue
        value, seconds, bound, comm = predict_with_comm(m)
        per = {0: "", 1: " per GPU", 8: " per node"}.get(m.per_gpus, f" per {m.per_gpus} GPUs")
        rows.append(Row(setup=_setup(m), unit=UNITS[m.kind] + per,
                        predicted=value, ratio=seconds / measured_seconds(m), bound=bound,
                        comm_share=comm / seconds,  # and the fields a Row shares with its Measurement:
                        **{f.name: getattr(m, f.name) for f in dataclasses.fields(Row) if hasattr(m, f.name)}))
    in25 = within(rows, 0.25)
    summary = f"{in25} of {len(rows)} rows within +-25 %" + (f", {len(skipped)} skipped" if skipped else "")
    return Report(benchmark="calibration", rows=rows, within_20pct=within(rows, 0.2), within_25pct=in25,
                  summary=summary, skipped=skipped)


def render(report: Report) -> str:
    head = ("cost model vs published measurements (ratio = predicted time / measured time)\n"
            f"{report.summary}; {report.within_20pct} within +-20 %\n")
    sources = {s: i + 1 for i, s in enumerate(dict.fromkeys(r.source for r in report.rows))}
    table = format_table(["setup", "metric", "published", "predicted", "ratio", "bound", "comm", "src"],
                         [(r.setup, r.unit, r.published, r.predicted, r.ratio, r.bound, f"{r.comm_share:.0%}",
                           f"[{sources[r.source]}]") for r in report.rows])
    for r in report.skipped:
        sources.setdefault(r.source, len(sources) + 1)
    skipped = "".join(f"\n{r.setup}, published {r.published:,.6g} [{sources[r.source]}]: {r.reason}"
                      for r in report.skipped)
    notes = "\n".join(f"[{i}] {s}" for s, i in sources.items())
    return f"{head}{table}{skipped}\n\nsources:\n{notes}"


def main(argv: Sequence[str] | None = None) -> Report:
    parser = argparse.ArgumentParser(prog="python -m pddgw.bench.calibration", description=__doc__.split("\n")[0])
    add_output_args(parser)
    args = parser.parse_args(argv)
    report = run()
    emit(report, args.json, render(report))
    return report


if __name__ == "__main__":
    main()
