"""CUDA graphs for decode steps (pddgw/engines/cuda_graphs.py).

On CPU: bucket choice, padding, static-buffer fills, and the whole runner with
`graphs=False` (the recorded forward is a plain callable over the same static
buffers) generating exactly what the eager engine does.  With CUDA: the engine
with `cuda_graphs = true` against the same engine without, token for token.
"""

from __future__ import annotations

import random

import pytest
import torch

from pddgw.config import ConfigError, EngineConfig, load_config
from pddgw.engines.attention import AttnMetadata
from pddgw.engines.cuda_graphs import CudaGraphRunner, StaticDecodeInputs, bucket_sizes, pick_bucket
from pddgw.engines.torch_engine import TorchEngine
from pddgw.engines.weights import build_tiny
from pddgw.kernels import reference

from .conftest import make_engine, req, run_to_end


# ---- buckets -------------------------------------------------------------------------

def test_bucket_sizes():
    assert bucket_sizes(1) == (1,)
    assert bucket_sizes(3) == (1, 2, 3)
    assert bucket_sizes(8) == (1, 2, 4, 8)
    assert bucket_sizes(32) == (1, 2, 4, 8, 16, 24, 32)
    assert bucket_sizes(70) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 70)
    assert bucket_sizes(128) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128)
    big = bucket_sizes(4096)
    assert big[-1] == 512 and big[-3:] == (448, 480, 512)
    assert list(big) == sorted(set(big))
    with pytest.raises(ValueError):
        bucket_sizes(0)


def test_pick_bucket():
    buckets = (1, 2, 4, 8, 16, 24)
    assert [pick_bucket(buckets, b) for b in (1, 2, 3, 4, 5, 8, 9, 17, 24)] == [1, 2, 4, 4, 8, 8, 16, 24, 24]
    assert pick_bucket(buckets, 25) is None


# ---- static buffers -------------------------------------------------------------------

def _meta(slots, tables, seq_lens) -> AttnMetadata:
    b = len(slots)
    return AttnMetadata(slot_mapping=torch.tensor(slots, dtype=torch.int64),
                        block_tables=torch.tensor(tables, dtype=torch.int32),
                        cu_q_lens=torch.arange(b + 1, dtype=torch.int32),
                        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), is_decode=True,
                        ops=reference)


def test_static_fill_pads_the_rest_of_the_bucket():
    st = StaticDecodeInputs(rows=8, max_blocks=5, device=torch.device("cpu"), ops=reference)
    m8 = st.meta(8)
    ptrs = [t.data_ptr() for t in (m8.slot_mapping, m8.block_tables, m8.seq_lens)]
    # Six rows, tables 3 wide, into bucket 8.
    st.fill(torch.arange(10, 16), torch.arange(20, 26),
            _meta([40 + i for i in range(6)], [[1, 2, 3]] * 6, [21 + i for i in range(6)]), 8)
    assert st.input_ids[:6].tolist() == list(range(10, 16))
    assert st.positions[:6].tolist() == list(range(20, 26))
    assert st.slot_mapping.tolist() == [40, 41, 42, 43, 44, 45, -1, -1]
    assert st.seq_lens.tolist() == [21, 22, 23, 24, 25, 26, 1, 1]
    assert st.block_tables[:6, :3].tolist() == [[1, 2, 3]] * 6
    # Then three rows into bucket 4: row 3 is padding again (no KV write, one key), whatever
    # the previous step left there; tables narrower than before keep stale columns.
    st.fill(torch.tensor([7, 8, 9]), torch.tensor([1, 2, 3]),
            _meta([5, 6, 7], [[9, 8], [7, 6], [5, 4]], [2, 3, 4]), 4)
    assert st.slot_mapping[:4].tolist() == [5, 6, 7, -1]
    assert st.seq_lens[:4].tolist() == [2, 3, 4, 1]
    assert st.block_tables[:3].tolist() == [[9, 8, 3, 0, 0], [7, 6, 3, 0, 0], [5, 4, 3, 0, 0]]
    # The views a graph captured are the same storage every step.
    assert [t.data_ptr() for t in (st.meta(8).slot_mapping, st.meta(8).block_tables,
                                   st.meta(8).seq_lens)] == ptrs
    assert st.meta(4).block_tables.shape == (4, 5) and st.meta(4).is_decode


