#!/usr/bin/env bash
# GPU checks of pddgw in one go, under 8 minutes, with one JSON report, on the GPU machine as it is:
# its own python and torch, nothing fetched from a network.
#
#   scripts/gpu_check.sh [REPORT.json]          (default: gpu_report.json)
#
# On a GPU machine with nothing to fetch from (its own python and torch), with the repo's
# .gpu-wheels/ copied beside the tree:
#   bash scripts/gpu_check.sh /path/to/gpu_report.json
# First, where the package registry is reachable: scripts/gpu_wheels.sh (the wheels such a machine
# lacks, into the ignored .gpu-wheels/).
#
# Steps, in order:
#   wheels      .gpu-wheels/*.whl installed with --no-index --no-deps --target into a temporary folder
#               put on PYTHONPATH after the working tree (pddgw runs from the tree, not installed);
#               skipped when there is no such folder (the interpreter has everything itself)
#   preflight   scripts/gpu_preflight.py: Python >= 3.11, torch >= 2.11, triton >= 3.6, every import a
#               step needs; one line naming what is missing or too old, and nothing else runs
#   collect     pytest --collect-only of tests/engines and tests/kernels (the GPU tests' modules)
#   then, with a GPU:
#   bench_kernels            python -m pddgw.bench.kernels --json (decode attention as a share of HBM
#                            bandwidth, extend attention against torch SDPA)
#   pytest_gpu               pytest -m gpu tests/engines (CUDA graphs on vs off token-exact, ...)
#   bench_engine_graphs_off  python -m pddgw.bench.engine --device cuda --cuda-graphs off --json
#   bench_engine_graphs_on   the same with --cuda-graphs on
#   pytest_kernels           pytest tests/kernels (compiled Triton on the GPU)
# Without a GPU (nvidia-smi missing or failing, or PDDGW_GPU_CHECK_DRY_RUN=1) the GPU steps are reported
# as skipped: the dry run, which tests/test_gpu_check.py runs in the suite so that this script cannot rot.
#
# PDDGW_GPU_PYTHON: the interpreter (default python3, which on the GPU machine holds its torch).
# PDDGW_GPU_WHEELS: the folder of carried wheels (default .gpu-wheels in the repo).
# PDDGW_GPU_BUDGET_S: the whole run's bound in seconds (default 480); each step runs under `timeout`,
# capped by what is left of it.  The report holds timestamps, the GPU (nvidia-smi), each step's status
# (passed, failed, timeout, skipped), rc, seconds, JSON output (or its text tail) and, for pytest steps,
# the test counts.  Exit: 0 when every step passed, 1 when one failed or ran out of time, 2 when there
# is no GPU and every step that could run passed.
set -uo pipefail

