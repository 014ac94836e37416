"""Compile the launches the Triton wrappers decide for H200-sized calls, for sm_90, offline.

No GPU needed: Triton lowers to PTX and runs its bundled ptxas.  Each launch is
specialized exactly as the runtime would specialize it (argument types, 16-byte
alignment, ints equal to 1), so what compiles here is what the GPU will compile.
Run as a script, because the kernels must be decorated without TRITON_INTERPRET:

    python tests/kernels/sm90_compile.py [--full]

prints one JSON line per distinct compiled kernel: shared memory bytes,
registers, local (spill) bytes, and whether the main loop uses tensor-core ops.
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
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pddgw.kernels import triton_ops as T  # noqa: E402

H200_SMS = 132
_TARGET = GPUTarget("cuda", 90, 32)


def compile_launch(launch: T.Launch):
    fn = launch.kernel
    sig: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list] = {}
    constexprs: dict[str, object] = dict(launch.constexprs)
    plain = set(fn.do_not_specialize)
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        specialize = name not in plain and i not in plain
        ty, attr = native_specialize_impl(BaseBackend, launch.args[i], False, specialize,
                                          specialize)
        if ty == "constexpr":                    # the runtime folds ints equal to 1
            constexprs[name] = attr
            sig[name] = "constexpr"
            continue
        sig[name] = ty
        if attr == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=_TARGET, options={"num_warps": launch.num_warps,
                                                        "num_stages": launch.num_stages})


def resource_usage(kernel) -> dict[str, int]:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    return {"regs": int(re.search(r"REG:(\d+)", text).group(1)),
            "local": int(re.search(r"LOCAL:(\d+)", text).group(1)),
            "shared": kernel.metadata.shared}


def h200_cases(full: bool):
    """(label, q_heads, kv_heads, head_dim, dtype, q_lens or None for decode, context)."""
    dtypes = (torch.bfloat16, torch.float16, torch.float32) if full else (torch.bfloat16,
                                                                          torch.float32)
    models = ((32, 8, 128), (32, 32, 128), (32, 4, 64)) if full else ((32, 8, 128),)
    for dtype in dtypes:
        for hq, hkv, d in models:
            yield "decode-b1-64k", hq, hkv, d, dtype, None, [65536]
            yield "decode-b256-1k", hq, hkv, d, dtype, None, [1024] * 256
            yield "extend-k16-64k", hq, hkv, d, dtype, [16], [65536]
            yield "extend-k512-8k", hq, hkv, d, dtype, [512], [8192]
            yield "extend-mixed", hq, hkv, d, dtype, [1] * 40 + [7, 216], [3000] * 42
    if full:
        yield "extend-d256", 16, 8, 256, torch.bfloat16, [512], [4096]


def case_launches(hq, hkv, d, dtype, q_lens, ctx, block_size=16):
    b = len(ctx)
    max_blocks = -(-max(ctx) // block_size)
    cache = torch.zeros(4, block_size, hkv, d, dtype=dtype)
    tables = torch.zeros(b, max_blocks, dtype=torch.int32)
    seq_lens = torch.tensor(ctx, dtype=torch.int32)
    t = b if q_lens is None else sum(q_lens)
    q = torch.zeros(t, hq, d, dtype=dtype)
    cu = None
    if q_lens is not None:
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    _, launches = T.attention_launches(q, cache, cache, tables, seq_lens, cu, d ** -0.5,
                                       num_sms=H200_SMS, interpret=False)
    return launches


def main(argv: list[str]) -> int:
    full = "--full" in argv
    seen: set = set()
    todo: list[tuple[str, T.Launch]] = []
    for label, hq, hkv, d, dtype, q_lens, ctx in h200_cases(full):
        for launch in case_launches(hq, hkv, d, dtype, q_lens, ctx):
            todo.append((f"{label}/{hq}x{hkv}x{d}/{str(dtype)[6:]}", launch))
    for dtype in (torch.bfloat16, torch.float32):
        kv = torch.zeros(8, 8, 128, dtype=dtype)
        cache = torch.zeros(4, 16, 8, 128, dtype=dtype)
        todo.append((f"store_kv/{str(dtype)[6:]}",
                     T.store_kv_launch(kv, kv, cache, cache, torch.zeros(8, dtype=torch.int64))))
    for label, launch in todo:
        key = (launch.kernel.__name__, tuple(sorted(launch.constexprs.items())), launch.num_warps,
               tuple(str(a.dtype) for a in launch.args if isinstance(a, torch.Tensor)))
        if key in seen:
            continue
        seen.add(key)
        kernel = compile_launch(launch)
        ttgir = kernel.asm["ttgir"]
        tiles = {k: v for k, v in launch.constexprs.items() if k in ("BLOCK_M", "BLOCK_N")}
        row = {"case": label, "kernel": launch.kernel.__name__, "warps": launch.num_warps,
               "stages": launch.num_stages, "grid": launch.grid, **tiles,
               **resource_usage(kernel),
               "mma": any(op in ttgir for op in ("warp_group_dot", "nvidia_mma")),
               "async_copy": "async_copy_global_to_local" in ttgir}
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
