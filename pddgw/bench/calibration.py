"""Cost-model calibration: the roofline step time against published LLM-serving measurements.

`python -m pddgw.bench.calibration [--json]`

Each published measurement of `pddgw.sim.calibration` (its rows: pddgw/sim/calibration.toml) next to
what the cost model predicts for the same work (`pddgw.sim.calibration.predict`), in the unit its
source publishes.

`ratio` is predicted time / measured time (> 1: the model is slower); `comm_share` is the part of the
predicted steps that is communication (TP all-reduces, EP all-to-alls), never overlapped with compute.
Nothing is timed; the output is deterministic.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

from pddgw.sim.calibration import MEASUREMENTS, Measurement, measured_seconds, predict_with_comm
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
class Report:
    benchmark: str
    rows: list[Row]
    within_20pct: int      # rows with 0.8 <= ratio <= 1.2
    within_25pct: int      # rows with 0.75 <= ratio <= 1.25


def run(measurements: Sequence[Measurement] = MEASUREMENTS) -> Report:
    rows = []
    for m in measurements:
        value, seconds, bound, comm = predict_with_comm(m)
        shape = f"TP{m.tp}" + (f"xDP{m.dp}" if m.dp > 1 else "") + (f" EP{m.ep}" if m.ep else "")
        per = {0: "", 1: " per GPU", 8: " per node"}.get(m.per_gpus, f" per {m.per_gpus} GPUs")
        work = (f"prefill {m.batch}x{m.prompt}" if m.kind == "prefill_tok_s"
                else f"batch {m.batch}, {m.prompt} in / {m.output} out")
        rows.append(Row(setup=f"{m.engine}, {m.hardware} {shape}, {m.model}, {work}", unit=UNITS[m.kind] + per,
                        predicted=value, ratio=seconds / measured_seconds(m), bound=bound,
                        comm_share=comm / seconds,  # and the fields a Row shares with its Measurement:
                        **{f.name: getattr(m, f.name) for f in dataclasses.fields(Row) if hasattr(m, f.name)}))
    return Report(benchmark="calibration", rows=rows,
                  within_20pct=sum(0.8 <= r.ratio <= 1.2 for r in rows),
                  within_25pct=sum(0.75 <= r.ratio <= 1.25 for r in rows))


def render(report: Report) -> str:
    head = ("cost model vs published measurements (ratio = predicted time / measured time)\n"
            f"{report.within_20pct} of {len(report.rows)} rows within +-20 %, "
            f"{report.within_25pct} within +-25 %\n")
    sources = {s: i + 1 for i, s in enumerate(dict.fromkeys(r.source for r in report.rows))}
    table = format_table(["setup", "metric", "published", "predicted", "ratio", "bound", "comm", "src"],
                         [(r.setup, r.unit, r.published, r.predicted, r.ratio, r.bound, f"{r.comm_share:.0%}",
                           f"[{sources[r.source]}]") for r in report.rows])
    notes = "\n".join(f"[{i}] {s}" for s, i in sources.items())
    return f"{head}{table}\n\nsources:\n{notes}"


def main(argv: Sequence[str] | None = None) -> Report:
    parser = argparse.ArgumentParser(prog="python -m pddgw.bench.calibration", description=__doc__.split("\n")[0])
    add_output_args(parser)
    args = parser.parse_args(argv)
    report = run()
    emit(report, args.json, render(report))
    return report


if __name__ == "__main__":
    main()