here=${BASH_SOURCE[0]%/*}
[[ $here == "${BASH_SOURCE[0]}" ]] && here=.
repo=$(cd "$here/.." && pwd)
report=${1:-gpu_report.json}
[[ $report == /* ]] || report=$PWD/$report
budget=${PDDGW_GPU_BUDGET_S:-480}
py=${PDDGW_GPU_PYTHON:-python3}
start=$SECONDS
steps=$(mktemp -d)
trap 'rm -rf "$steps"' EXIT
cd "$repo" || exit 1
date -u +%Y-%m-%dT%H:%M:%SZ > "$steps/started"

gpu=1
if [[ ${PDDGW_GPU_CHECK_DRY_RUN:-0} == 1 ]]; then
    gpu=0; echo "dry run (PDDGW_GPU_CHECK_DRY_RUN=1)" > "$steps/gpu"
elif ! command -v nvidia-smi >/dev/null 2>&1; then
    gpu=0; echo "no NVIDIA GPU: nvidia-smi not found on PATH" > "$steps/gpu"
elif ! nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$steps/gpu" 2>&1; then
    gpu=0; sed -i '1s/^/no usable GPU: nvidia-smi failed: /' "$steps/gpu"
fi
echo "gpu_check: $(head -1 "$steps/gpu")" >&2

export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

order=()
failed=0
# skip NAME REASON: record a step that was not run.
skip() {
    order+=("$1")
    echo skipped > "$steps/$1.status"; echo 0 > "$steps/$1.s"; : > "$steps/$1.err"
    echo "$2" > "$steps/$1.out"
    echo "gpu_check: $1 skipped: $2" >&2
}
# run_step NAME MAX_SECONDS CMD...: runs CMD under timeout, records status / rc / seconds / output.
run_step() {
    local name=$1 max=$2; shift 2
    local left=$(( budget - (SECONDS - start) - 10 ))   # 10 s to write the report
    local limit=$(( max < left ? max : left ))
    if (( limit < 5 )); then
        skip "$name" "out of time"; echo timeout > "$steps/$name.status"; failed=1
        return 1
    fi
    order+=("$name")
    echo "gpu_check: $name (timeout ${limit}s): $*" >&2
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$steps/$name.out" 2> "$steps/$name.err"
    local rc=$?
    echo "$rc" > "$steps/$name.rc"; echo $(( SECONDS - t0 )) > "$steps/$name.s"
    local status=passed
    (( rc == 124 || rc == 137 )) && status=timeout
    (( rc != 0 && rc != 124 && rc != 137 )) && status=failed
    echo "$status" > "$steps/$name.status"
    echo "gpu_check: $name $status (rc=$rc) in $(( SECONDS - t0 ))s" >&2
    [[ $status == passed ]] || { failed=1; tail -3 "$steps/$name.err" >&2; return 1; }
}

ready=1
wheels=${PDDGW_GPU_WHEELS:-$repo/.gpu-wheels}
if compgen -G "$wheels/*.whl" > /dev/null; then
    run_step wheels 90 "$py" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
        --disable-pip-version-check --target "$steps/site" "$wheels"/*.whl || ready=0
    export PYTHONPATH=$PYTHONPATH:$steps/site
else
    skip wheels "no wheels in $wheels: the interpreter's own packages are used"
fi
preflight=(scripts/gpu_preflight.py)
(( gpu )) && preflight+=(--require-cuda)
if (( ready )); then run_step preflight 60 "$py" "${preflight[@]}" || ready=0
else skip preflight "an earlier step failed"; fi
if (( ready )); then
    run_step collect 90 "$py" -m pytest -q --collect-only tests/engines tests/kernels -p no:cacheprovider || ready=0
else skip collect "an earlier step failed"; fi

gpu_tests=(-p no:cacheprovider --junitxml)
gpu_steps=(bench_kernels pytest_gpu bench_engine_graphs_off bench_engine_graphs_on pytest_kernels)
if (( ! ready )); then
    for s in "${gpu_steps[@]}"; do skip "$s" "an earlier step failed"; done
elif (( ! gpu )); then
    for s in "${gpu_steps[@]}"; do skip "$s" "no GPU"; done
else
    run_step bench_kernels 90 "$py" -m pddgw.bench.kernels --json
    run_step pytest_gpu 120 "$py" -m pytest -q -m gpu tests/engines "${gpu_tests[@]}" "$steps/pytest_gpu.xml"
    run_step bench_engine_graphs_off 90 "$py" -m pddgw.bench.engine --device cuda --cuda-graphs off --repeats 2 --json
    run_step bench_engine_graphs_on 90 "$py" -m pddgw.bench.engine --device cuda --cuda-graphs on --repeats 2 --json
    run_step pytest_kernels 150 "$py" -m pytest -q tests/kernels "${gpu_tests[@]}" "$steps/pytest_kernels.xml"
fi

date -u +%Y-%m-%dT%H:%M:%SZ > "$steps/finished"
# The report is written by this shell's python3 (the standard library only), not the checked one.
python3 - "$steps" "$report" "$gpu" "$failed" "${order[@]}" <<'PY'
import json, pathlib, re, sys
import xml.etree.ElementTree as ET

steps, report, gpu, failed, names = (pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1",
                                     sys.argv[4] == "1", sys.argv[5:])
read = lambda p: (steps / p).read_text(errors="replace") if (steps / p).exists() else ""


def tests(name):
    """pytest's counts: {collected} of a --collect-only run, {passed, failed, errors, skipped} from junit XML."""
    if name == "collect":
        found = re.search(r"(\d+) tests? collected", read(f"{name}.out"))
        return {"collected": int(found.group(1))} if found else None
    xml = steps / f"{name}.xml"
    if not xml.exists():
        return None
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, fail, err, skip = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    return {"passed": total - fail - err - skip, "failed": fail, "errors": err, "skipped": skip}


out = {"started": read("started").strip(), "finished": read("finished").strip(),
       "gpu": gpu, "nvidia_smi": read("gpu").strip(),
       "result": "failed" if failed else ("passed" if gpu else "dry-run"), "steps": []}
for n in names:
    text = read(f"{n}.out")
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    rc = read(f"{n}.rc").strip()
    out["steps"].append({"name": n, "status": read(f"{n}.status").strip(), "rc": int(rc) if rc else None,
                         "seconds": int(read(f"{n}.s") or 0), "json": data, "tests": tests(n),
                         "stdout_tail": None if data is not None else text[-(300 if n == "collect" else 4000):],
                         "stderr_tail": read(f"{n}.err")[-3000:]})
pathlib.Path(report).write_text(json.dumps(out, indent=2) + "\n")
width = max(len(s["name"]) for s in out["steps"])
for s in out["steps"]:
    print(f"  {s['name']:<{width}}  {s['status']:<8} {s['seconds']:>4} s", file=sys.stderr)
print(f"gpu_check: {out['result']}; report in {report}", file=sys.stderr)
PY
(( failed )) && exit 1
(( gpu )) || exit 2
exit 0
