"""The vLLM engine behind the Engine contract: alone, and exchanging KV with the torch engine.

One seeded random Llama checkpoint in float32 serves both engines; greedy
tokens are compared exactly (the model's top-1 margins dwarf the float32
differences between the two implementations for these prompts).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pddgw.engines.block_manager import chain_hashes
from pddgw.engines.torch_engine import TorchEngine
from pddgw.engines.types import CapacityError, EngineRequest, KVChunk, KVSpan, RequestError, SamplingParams
from pddgw.engines.vllm_engine import VllmEngine

from .conftest import BLOCK, config, prompt_ids, torch_engine_config, vllm_engine_config

OUT = 16


def greedy(max_tokens: int = OUT) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def run(engine, *requests: EngineRequest) -> dict[str, list[int]]:
    """Add the requests, step to the end; -> every request's output tokens (given ones included),
    checking that positions arrive once and in order."""
    out = {r.request_id: list(r.output_token_ids) for r in requests}
    for r in requests:
        engine.add_request(r)
    return drain(engine, out)


def drain(engine, out: dict[str, list[int]]) -> dict[str, list[int]]:
    while engine.has_work():
        for o in engine.step():
            if o.ids:
                assert o.position == len(out[o.request_id]), o
                out[o.request_id] += o.ids
    return out


@pytest.fixture(scope="module")
def veng(checkpoint):
    engine, _ = VllmEngine.from_config(config(checkpoint, vllm_engine_config()))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def teng(checkpoint):
    engine, _ = TorchEngine.from_config(config(checkpoint, torch_engine_config()))
    return engine


@pytest.fixture(autouse=True)
def nothing_left(request):
    """After every test: no block in use, no pin, reference counts exact, on both engines."""
    yield
    for name in ("veng", "teng"):
        if name in request.fixturenames:
            engine = request.getfixturevalue(name)
            engine.check_integrity()
            stats = engine.stats()
            assert (stats.used_blocks, stats.pins, stats.running, stats.waiting, stats.importing,
                    stats.retained) == (0, 0, 0, 0, 0, 0), (name, stats)


_REF: dict[tuple, list[int]] = {}


def reference(teng, prompt: tuple[int, ...], max_tokens: int = OUT) -> list[int]:
    """Single-node generation on the torch engine: the yardstick of every path."""
    key = (prompt, max_tokens)
    if key not in _REF:
        _REF[key] = run(teng, EngineRequest("ref", prompt, greedy(max_tokens)))["ref"]
    return _REF[key]


PROMPTS = (prompt_ids(40), prompt_ids(70, 1), prompt_ids(100, 2))


_LLM_GENERATE = """
import json, sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    path, prompts, n = json.loads(sys.argv[1])
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", block_size=32, enforce_eager=True,
              seed=0, gpu_memory_utilization=0.05, kv_cache_memory_bytes=16 << 20, max_model_len=1024)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False))
    print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def test_alone_equals_vllm_llm_generate(veng, checkpoint):
    """vLLM's own `LLM.generate`, untouched (its own process: a process holds one KV connector)."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    proc = subprocess.run([sys.executable, "-c", _LLM_GENERATE,
                           json.dumps([checkpoint, [list(p) for p in PROMPTS], OUT])],
                          capture_output=True, text=True, env=env, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("TOKENS ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    expected = json.loads(lines[0][len("TOKENS "):])
    got = run(veng, *(EngineRequest(f"r{i}", p, greedy()) for i, p in enumerate(PROMPTS)))
    assert [got[f"r{i}"] for i in range(len(PROMPTS))] == expected


def test_alone_equals_the_torch_engine(veng, teng):
    got = run(veng, *(EngineRequest(f"r{i}", p, greedy()) for i, p in enumerate(PROMPTS)))
    assert [got[f"r{i}"] for i in range(len(PROMPTS))] == [reference(teng, p) for p in PROMPTS]


def test_seeded_sampling_is_position_keyed_as_on_the_torch_engine(veng, teng):
    """pddgw's draw inside vLLM: the same tokens as the torch engine, alone, in a batch, and
    when the first tokens were sampled elsewhere (a handoff)."""
    sp = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)
    prompt = PROMPTS[0]
    ref = run(teng, EngineRequest("ref", prompt, sp))["ref"]
    assert ref != reference(teng, prompt, 24)              # sampled, not greedy
    batch = run(veng, EngineRequest("s", prompt, sp), EngineRequest("g", PROMPTS[1], greedy()),
                EngineRequest("t", PROMPTS[2], SamplingParams(max_tokens=24, temperature=1.0, seed=3)))
    assert batch["s"] == ref
    assert run(veng, EngineRequest("h", prompt, sp, output_token_ids=tuple(ref[:9])))["h"] == ref


def test_logprobs_are_the_raw_log_softmax_as_on_the_torch_engine(veng, teng):
    sp = SamplingParams(max_tokens=6, temperature=0.8, seed=5, ignore_eos=True, logprobs=3)
    outs = {}
    for name, eng in (("vllm", veng), ("torch", teng)):
        eng.add_request(EngineRequest(name, PROMPTS[1], sp))
        got = []
        while eng.has_work():
            got += [(t, lp) for o in eng.step() for t, lp in zip(o.ids, o.logprobs)]
        outs[name] = got
    assert [t for t, _ in outs["vllm"]] == [t for t, _ in outs["torch"]]
    for (_, v), (_, t) in zip(outs["vllm"], outs["torch"]):
        assert v.top_ids == t.top_ids and len(v.top_ids) == 3
        assert v.logprob == pytest.approx(t.logprob, abs=1e-4)
        assert v.top_logprobs == pytest.approx(t.top_logprobs, abs=1e-4)


def test_stop_tokens_and_context_length_finish_as_on_the_torch_engine(veng, teng):
    p = PROMPTS[1]
    ref = reference(teng, p)
    stop = ref[5]
    first = ref.index(stop)
    veng.add_request(EngineRequest("s", p, SamplingParams(max_tokens=OUT, stop_token_ids=(stop,))))
    outs = []
    while veng.has_work():
        outs += veng.step()
    tokens = [t for o in outs for t in o.ids]
    assert tokens == ref[: first + 1]
    assert (outs[-1].done, outs[-1].reason) == (True, "stop")


def transfer(src, dst, rid: str, start: int, end: int, chunk: int = 24) -> int:
    """Export tokens [start, end) of `rid` from src in chunks, import into dst; -> bytes moved."""
    moved = 0
    for a in range(start, end, chunk):
        c = src.export_kv(rid, a, min(a + chunk, end))
        dst.import_kv(KVChunk(c.span, memoryview(bytes(c.payload))))
        moved += len(c.payload)
    return moved


def prefill_on(p_engine, rid: str, prompt: tuple[int, ...]) -> int:
    """P: prefill the prompt, sample position 0, keep the KV; -> the first token."""
    out = run(p_engine, EngineRequest(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True),
                                      retain_kv=True))
    return out[rid][0]


def hand_over(src, dst, rid: str, prompt: tuple[int, ...], hold: bool = False):
    """P -> decoder, as the nodes do it: src prefills `rid` (samples position 0, keeps the KV),
    dst opens it for import (with src's first token, unless held for a handoff), src's KV past
    dst's cached prefix crosses in chunks, src lets it go, dst finishes the import.
    -> (the first token, dst's AddResult, KV bytes moved)."""
    t0 = prefill_on(src, rid, prompt)
    added = dst.add_request(EngineRequest(rid, prompt, greedy(), output_token_ids=() if hold else (t0,),
                                          kv_source="import", hold=hold))
    moved = transfer(src, dst, rid, added.num_cached_tokens, len(prompt))
    assert src.release(rid)
    dst.finish_import(rid)
    return t0, added, moved


@pytest.mark.parametrize("direction", ["torch P -> vLLM MD", "vLLM P -> torch MD"])
def test_kv_from_the_other_engine_gives_the_same_tokens(veng, teng, direction):
    p_eng, md = (teng, veng) if direction.startswith("torch") else (veng, teng)
    prompt = prompt_ids(90, 3 if p_eng is teng else 9)      # nothing of it cached anywhere yet
    t0, added, _ = hand_over(p_eng, md, "x", prompt)
    assert added.num_cached_tokens == 0
    assert drain(md, {"x": [t0]})["x"] == reference(teng, prompt)


def test_second_turn_imports_only_the_blocks_vllm_does_not_hold(veng, teng):
    p1 = prompt_ids(75, 4)
    t0, _, _ = hand_over(teng, veng, "a", p1)
    out1 = drain(veng, {"a": [t0]})["a"]
    assert out1 == reference(teng, p1)

    p2 = (*p1, *out1, *prompt_ids(30, 5))
    held = (len(p1) + OUT - 1) // BLOCK           # full blocks of what MD computed
    assert veng.match_prefix(chain_hashes(p2, BLOCK), pin_key="turn2") == held
    t0, added, moved = hand_over(teng, veng, "b", p2)
    assert added.num_cached_tokens == held * BLOCK
    assert moved == (len(p2) - held * BLOCK) * veng.kv_layout.bytes_per_token()
    assert veng.unpin("turn2")
    assert drain(veng, {"b": [t0]})["b"] == reference(teng, p2)


def test_held_request_computes_each_round_and_samples_after_the_final_one(veng, teng):
    prompt = prompt_ids(64, 6)
    ref = reference(teng, prompt)
    t0, _, _ = hand_over(teng, veng, "h", prompt, hold=True)
    veng.append_tokens("h", (t0,), final=False)

    def computed() -> list[tuple[tuple[int, ...], int]]:
        outs = []
        while veng.has_work():
            outs += [(o.ids, o.num_computed_tokens) for o in veng.step()]
        return outs

    # A round computes all but the held last token, and samples nothing.
    assert computed()[-1] == ((), len(prompt))
    veng.append_tokens("h", ref[1:4], final=False)
    assert computed()[-1] == ((), len(prompt) + 3)
    veng.append_tokens("h", ref[4:7], final=True)
    assert drain(veng, {"h": ref[:7]})["h"] == ref


def test_retained_kv_stays_until_release_and_abort_frees_everything(veng):
    prompt = prompt_ids(50, 7)
    prefill_on(veng, "p", prompt)
    assert veng.stats().retained == 1 and veng.stats().used_blocks == -(-len(prompt) // BLOCK) + 0
    chunk = veng.export_kv("p", 0, len(prompt))
    assert len(chunk.payload) == len(prompt) * veng.kv_layout.bytes_per_token()
    assert veng.abort("p") and not veng.abort("p")
    veng.add_request(EngineRequest("i", prompt, greedy(), kv_source="import"))
    assert veng.abort("i")
    (out,) = veng.step()
    assert (out.request_id, out.done, out.reason) == ("i", True, "abort")


def test_bad_imports_get_clear_errors(veng):
    prompt = prompt_ids(40, 8)
    veng.add_request(EngineRequest("e", prompt, greedy(), kv_source="import"))
    layout = veng.kv_layout
    span = KVSpan.of("e", tokens=(0, 8), layers=(0, layout.num_layers), num_kv_heads=layout.num_kv_heads + 1,
                     head_dim=layout.head_dim, dtype="float32")
    bad_heads = KVChunk(span, memoryview(bytes(span.nbytes)))
    with pytest.raises(RequestError, match="KV shape heads=3 head_dim=32 does not match this model's 2x32"):
        veng.import_kv(bad_heads)
    with pytest.raises(RequestError, match="KV of prompt token 0 never arrived"):
        veng.finish_import("e")
    # Staged imports count against the pool before vLLM allocates their blocks.
    veng.add_request(EngineRequest("big", prompt_ids(40 * BLOCK - 8, 13), greedy(), kv_source="import"))
    with pytest.raises(CapacityError, match="import needs 30 KV blocks, 22 allocatable"):
        veng.add_request(EngineRequest("big2", prompt_ids(30 * BLOCK, 12), greedy(), kv_source="import"))
    assert veng.abort("e") and veng.abort("big")
    veng.step()
    with pytest.raises(RequestError, match="leave no room for output"):
        veng.add_request(EngineRequest("long", prompt_ids(veng.max_model_len), greedy()))


_LLM_EXPORTED = """
import json, sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    path, prompts, n, text = json.loads(sys.argv[1])
    llm = LLM(model=path, dtype="float32", block_size=32, enforce_eager=True, seed=0,
              gpu_memory_utilization=0.05, kv_cache_memory_bytes=16 << 20, max_model_len=1024)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
    print("ENCODED " + json.dumps(llm.get_tokenizer().encode(text)))
"""


def test_an_exported_directory_loads_in_vllm_with_its_tokenizer_and_the_same_tokens(teng, tmp_path):
    """`pddgw export-model`'s folder (weights + tokenizer.json), loaded by vLLM's own `LLM` with its
    tokenizer (not skipped): the torch engine's greedy tokens, and the byte tokenizer's ids."""
    from pddgw.engines.tokenizer import ByteTokenizer
    from pddgw.engines.weights import build_random, export_model

    from .conftest import spec

    model = build_random(spec(), 0, "float32", "cpu")      # the checkpoint the torch engine serves
    tok = ByteTokenizer(model.spec.vocab_size)
    d = export_model(model, tok, tmp_path / "exported")
    text = "hi! é"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    proc = subprocess.run([sys.executable, "-c", _LLM_EXPORTED,
                           json.dumps([str(d), [list(p) for p in PROMPTS], OUT, text])],
                          capture_output=True, text=True, env=env, timeout=600)
    out = {ln.split(" ", 1)[0]: json.loads(ln.split(" ", 1)[1]) for ln in proc.stdout.splitlines()
           if ln.startswith(("TOKENS ", "ENCODED "))}
    assert proc.returncode == 0 and len(out) == 2, proc.stderr[-3000:]
    assert out["TOKENS"] == [reference(teng, p) for p in PROMPTS]
    assert out["ENCODED"] == [tok.bos_token_id, *tok.encode(text)]     # add_special_tokens: bos, as transformers