def test_static_fits():
    st = StaticDecodeInputs(rows=4, max_blocks=3, device=torch.device("cpu"), ops=reference)
    ok = _meta([1, 2], [[1, 2, 3]] * 2, [5, 6])
    assert st.fits(torch.tensor([1, 2]), ok)
    assert not st.fits(torch.arange(5), _meta([1] * 5, [[1]] * 5, [1] * 5))          # > rows
    assert not st.fits(torch.tensor([1, 2]), _meta([1, 2], [[1, 2, 3, 4]] * 2, [5, 6]))   # too wide
    mixed = AttnMetadata(ok.slot_mapping, ok.block_tables, ok.cu_q_lens, ok.seq_lens, False, reference)
    assert not st.fits(torch.tensor([1, 2]), mixed)


def test_padding_rows_leave_the_kv_pool_alone():
    """A replay of a bucket with padding rows writes exactly the real rows' slots."""
    model = build_tiny(0, torch.float64, "cpu")
    eng = make_engine(model, num_blocks=16, block_size=4, max_num_seqs=8)
    runner = CudaGraphRunner(model, eng.pool.caches, reference, max_num_seqs=8,
                             max_blocks=eng.inputs.max_blocks, device=torch.device("cpu"), graphs=False)
    before = eng.pool.data.clone()
    runner.capture()                                   # warm-up / recording: all padding
    assert torch.equal(eng.pool.data, before)
    meta = _meta([9, 22, 35], [[2], [5], [8]], [2, 3, 4])
    runner(torch.tensor([3, 4, 5]), torch.tensor([1, 2, 3]), meta, eng.pool.caches,
           torch.arange(3))
    assert runner.num_replayed == 1
    changed = (eng.pool.data != before).flatten(1).any(1).nonzero().flatten().tolist()   # blocks
    assert changed == [2, 5, 8]


# ---- the runner in the engine (no graphs: the same buffers and buckets) -------------------

def _with_runner(engine: TorchEngine, buckets=None) -> CudaGraphRunner:
    runner = CudaGraphRunner(engine.model, engine.pool.caches, engine.ops,
                             max_num_seqs=engine.cfg.max_num_seqs, max_blocks=engine.inputs.max_blocks,
                             device=engine.device, buckets=buckets, graphs=False)
    runner.capture()
    engine.model = runner
    return runner


def _workload(engine: TorchEngine, seed: int = 3) -> dict[str, list[int]]:
    """Staggered arrivals and lengths: decode batches of changing size between prefills."""
    rng = random.Random(seed)
    for i in range(3):
        engine.add_request(req(f"a{i}", [rng.randrange(32, 127) for _ in range(2 + 5 * i)],
                               max_tokens=6 + 4 * i))
    out: dict[str, list[int]] = {}
    for n in range(200):
        if n == 4:
            for i in range(6):
                engine.add_request(req(f"b{i}", [rng.randrange(32, 127) for _ in range(1 + 3 * i)],
                                       max_tokens=3 + 2 * i))
        if n > 4 and not engine.has_work():
            break
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.ids)
    engine.check_integrity()
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("buckets", [None, (1, 2, 4)], ids=["default", "small-buckets"])
def test_runner_generates_what_the_eager_engine_does(dtype, buckets):
    model = build_tiny(0, dtype, "cpu")
    kw = dict(num_blocks=48, block_size=4, max_num_batched_tokens=32, max_num_seqs=8)

    def engine():
        return TorchEngine(model, model.spec, EngineConfig(**kw), dtype)

    eager = _workload(engine())
    graphed_engine = engine()
    runner = _with_runner(graphed_engine, buckets)
    assert _workload(graphed_engine) == eager
    assert runner.num_replayed > 10 and runner.num_eager > 0
    if buckets:                                        # batches of 5+ run eagerly
        assert runner.num_eager > 4


