#!/usr/bin/env bash
# GPU checks of pddgw in one go, under 8 minutes, with one JSON report.
#
#   scripts/gpu_check.sh [REPORT.json]          (default: gpu_report.json)
#
# On a machine with an NVIDIA GPU:
#   1. setup    a venv ($PDDGW_GPU_VENV, default .venv-gpu in the repo) with
#               `pip install torch==2.13.0` ($PDDGW_TORCH) and then
#               `pip install -e '.[test]'`.  On Linux x86_64 the default
#               index's torch wheel is the CUDA build (it brings its own CUDA
#               runtime as nvidia-* wheels; the driver must be new enough for
#               it).  For another CUDA version set PIP_INDEX_URL /
#               PIP_EXTRA_INDEX_URL to that build's wheel index before running.
#               Skipped when that venv already imports pddgw and sees CUDA, or
#               when PDDGW_GPU_PYTHON names a ready python (no network needed).
#   2. torch    torch / CUDA versions and torch.cuda.is_available()
#   3. pytest_gpu       pytest -m gpu (every GPU-only test outside tests/kernels, e.g.
#                       tests/engines/test_cuda_graphs.py: graphs on vs off token-exact)
#   4. pytest_kernels   pytest tests/kernels
#   5. bench_kernels    python -m pddgw.bench.kernels --json
#   6. bench_engine_graphs_off / _on
#               python -m pddgw.bench.engine --device cuda --cuda-graphs off|on --json
#               (EngineConfig.cuda_graphs: with "on" every engine the bench
#               builds captures its decode graphs at start, outside the timings)
# Each step runs under `timeout`, capped by what is left of the 8 minutes
# (PDDGW_GPU_BUDGET_S, default 480).  The report holds timestamps, the GPU
# (nvidia-smi), and each step's rc, seconds, and JSON output (or its text tail).
# Exit: 0 when every step passed, 1 when one failed (or ran out of time), 2
# when there is no GPU (nvidia-smi missing or failing: nothing is run).
# Not tried on a GPU yet (written on a CPU-only machine): the step timeouts
# are estimates for one H200-class GPU with the pip downloads cached or fast.
set -uo pipefail

if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi not found on PATH); nothing was run" >&2
    exit 2
fi
if ! gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1); then
    echo "gpu_check: nvidia-smi failed, no usable GPU: $gpu" >&2
    exit 2
fi

here=${BASH_SOURCE[0]%/*}
[[ $here == "${BASH_SOURCE[0]}" ]] && here=.
repo=$(cd "$here/.." && pwd)
report=${1:-gpu_report.json}
[[ $report == /* ]] || report=$PWD/$report
budget=${PDDGW_GPU_BUDGET_S:-480}
start=$SECONDS
steps=$(mktemp -d)
trap 'rm -rf "$steps"' EXIT
cd "$repo" || exit 1
date -u +%Y-%m-%dT%H:%M:%SZ > "$steps/started"
printf '%s\n' "$gpu" > "$steps/gpu"

# run_step NAME MAX_SECONDS CMD...: runs CMD under timeout, records rc / seconds / output.
order=()
failed=0
run_step() {
    local name=$1 max=$2; shift 2
    local left=$(( budget - (SECONDS - start) - 10 ))   # 10 s to write the report
    local limit=$(( max < left ? max : left ))
    order+=("$name")
    if (( limit < 5 )); then
        echo "gpu_check: $name skipped, out of time" >&2
        echo 124 > "$steps/$name.rc"; echo 0 > "$steps/$name.s"
        echo "skipped: out of time" > "$steps/$name.out"; : > "$steps/$name.err"
        failed=1
        return
    fi
    echo "gpu_check: $name (timeout ${limit}s): $*" >&2
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$steps/$name.out" 2> "$steps/$name.err"
    local rc=$?
    echo "$rc" > "$steps/$name.rc"; echo $(( SECONDS - t0 )) > "$steps/$name.s"
    echo "gpu_check: $name rc=$rc in $(( SECONDS - t0 ))s" >&2
    # pytest's 5 = no test collected (e.g. no GPU test outside tests/kernels): not a failure.
    (( rc == 0 )) || [[ $name == pytest_* && $rc == 5 ]] || failed=1
}

if [[ -n ${PDDGW_GPU_PYTHON:-} ]]; then
    py=$PDDGW_GPU_PYTHON
else
    venv=${PDDGW_GPU_VENV:-$repo/.venv-gpu}
    py=$venv/bin/python
    if "$py" -c 'import torch, pddgw; assert torch.cuda.is_available()' >/dev/null 2>&1; then
        echo "gpu_check: $venv is ready, no install" >&2
    else
        run_step setup 300 bash -c '
            set -e
            python3 -m venv "$1"
            "$1/bin/pip" install --upgrade pip
            "$1/bin/pip" install "$2"
            "$1/bin/pip" install -e ".[test]"' _ "$venv" "${PDDGW_TORCH:-torch==2.13.0}"
    fi
fi

run_step torch 30 "$py" -c 'import json, torch; print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "available": torch.cuda.is_available(), "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None})); assert torch.cuda.is_available(), "torch sees no CUDA device"'
run_step pytest_gpu 120 "$py" -m pytest -q -m gpu tests --ignore=tests/kernels -p no:cacheprovider
run_step pytest_kernels 120 "$py" -m pytest -q tests/kernels -p no:cacheprovider
run_step bench_kernels 60 "$py" -m pddgw.bench.kernels --json
run_step bench_engine_graphs_off 90 "$py" -m pddgw.bench.engine --device cuda --cuda-graphs off --repeats 2 --json
run_step bench_engine_graphs_on 90 "$py" -m pddgw.bench.engine --device cuda --cuda-graphs on --repeats 2 --json

date -u +%Y-%m-%dT%H:%M:%SZ > "$steps/finished"
python3 - "$steps" "$report" "${order[@]}" <<'PY'
import json, pathlib, sys

steps, report, names = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
read = lambda p: (steps / p).read_text(errors="replace")
out = {"started": read("started").strip(), "finished": read("finished").strip(),
       "nvidia_smi": read("gpu").strip(), "steps": []}
for n in names:
    text = read(f"{n}.out")
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    out["steps"].append({"name": n, "rc": int(read(f"{n}.rc")), "seconds": int(read(f"{n}.s")),
                         "json": data, "stdout_tail": None if data is not None else text[-4000:],
                         "stderr_tail": read(f"{n}.err")[-3000:]})
pathlib.Path(report).write_text(json.dumps(out, indent=2) + "\n")
print(f"gpu_check: report in {report}", file=sys.stderr)
PY
exit $failed
