"""scripts/gpu_check.sh on this CPU machine, so that the GPU check cannot rot unseen between GPU loans.

Its dry run (no GPU: every step that can run here, the GPU steps reported as skipped, exit 2), a GPU that
torch cannot see (a stand-in nvidia-smi: the preflight refuses in one line, nothing else runs, exit 1),
and a budget too small to start a step.  The carried-wheel path itself is checked by
scripts/gpu_standin.sh, which needs wheels downloaded for Python 3.12.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
GPU_STEPS = ["bench_kernels", "pytest_gpu", "bench_engine_graphs_off", "bench_engine_graphs_on", "pytest_kernels"]


def _check(tmp_path: Path, **env: str) -> tuple[int, dict, str]:
    wheels = tmp_path / "no-wheels"
    wheels.mkdir(exist_ok=True)
    report = tmp_path / "report.json"
    run_env = {**os.environ, "PDDGW_GPU_PYTHON": sys.executable, "PDDGW_GPU_WHEELS": str(wheels), **env}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(report)], env=run_env,
                          capture_output=True, text=True, timeout=280)
    return done.returncode, json.loads(report.read_text()), done.stderr


def _statuses(report: dict) -> list[tuple[str, str]]:
    return [(s["name"], s["status"]) for s in report["steps"]]


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_wheels.sh", "gpu_standin.sh"])
def test_the_gpu_scripts_are_valid_bash(script):
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], check=True)


def test_dry_run_runs_what_it_can_and_exits_2(tmp_path):
    rc, report, err = _check(tmp_path, PDDGW_GPU_CHECK_DRY_RUN="1")
    assert rc == 2, err
    assert report["result"] == "dry-run" and report["gpu"] is False
    assert report["nvidia_smi"] == "dry run (PDDGW_GPU_CHECK_DRY_RUN=1)"
    assert _statuses(report) == ([("wheels", "skipped"), ("preflight", "passed"), ("collect", "passed")]
                                 + [(s, "skipped") for s in GPU_STEPS])
    steps = {s["name"]: s for s in report["steps"]}
    assert steps["wheels"]["stdout_tail"] == (f"no wheels in {tmp_path / 'no-wheels'}: "
                                              "the interpreter's own packages are used\n")
    assert steps["preflight"]["json"]["torch"] == torch.__version__
    assert steps["preflight"]["json"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert steps["collect"]["tests"]["collected"] > 0
    assert all(steps[s]["stdout_tail"] == "no GPU\n" and steps[s]["rc"] is None for s in GPU_STEPS)
    assert "gpu_check: dry-run; report in" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that sees no CUDA device")
def test_a_gpu_torch_cannot_see_stops_at_the_preflight(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text('#!/bin/sh\necho "NVIDIA H200, 580.159.04, 143771 MiB"\n')
    (fake / "nvidia-smi").chmod(0o755)
    rc, report, err = _check(tmp_path, PATH=f"{fake}:{os.environ['PATH']}")
    assert rc == 1, err
    assert report["result"] == "failed" and report["gpu"] is True
    assert report["nvidia_smi"] == "NVIDIA H200, 580.159.04, 143771 MiB"
    assert _statuses(report) == ([("wheels", "skipped"), ("preflight", "failed"), ("collect", "skipped")]
                                 + [(s, "skipped") for s in GPU_STEPS])
    preflight = report["steps"][1]
    assert preflight["rc"] == 1
    assert preflight["stderr_tail"] == f"gpu_check: torch {torch.__version__} sees no CUDA device\n"


def test_a_budget_too_small_for_a_step_fails_without_running_it(tmp_path):
    # 12 s less the 10 s kept for the report leaves 2 s: under the 5 s a step needs to start.
    rc, report, err = _check(tmp_path, PDDGW_GPU_CHECK_DRY_RUN="1", PDDGW_GPU_BUDGET_S="12")
    assert rc == 1, err
    assert report["result"] == "failed"
    assert _statuses(report)[:3] == [("wheels", "skipped"), ("preflight", "timeout"), ("collect", "skipped")]
    assert report["steps"][1]["stdout_tail"] == "out of time\n"
