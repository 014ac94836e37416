"""Preflight of scripts/gpu_check.sh: the interpreter, torch and triton versions, and every import a GPU step needs.

    python scripts/gpu_preflight.py [--require-cuda]

Prints one JSON object (versions, CUDA device) and exits 0; or prints one line naming what is missing or too
old and exits 1, before any GPU time is spent on a step that would fail on it.  The minimum versions are
those the GPU machine has and that pddgw's engine and kernel tests pass on (torch 2.11, triton 3.6:
scripts/gpu_standin.sh runs them there on the CPU).
"""

from __future__ import annotations

import importlib
import json
import platform
import sys

MIN_PYTHON = (3, 11)
MIN_TORCH = (2, 11)
MIN_TRITON = (3, 6)
# What the steps import beyond the standard library: pddgw's own modules pull in the runtime
# dependencies (orjson, structlog, numpy, safetensors, tokenizers, jinja2, prometheus_client, aiohttp).
MODULES = ("orjson", "structlog", "cryptography", "numpy", "safetensors", "tokenizers", "jinja2",
           "prometheus_client", "aiohttp", "transformers", "hypothesis", "pytest", "pytest_timeout",
           "pddgw", "pddgw.cli", "pddgw.deploy.keys", "pddgw.engines.torch_engine", "pddgw.engines.cuda_graphs",
           "pddgw.kernels.triton_ops", "pddgw.bench.kernels", "pddgw.bench.engine")


def _release(version: str) -> tuple[int, ...]:
    """(2, 11, 0) of '2.11.0+cu130'."""
    out = []
    for part in version.split("+")[0].split("."):
        digits = "".join(c for c in part if c.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def _fail(msg: str) -> None:
    print(f"gpu_check: {msg}", file=sys.stderr)
    raise SystemExit(1)


def main(argv: list[str]) -> None:
    require_cuda = "--require-cuda" in argv
    if sys.version_info[:2] < MIN_PYTHON:
        _fail(f"pddgw needs Python >= {'.'.join(map(str, MIN_PYTHON))}, this is {platform.python_version()}")
    try:
        import torch
    except ImportError as e:
        _fail(f"torch does not import ({e}); pddgw needs torch >= {'.'.join(map(str, MIN_TORCH))}")
    if _release(torch.__version__) < MIN_TORCH:
        _fail(f"pddgw needs torch >= {'.'.join(map(str, MIN_TORCH))}, this is {torch.__version__}")
    triton_version = None
    if platform.system() == "Linux" and platform.machine() == "x86_64":
        try:
            import triton
        except ImportError:
            _fail(f"triton does not import; pddgw's kernels need triton >= {'.'.join(map(str, MIN_TRITON))}")
        triton_version = triton.__version__
        if _release(triton_version) < MIN_TRITON:
            _fail(f"pddgw needs triton >= {'.'.join(map(str, MIN_TRITON))}, this is {triton_version}")
    missing = []
    for name in MODULES:
        try:
            importlib.import_module(name)
        except ImportError as e:
            missing.append(f"{name} ({e})")
    if missing:
        _fail("missing: " + "; ".join(missing) + " (carry the wheels of scripts/gpu_wheels.sh in .gpu-wheels)")
    cuda = torch.cuda.is_available()
    if require_cuda and not cuda:
        _fail(f"torch {torch.__version__} sees no CUDA device")
    print(json.dumps({"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                      "triton": triton_version, "cuda_available": cuda,
                      "device": torch.cuda.get_device_name(0) if cuda else None}))


if __name__ == "__main__":
    main(sys.argv[1:])
