"""PNG plots of a `pddgw sim` report (matplotlib, no display needed).

* `ttft_cdf_<wan>.png`: the TTFT distribution of every deployment, one variant;
* `goodput.png`: SLO attainment against request rate, per deployment and
  variant (the probes of the goodput search), with the attainment target;
* `bathtub.png`: PDD's TTFT benefit over the baseline against the average
  prefix hit (P50 and P90).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_plots(rep: dict[str, Any], private: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(fig: Any, name: str) -> None:
        path = out / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    for var in rep["variants"]:
        w = var["wan_gbps"]
        label = f"{w:g} Gbps WAN" if w is not None else "links as configured"
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for name in var["deployments"]:
            xs = private["ttft"].get((w, name), [])
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("share of requests")
        ax.set_title(f"{rep['scenario']}: TTFT CDF, {label}")
        ax.axvline(rep["slo"]["ttft_s"], color="grey", linestyle=":", label="TTFT SLO")
        ax.legend()
        ax.grid(alpha=0.3)
        save(fig, f"ttft_cdf_{'configured' if w is None else f'{w:g}gbps'}.png")

    probes: list[tuple[float | None, str, list]] = []
    for var in rep["variants"]:
        for name, d in var["deployments"].items():
            # A same-DC deployment's search is the same under every WAN: draw it once.
            if "goodput_probes" in d and not any(n == name and p == d["goodput_probes"] for _, n, p in probes):
                probes.append((var["wan_gbps"], name, d["goodput_probes"]))
    if probes:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for w, name, pts in probes:
            pts = sorted(pts, key=lambda p: p["rate"])
            ax.plot([p["rate"] for p in pts], [p["attainment"] for p in pts], marker="o",
                    label=name if w is None else f"{name} @ {w:g} Gbps")
        ax.axhline(rep["slo"]["attainment"], color="grey", linestyle=":", label="attainment target")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("share of requests meeting every SLO")
        ax.set_title(f"{rep['scenario']}: SLO attainment vs rate")
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
        save(fig, "goodput.png")

    if "bathtub" in rep:
        bt = rep["bathtub"]
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for q in ("p50", "p90"):
            pts = [p for p in bt["points"] if p[f"benefit_{q}"] is not None]
            ax.plot([p["hit"] for p in pts], [p[f"benefit_{q}"] for p in pts], marker="o", label=f"TTFT {q.upper()}")
        ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.set_xlabel("prefix hit of the workload's follow-up turns")
        ax.set_ylabel(f"TTFT reduction vs {bt['baseline']}")
        ax.set_title(f"{rep['scenario']}: the bathtub ({bt['deployment']}, {bt['wan_gbps']:g} Gbps)")
        ax.legend()
        ax.grid(alpha=0.3)
        save(fig, "bathtub.png")
    return written
