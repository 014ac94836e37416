#!/usr/bin/env bash
# Is the carried wheel set complete, and does pddgw work on the GPU machine's torch 2.11 / triton 3.6?
# Checked here, on the CPU, in a stand-in for that machine: a Python 3.12 venv (.venv-gpu-standin,
# ignored) holding only the packages scripts/gpu_machine.txt lists (PyPI's torch 2.11.0+cu130 running
# on the CPU stands in for that machine's identical build).
#
#   scripts/gpu_wheels.sh && scripts/gpu_standin.sh      (PDDGW_PY312: a Python 3.12, else
#                                                         python3.12 or pyenv's)
#
#   1. scripts/gpu_check.sh's dry run on that venv's python: the carried .gpu-wheels installed with
#      --no-index, the preflight (versions, every import) and the collection of the GPU tests; must
#      exit 2 (no GPU) with every step that can run here passed.
#   2. tests/engines on torch 2.11 with exactly that machine's packages and the carried wheels.
#   3. tests/kernels: the Triton kernels in triton 3.6's interpreter.  That interpreter calls int() on
#      one-element arrays, which numpy >= 2.4 refuses (its 1.25 deprecation ended; triton 3.7 fixed
#      it), so this step shadows the machine's numpy 2.5.2 with numpy 2.3.5 (in .venv-gpu-standin/np);
#      on the GPU machine the kernels run compiled and never meet the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
py312=${PDDGW_PY312:-}
if [[ -z $py312 ]]; then
    for cand in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
        if "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then py312=$cand; break; fi
    done
    [[ -n $py312 ]] || { echo "gpu_standin: no Python 3.12 found: set PDDGW_PY312" >&2; exit 1; }
fi
venv=.venv-gpu-standin
if [[ ! -x $venv/bin/python ]] || ! cmp -s scripts/gpu_machine.txt "$venv/gpu_machine.txt"; then
    rm -rf "$venv"
    "$py312" -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check -r scripts/gpu_machine.txt 2>&1 \
        | grep -v '^WARNING: Location' || true
    "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps --target "$venv/np" numpy==2.3.5 \
        2>&1 | grep -v '^WARNING: Location' || true
    cp scripts/gpu_machine.txt "$venv/gpu_machine.txt"
fi
if ! compgen -G ".gpu-wheels/*.whl" > /dev/null; then
    echo "gpu_standin: no .gpu-wheels: run scripts/gpu_wheels.sh first" >&2; exit 1
fi
rm -rf "$venv/carried"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --no-compile \
    --target "$venv/carried" .gpu-wheels/*.whl

echo "gpu_standin: 1. gpu_check.sh dry run" >&2
rc=0
PDDGW_GPU_PYTHON=$PWD/$venv/bin/python bash scripts/gpu_check.sh "$venv/dry_run.json" || rc=$?
if (( rc != 2 )); then
    echo "gpu_standin: gpu_check.sh exited $rc, not 2 (dry run, all passed): see $venv/dry_run.json" >&2; exit 1
fi
echo "gpu_standin: 2. tests/engines on $("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)')" >&2
PYTHONPATH=$PWD:$PWD/$venv/carried "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/engines
echo "gpu_standin: 3. tests/kernels in triton $("$venv/bin/python" -c 'import triton; print(triton.__version__)')'s interpreter" >&2
PYTHONPATH=$PWD/$venv/np:$PWD:$PWD/$venv/carried "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/kernels
echo "gpu_standin: the carried wheels are complete and pddgw passes on the GPU machine's versions" >&2