def test_runner_sampled_decoding_and_held_rows(tiny64):
    """Seeded sampling, and a held sequence whose appended tokens decode one per step
    without being sampled (logits for a subset of the batch's rows)."""
    def run(graphed: bool) -> tuple[list, CudaGraphRunner | None]:
        eng = make_engine(tiny64, num_blocks=40, block_size=4)
        runner = _with_runner(eng) if graphed else None
        if graphed:
            def spy(input_ids, positions, meta, caches, rows):
                before = runner.num_replayed
                out = runner(input_ids, positions, meta, caches, rows)
                if runner.num_replayed > before and rows.shape[0] < input_ids.shape[0]:
                    subset.append(rows.tolist())
                return out
            eng.model = spy
        for i in range(4):
            eng.add_request(req(f"s{i}", [40 + i, 50, 60 + i], max_tokens=8, temperature=0.9, seed=i))
        eng.add_request(req("h", [70, 71, 72], max_tokens=12, output_token_ids=(50,), hold=True))
        steps = []
        for n in range(100):
            if n in (3, 5):
                eng.append_tokens("h", [80 + n], final=False)   # one token: a held decode row
            if n == 7:
                eng.append_tokens("h", [83], final=True)
            if n > 7 and not eng.has_work():
                break
            steps.append([(o.request_id, o.ids, o.position, o.done) for o in eng.step()])
        eng.check_integrity()
        return steps, runner

    subset: list[list[int]] = []
    graphed, runner = run(True)
    assert graphed == run(False)[0]
    assert runner.num_replayed > 5 and subset          # replayed steps with a row not sampled


# ---- config ---------------------------------------------------------------------------

def test_cuda_graphs_on_cpu_is_refused(tmp_path):
    with pytest.raises(ValueError, match="cuda_graphs = true needs a CUDA device"):
        EngineConfig(cuda_graphs=True)
    assert EngineConfig(cuda_graphs=True, device="cuda:1").cuda_graphs
    assert not EngineConfig().cuda_graphs
    p = tmp_path / "c.toml"
    p.write_text("[engine]\ncuda_graphs = true\n")
    with pytest.raises(ConfigError, match=r"engine: cuda_graphs = true needs a CUDA device"):
        load_config(p)
    p.write_text("[engine]\ncuda_graphs = \"yes\"\n")
    with pytest.raises(ConfigError, match=r"engine\.cuda_graphs: expected bool"):
        load_config(p)


# ---- CUDA ------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _cuda_engine(model, dtype, graphs: bool, **kw) -> TorchEngine:
    cfg = EngineConfig(**{"num_blocks": 96, "block_size": 16, "max_num_batched_tokens": 64,
                          "max_num_seqs": 16, "device": "cuda", "cuda_graphs": graphs, **kw})
    return TorchEngine(model, model.spec, cfg, dtype)


@pytest.mark.gpu
@cuda
def test_cuda_graphs_token_exact():
    """Graphs on vs off (float32): the same greedy tokens, decode batches replayed, the
    rest eager.  (bfloat16 is compared by logits below: a padded batch and a full-width
    table may choose another flash-decoding split, whose rounding may flip a greedy pick.)"""
    pytest.importorskip("triton")
    model = build_tiny(0, torch.float32, "cuda")
    off = _cuda_engine(model, torch.float32, False)
    on = _cuda_engine(model, torch.float32, True)
    assert off.graphs is None and isinstance(on.model, CudaGraphRunner)
    assert on.graphs.buckets == (1, 2, 4, 8, 16)
    assert _workload(on) == _workload(off)
    assert on.graphs.num_replayed > 10 and on.graphs.num_eager > 0


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)], ids=str)
def test_cuda_graph_logits_equal_eager_logits(dtype, tol):
    """Every decode step through a replayed graph vs the eager forward on the same inputs."""
    pytest.importorskip("triton")
    model = build_tiny(0, dtype, "cuda")
    eng = _cuda_engine(model, dtype, True, max_num_seqs=8)
    runner = eng.graphs
    for i in range(5):
        eng.add_request(req(f"r{i}", list(range(40, 40 + 3 * i + 1)), max_tokens=6))
    eng.step()                                                  # prefill (eager)
    seen = []

    def spy(*args):
        eager = model(*args).clone()
        graphed = runner(*args)
        seen.append((eager, graphed.clone()))
        return graphed
    eng.model = spy
    while eng.has_work():
        eng.step()
    assert seen and runner.num_replayed == len(seen)
    for eager, graphed in seen:
        torch.testing.assert_close(graphed, eager, atol=tol, rtol=tol)


@pytest.mark.gpu
@cuda
def test_cuda_graphs_with_the_torch_backend_run_eagerly():
    model = build_tiny(0, torch.float32, "cuda")
    eng = _cuda_engine(model, torch.float32, True, attention_backend="torch")
    assert eng.graphs is None and eng.model is model
    eng.add_request(req("r", [40, 41, 42], max_tokens=4))
    assert len(run_to_end(eng)["r"]) == 4
