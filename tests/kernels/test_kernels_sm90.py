"""The GPU code paths compile for an H200 (sm_90) without a GPU.

tests/kernels/sm90_compile.py compiles, through Triton and its bundled ptxas,
exactly the launches the wrappers choose for H200-sized calls (bf16 and fp32;
decode with and without flash-decoding splits, extends of 16 and 512 tokens,
the split merge, store_kv), specialized as the runtime would.  This pins that
they compile, do not spill, fit in shared memory, and that the 16-bit kernels
use tensor cores and asynchronous copies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

HERE = Path(__file__).parent
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
H100_SMEM_PER_BLOCK = 227 * 1024


@pytest.mark.skipif(not PTXAS.exists(), reason="triton's bundled ptxas is missing")
@pytest.mark.timeout(600)
def test_h200_launches_compile_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1]), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(HERE / "sm90_compile.py")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    kernels = {r["kernel"] for r in rows}
    assert kernels == {"_attn_fwd_kernel", "_merge_splits_kernel", "_store_kv_kernel"}
    for r in rows:
        assert r["local"] == 0, r
        assert r["regs"] <= 255 and r["shared"] <= H100_SMEM_PER_BLOCK, r
        if r["kernel"] == "_attn_fwd_kernel" and not r["case"].endswith("float32"):
            assert r["mma"] and r["async_copy"], r
    splits = {r["grid"][2] for r in rows if r["kernel"] == "_attn_fwd_kernel"}
    assert 1 in splits and max(splits) > 1
