"""The CPU backend's C decode kernel (pddgw.kernels.cpu_ops) against the loop oracle,
its batch and thread invariance, its refusals, and how it is built and selected."""

from __future__ import annotations

import fnmatch
import os
import tomllib
from pathlib import Path

import pytest
import torch
from .kernel_cases import assert_close, cu_lens, loop_decode, loop_extend, make_paged, make_q

import pddgw.kernels as K
from pddgw.engines.kv_pool import KVPool
from pddgw.kernels import cpu_build, cpu_linear, cpu_ops, cpu_pointwise, reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def _built():
    assert cpu_ops.available(), "the CPU attention kernel did not build (a C compiler with OpenMP is needed)"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size,head_dim", [(4, 16), (16, 64), (32, 48)])
def test_decode_matches_loop(dtype, group, block_size, head_dim):
    # head_dim 64 takes the AVX512-BF16 path for bfloat16 where the CPU has it, 16 and 48 the portable one.
    seq_lens = [1, block_size - 1, block_size, 2 * block_size + 3, 5, 7 * block_size]
    p = make_paged(seq_lens, kv_heads=2, head_dim=head_dim, block_size=block_size, dtype=dtype,
                   strided_table=block_size == 4)
    q = make_q(len(seq_lens), 2 * group, head_dim, dtype)
    out = cpu_ops.paged_decode_attention(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, 0.3)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, loop_decode(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, 0.3), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_pool_s_block_major_views_are_read_in_place(dtype):
    """The CPU pool's caches are views with a block stride of every layer's K and V: the kernel
    reads them where they are (equal to the same pages copied out contiguously)."""
    pool = KVPool(3, 12, 8, 2, 64, dtype, "cpu")
    gen = torch.Generator().manual_seed(3)
    pool.data.copy_(torch.randn(pool.data.shape, generator=gen).to(dtype))
    k, v = pool.caches[1]
    assert not k.is_contiguous()
    table = torch.tensor([[4, 9, 1], [7, 0, 11]], dtype=torch.int32)
    lens = torch.tensor([19, 9], dtype=torch.int32)
    q = make_q(2, 8, 64, dtype)
    out = cpu_ops.paged_decode_attention(q, k, v, table, lens, 0.125)
    same = cpu_ops.paged_decode_attention(q, k.contiguous(), v.contiguous(), table, lens, 0.125)
    assert torch.equal(out, same)
    assert_close(out, loop_decode(q, k, v, table, lens, 0.125), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_sequence_s_output_does_not_depend_on_its_batch_or_the_threads(dtype):
    seq_lens = [37, 5, 130, 64]
    p = make_paged(seq_lens, kv_heads=3, head_dim=64, block_size=16, dtype=dtype)
    q = make_q(len(seq_lens), 9, 64, dtype)
    batch = cpu_ops.paged_decode_attention(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, 0.125)
    for b in range(len(seq_lens)):
        alone = cpu_ops.paged_decode_attention(q[b:b + 1], p.k_cache, p.v_cache, p.block_tables[b:b + 1],
                                               p.seq_lens[b:b + 1], 0.125)
        assert torch.equal(alone[0], batch[b])
    torch.set_num_threads(2)
    assert torch.equal(cpu_ops.paged_decode_attention(q, p.k_cache, p.v_cache, p.block_tables,
                                                      p.seq_lens, 0.125), batch)


@pytest.mark.parametrize("dtype", [torch.float64, *DTYPES], ids=str)
def test_an_extend_s_generated_rows_are_the_decode_kernel_s_bits(dtype):
    """Each generated token's row (the last `generated[b]` of sequence b) is the decode kernel's
    result for that token alone, its sequence ending there: a decode beside a prefill and tokens
    relayed before a handoff attend as they did when decoded.  The prompts' rows, one-token
    chunks included, are what an extend of them alone gives (the reference's, float64 wholly,
    or in bfloat16 on AMX the prompt kernel's)."""
    # (cached prefix, new tokens, of them generated): a prefill chunk, a decode, an empty entry,
    # a prompt's last token, a handoff's catch-up (5 prompt tokens, then 4 relayed), all relayed.
    cases = [(0, 9, 0), (10, 1, 1), (3, 0, 0), (21, 1, 0), (30, 9, 4), (12, 3, 3)]
    p = make_paged([a + k for a, k, _ in cases], kv_heads=2, head_dim=64, block_size=8, dtype=dtype)
    cu = cu_lens([k for _, k, _ in cases])
    gen = torch.tensor([g for _, _, g in cases], dtype=torch.int32)
    q = make_q(int(cu[-1]), 6, 64, dtype)
    caches = (p.k_cache, p.v_cache)
    out = cpu_ops.extend_attention(q, *caches, p.block_tables, cu, p.seq_lens, 0.25, generated=gen)
    assert_close(out, loop_extend(q, *caches, p.block_tables, cu, p.seq_lens, 0.25), dtype)
    ref = reference.extend_attention(q, *caches, p.block_tables, cu, p.seq_lens, 0.25)
    if dtype == torch.float64:
        assert torch.equal(out, ref)
        return
    prompt_rows = torch.cat([torch.arange(int(cu[b]), int(cu[b]) + k - g) for b, (_, k, g) in enumerate(cases)])
    prompts = cpu_ops.extend_attention(q[prompt_rows], *caches, p.block_tables,
                                       cu_lens([k - g for _, k, g in cases]), p.seq_lens - gen, 0.25)
    if dtype != torch.bfloat16:
        assert torch.equal(out[prompt_rows], ref[prompt_rows])
    for b, (prefix, k, g) in enumerate(cases):
        for j in range(k):
            row = int(cu[b]) + j
            if j < k - g:
                assert torch.equal(out[row], prompts[int((prompt_rows == row).nonzero())]), (b, j)
                continue
            alone = cpu_ops.paged_decode_attention(q[row : row + 1], *caches, p.block_tables[b : b + 1],
                                                   torch.tensor([prefix + j + 1], dtype=torch.int32), 0.25)
            assert torch.equal(out[row], alone[0]), (b, j)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_without_generated_rows_an_extend_is_the_reference_s(dtype):
    # (bfloat16 prompt rows go to the AMX prompt kernel where there is one: test_cpu_prompt_attention.py)
    p = make_paged([5, 17], kv_heads=1, head_dim=32, block_size=4, dtype=dtype)
    q = make_q(2, 2, 32, dtype)
    args = (q, p.k_cache, p.v_cache, p.block_tables, cu_lens([1, 1]), p.seq_lens, 0.5)
    want = reference.extend_attention(*args)
    assert torch.equal(cpu_ops.extend_attention(*args), want)
    assert torch.equal(cpu_ops.extend_attention(*args, generated=torch.zeros(2, dtype=torch.int32)), want)


@pytest.mark.parametrize("ops", [reference, cpu_ops], ids=lambda m: m.__name__.rsplit(".", 1)[-1])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_whole_prompt_attends_over_its_new_kv_with_the_pages_bits(ops, dtype):
    """Sequences 0 and 2 are whole prompts (their pages hold exactly the new rows); sequence 1
    extends a cached prefix by 5 tokens (the last of them generated): only its pages serve it."""
    lens, q_lens = [37, 70, 90], [37, 5, 90]
    p = make_paged(lens, kv_heads=3, head_dim=64, block_size=16, dtype=dtype)
    bs = p.k_cache.shape[1]

    def rows(cache):                                   # the new tokens' rows, read from their pages
        return torch.cat([torch.stack([cache[p.block_tables[b, i // bs], i % bs] for i in range(n - q, n)])
                          for b, (n, q) in enumerate(zip(lens, q_lens))])

    new_kv = (rows(p.k_cache).float(), rows(p.v_cache).float())    # in another dtype: converted as stored
    q = make_q(sum(q_lens), 9, 64, dtype)
    args = (q, p.k_cache, p.v_cache, p.block_tables, cu_lens(q_lens), p.seq_lens, 0.125)
    gen = torch.tensor([0, 1, 0], dtype=torch.int32)
    want = ops.extend_attention(*args, generated=gen)
    assert torch.equal(ops.extend_attention(*args, generated=gen, new_kv=new_kv), want)
    zeros = (torch.zeros_like(new_kv[0]), torch.zeros_like(new_kv[1]))
    got = ops.extend_attention(*args, generated=gen, new_kv=zeros)
    if ops is cpu_ops and dtype == torch.bfloat16 and cpu_ops._load_prompt() is not None:
        assert torch.equal(got, want)                                 # the prompt kernel reads the pages
        return
    assert torch.equal(got[37:42], want[37:42])                       # the extend: its pages
    assert not torch.equal(got[:37], want[:37]) and not torch.equal(got[42:], want[42:])


def test_shapes_whose_scratch_would_not_fit_the_stack_go_to_the_reference(monkeypatch):
    p = make_paged([9, 20], kv_heads=2, head_dim=16, block_size=8, dtype=torch.float32)
    q = make_q(2, 4, 16, torch.float32)
    args = (p.k_cache, p.v_cache, p.block_tables, p.seq_lens, 0.5)
    # 4 heads x 16 dims, 512-key chunks of 8-token blocks: 4 * (2*64 + 8 + 4*512 + 8*16) bytes
    assert cpu_ops._stack_bytes(4, 16, 8) == 4 * (2 * 64 + 8 + 4 * 512 + 128)
    calls = []
    real = reference.paged_decode_attention
    monkeypatch.setattr(reference, "paged_decode_attention", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(cpu_ops, "_MAX_STACK", cpu_ops._stack_bytes(4, 16, 8))
    cpu_ops.paged_decode_attention(q, *args)
    assert calls == []
    monkeypatch.setattr(cpu_ops, "_MAX_STACK", cpu_ops._stack_bytes(4, 16, 8) - 1)
    assert torch.equal(cpu_ops.paged_decode_attention(q, *args), real(q, *args))
    assert calls == [1]


def test_float64_and_mixed_dtypes_go_to_the_reference():
    p = make_paged([9, 20], kv_heads=2, head_dim=16, block_size=8, dtype=torch.float64)
    q = make_q(2, 4, 16, torch.float64)
    args = (p.k_cache, p.v_cache, p.block_tables, p.seq_lens, 0.5)
    assert torch.equal(cpu_ops.paged_decode_attention(q, *args), reference.paged_decode_attention(q, *args))
    q32 = q.float()
    assert torch.equal(cpu_ops.paged_decode_attention(q32, *args), reference.paged_decode_attention(q32, *args))


@pytest.mark.parametrize("lens,table,what", [
    ([40], [[0, 1]], "outside the table"),           # 40 tokens need 3 blocks of 16, the table has 2
    ([20], [[0, 99]], "outside the table"),          # block id past the pool's 4 blocks
    ([20], [[0, -1]], "outside the table"),
    ([0], [[0, 1]], "outside the table"),
])
def test_lengths_and_block_ids_out_of_range_are_refused(lens, table, what):
    cache = torch.zeros(4, 16, 1, 32)
    with pytest.raises(ValueError, match=what) as e:
        cpu_ops.paged_decode_attention(torch.zeros(1, 1, 32), cache, cache, torch.tensor(table, dtype=torch.int32),
                                       torch.tensor(lens, dtype=torch.int32), 1.0)
    assert "pool (4 blocks)" in str(e.value)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_kv_copies_rows_of_a_qkv_view_into_the_pool_as_the_reference_does(dtype):
    """The model's k and v are views into its qkv rows (a row stride past the heads); the pool's
    caches are block-major views: the C copy lands every row where the reference puts it."""
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(6, (4 + 2 + 2) * 16, generator=gen).to(dtype)
    k = qkv[:, 64:96].view(6, 2, 16)
    v = qkv[:, 96:].view(6, 2, 16)
    assert k.stride(0) == 128 and not k.is_contiguous()
    slots = torch.tensor([5, -1, 0, 23, 17, 8])                    # block * 8 + offset; -1: skipped
    ours, ref = KVPool(2, 3, 8, 2, 16, dtype, "cpu"), KVPool(2, 3, 8, 2, 16, dtype, "cpu")
    cpu_ops.store_kv(k, v, *ours.caches[1], slots)
    reference.store_kv(k, v, *ref.caches[1], slots)
    assert torch.equal(ours.data, ref.data)
    assert torch.equal(ours.caches[1][0][2, 7], k[3]) and torch.equal(ours.caches[1][1][2, 1], v[4])
    assert int((ours.data != 0).flatten(1).any(1).sum()) == 3     # blocks 0, 1, 2; layer 0 untouched
    assert not ours.caches[0][0].any()


def test_store_kv_refuses_a_slot_outside_the_pool():
    cache = torch.zeros(2, 4, 1, 32, dtype=torch.bfloat16)
    rows = torch.ones(2, 1, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"outside the pool \(2 blocks of 4\)"):
        cpu_ops.store_kv(rows, rows, cache, cache.clone(), torch.tensor([3, 8]))


@pytest.mark.parametrize("case", ["float64", "int32 slots", "rows in another dtype"])
def test_store_kv_leaves_what_it_does_not_take_to_the_reference(case, monkeypatch):
    dtype = torch.float64 if case == "float64" else torch.float32
    cache = torch.zeros(2, 4, 1, 8, dtype=dtype)
    rows = torch.ones(2, 1, 8, dtype=torch.bfloat16 if case == "rows in another dtype" else dtype)
    slots = torch.tensor([1, 6], dtype=torch.int32 if case == "int32 slots" else torch.int64)
    calls = []
    real = reference.store_kv
    monkeypatch.setattr(reference, "store_kv", lambda *a: calls.append(1) or real(*a))
    cpu_ops.store_kv(rows, rows, cache, cache, slots)
    assert calls == [1] and cache[0, 1].eq(1).all() and cache[1, 2].eq(1).all()


def test_an_empty_batch_is_empty():
    cache = torch.zeros(2, 16, 1, 32, dtype=torch.bfloat16)
    out = cpu_ops.paged_decode_attention(torch.zeros(0, 2, 32, dtype=torch.bfloat16), cache, cache,
                                         torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), 1.0)
    assert out.shape == (0, 2, 32)


def test_auto_on_cpu_selects_the_cpu_backend():
    assert K.get_ops("auto", "cpu") is cpu_ops
    assert K.get_ops("cpu", "cpu") is cpu_ops
    with pytest.raises(RuntimeError, match="runs on the CPU"):
        K.get_ops("cpu", "cuda:0")


def test_without_a_compiler_auto_falls_back_and_cpu_is_refused(monkeypatch):
    monkeypatch.setattr(cpu_ops, "_load", cpu_build.Once(cpu_ops._bind))      # not built yet
    monkeypatch.setattr(cpu_build, "compiler", lambda: None)
    assert K.get_ops("auto", "cpu") is reference
    with pytest.raises(RuntimeError, match="does not build here"):
        K.get_ops("cpu", "cpu")
    q = make_q(1, 2, 16, torch.float32)
    p = make_paged([5], kv_heads=1, head_dim=16, block_size=4, dtype=torch.float32)
    args = (p.k_cache, p.v_cache, p.block_tables, p.seq_lens, 0.5)
    assert torch.equal(cpu_ops.paged_decode_attention(q, *args), reference.paged_decode_attention(q, *args))


def test_a_build_is_kept_and_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("PDDGW_CACHE_DIR", str(tmp_path))
    cc = cpu_build.compiler()
    path = cpu_build.build(cpu_ops._SOURCE, cc)
    assert path.parent == tmp_path / "kernels" and path.exists()
    assert [p.name for p in path.parent.iterdir()] == [path.name]          # no temporary files left

    def no_compiling(cmd, **kw):
        assert cmd == [cc, "--version"], f"rebuilt: {cmd}"
        return real_run(cmd, **kw)

    real_run = cpu_build.subprocess.run
    monkeypatch.setattr(cpu_build.subprocess, "run", no_compiling)
    assert cpu_build.build(cpu_ops._SOURCE, cc) == path


def test_a_header_the_source_includes_is_part_of_its_build(monkeypatch, tmp_path):
    monkeypatch.setenv("PDDGW_CACHE_DIR", str(tmp_path / "cache"))
    src, header = tmp_path / "k.c", tmp_path / "k.h"
    src.write_text('#include "k.h"\nint answer(void) { return ANSWER; }\n')
    header.write_text("#define ANSWER 41\n")
    first = cpu_build.build(src, cpu_build.compiler())
    header.write_text("#define ANSWER 42\n")
    second = cpu_build.build(src, cpu_build.compiler())
    assert first != second and first.exists()
    assert cpu_build.load(src).answer() == 42


def test_every_c_source_and_header_ships_with_the_package():
    """An installed (not editable) pddgw builds its kernels from the package's own files."""
    root = Path(cpu_build.__file__).parents[2]
    with open(root / "pyproject.toml", "rb") as f:
        patterns = tomllib.load(f)["tool"]["setuptools"]["package-data"]["pddgw.kernels"]
    files = [p.name for p in Path(cpu_build.__file__).parent.iterdir() if p.suffix in (".c", ".h")]
    assert {"cpu_attention.c", "cpu_amx.h"} <= set(files)
    assert all(any(fnmatch.fnmatch(name, pat) for pat in patterns) for name in files), (files, patterns)


def test_an_unwritable_cache_falls_back_to_the_temporary_directory(monkeypatch, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")                                      # a file where the directory would be
    monkeypatch.setenv("PDDGW_CACHE_DIR", str(blocked))
    monkeypatch.setattr(cpu_build.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    path = cpu_build.build(cpu_ops._SOURCE, cpu_build.compiler())
    assert path.parent == tmp_path / "tmp" / f"pddgw-{os.getuid()}" / "kernels" and path.exists()


def test_a_failed_build_names_the_command(monkeypatch, tmp_path):
    monkeypatch.setenv("PDDGW_CACHE_DIR", str(tmp_path))
    (tmp_path / "broken.c").write_text("int f( {\n")
    with pytest.raises(RuntimeError, match="broken.c") as e:
        cpu_build.build(tmp_path / "broken.c", cpu_build.compiler())
    assert "error" in str(e.value)
    assert not list((tmp_path / "kernels").glob("*.so"))


def test_the_c_kernels_this_cpu_can_run_build_and_load():
    """A kernel that does not build logs a warning and its callers fall back to torch, and its
    tests skip: on a CPU that has what a kernel needs, its not loading is a failure."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        flags = set()
    if not {"avx512_bf16", "amx_bf16"} & flags:
        pytest.skip("no AVX-512 BF16 or AMX-BF16 on this CPU")
    assert cpu_pointwise.available() == ("avx512_bf16" in flags)
    if "amx_bf16" in flags:
        assert cpu_linear.available() and cpu_ops._load_prompt() is not None
