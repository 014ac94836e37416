"""Compile every kernel variant a launch plan picks for an H200 (sm_90), without a GPU.

Run as a script (the kernels must be decorated without TRITON_INTERPRET); prints one
JSON line per variant: name, shared memory bytes, registers, spill (local) bytes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pddgw.kernels import triton_ops as T  # noqa: E402

_TY = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_TARGET = GPUTarget("cuda", 90, 32)
_H200_SMS = 132


def _compile(fn, pointers: dict[str, str], floats: set[str], constexprs: dict, num_warps: int,
             num_stages: int):
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in floats:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=_TARGET,
                          options={"num_warps": num_warps, "num_stages": num_stages})


def _usage(kernel) -> tuple[int, int]:
    """(registers, local spill bytes) from the cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    regs = int(re.search(r"REG:(\d+)", text).group(1))
    local = int(re.search(r"LOCAL:(\d+)", text).group(1))
    return regs, local


def shapes():
    """(name, q_heads, kv_heads, head_dim, dtype, is_decode, tokens, seqs, max_blocks)."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for hq, hkv, d in ((32, 8, 128), (32, 32, 128), (32, 4, 64)):
            yield ("decode", hq, hkv, d, dtype, True, 1, 1, 4096)       # split
            yield ("decode", hq, hkv, d, dtype, True, 256, 256, 64)     # no split
            yield ("extend-k16", hq, hkv, d, dtype, False, 16, 1, 4096)
            yield ("extend-k512", hq, hkv, d, dtype, False, 512, 1, 4096)
    yield ("extend-d256", 16, 8, 256, torch.bfloat16, False, 512, 1, 1024)


def main() -> None:
    seen = set()
    for name, hq, hkv, d, dtype, is_decode, tokens, seqs, max_blocks in shapes():
        plan = T.plan_attention(num_tokens=tokens, num_seqs=seqs, q_heads=hq, kv_heads=hkv,
                                head_dim=d, block_size=16, max_blocks=max_blocks, dtype=dtype,
                                is_decode=is_decode, num_sms=_H200_SMS, interpret=False)
        const = dict(GROUP=hq // hkv, NUM_Q_HEADS=hq, HEAD_DIM=d, D_P2=max(16, T._pow2(d)),
                     BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_SIZE=16,
                     IS_DECODE=is_decode, SPLIT=plan.num_splits > 1, DOT_F32=plan.dot_f32,
                     LOG_B=plan.log_b)
        key = tuple(sorted(const.items())) + (plan.num_warps, plan.num_stages, dtype)
        if key in seen:
            continue
        seen.add(key)
        ty = _TY[dtype]
        ptrs = dict(Q=f"*{ty}", K=f"*{ty}", V=f"*{ty}", BLOCK_TABLES="*i32", SEQ_LENS="*i32",
                    CU_Q="*i32", CU_TILES="*i32", OUT=f"*{ty}", MID_O="*fp32", MID_LSE="*fp32")
        k = _compile(T._attn_fwd_kernel, ptrs, {"qk_scale"}, const, plan.num_warps,
                     plan.num_stages)
        regs, local = _usage(k)
        print(json.dumps(dict(kernel="attn_fwd", shape=name, hq=hq, hkv=hkv, d=d, dtype=ty,
                              block_m=plan.block_m, block_n=plan.block_n,
                              warps=plan.num_warps, splits=plan.num_splits,
                              shared=k.metadata.shared, regs=regs, local=local)), flush=True)
        if plan.num_splits > 1:
            hb = min(T._pow2(hq), plan.merge_heads)
            ptrs = dict(MID_O="*fp32", MID_LSE="*fp32", OUT=f"*{ty}", SEQ_LENS="*i32",
                        CU_Q="*i32")
            const = dict(NUM_Q_HEADS=hq, HEAD_DIM=d, D_P2=T._pow2(d), HEADS_PER_PROG=hb,
                         IS_DECODE=is_decode, LOG_B=plan.log_b)
            k = _compile(T._merge_splits_kernel, ptrs, set(), const, 4, 2)
            regs, local = _usage(k)
            print(json.dumps(dict(kernel="merge", hq=hq, d=d, dtype=ty, shared=k.metadata.shared,
                                  regs=regs, local=local)), flush=True)
    for ty in ("bf16", "fp32"):
        ptrs = dict(K=f"*{ty}", V=f"*{ty}", K_CACHE=f"*{ty}", V_CACHE=f"*{ty}", SLOTS="*i64")
        const = dict(KV_HEADS=8, HEAD_DIM=128, H_P2=8, D_P2=128, BLOCK_SIZE=16)
        k = _compile(T._store_kv_kernel, ptrs, set(), const, 4, 2)
        regs, local = _usage(k)
        print(json.dumps(dict(kernel="store_kv", dtype=ty, shared=k.metadata.shared, regs=regs,
                              local=local)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
