"""The embedded deployment on a checkpoint as today's transformers saves it, with one load of its weights.

A random Qwen2 saved with transformers' defaults states no EOS anywhere
(config.json `"eos_token_id": null`): it serves on every path, P-RLD-MD
streams what `pddgw generate` gives for the same prompt, and only a grammar
is refused.  P, RLD, MD and the WAN probe share one model object, loaded once.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from pddgw import cli  # noqa: E402
from pddgw.config import NetConfig  # noqa: E402
from pddgw.engines import weights  # noqa: E402
from pddgw.engines.weights import SharedModels  # noqa: E402

from .pdd_client import chat  # noqa: E402
from .test_embedded import deploy, make_cfg, prompt_of  # noqa: E402,F401  (deploy is a fixture)


@pytest.fixture(scope="module")
def null_eos(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen2-null-eos")
    cfg = transformers.Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(d)
    assert json.loads((d / "config.json").read_text())["eos_token_id"] is None
    return d


def test_shared_models_load_once_per_key(monkeypatch):
    calls = []
    real = weights.load_model
    monkeypatch.setattr(weights, "load_model", lambda *a: calls.append(a) or real(*a))
    shelf = SharedModels()
    a = shelf.load(None, "float64", "cpu")
    assert shelf.load("tiny", torch.float64, "cpu") is a          # "tiny" and None: the same model
    b = shelf.load(None, "float32", "cpu")
    c = shelf.load(None, "float64", "cpu", tiny_seed=1)
    assert len({id(a), id(b), id(c)}) == 3 and len(calls) == 3
    shelf.clear()
    assert shelf.load(None, "float64", "cpu") is not a and len(calls) == 4


async def test_serves_a_null_eos_checkpoint_on_one_load_of_its_weights(deploy, null_eos, monkeypatch, capsys):
    loads = []
    real = weights.load_model
    monkeypatch.setattr(weights, "load_model", lambda *a: loads.append(a[0]) or real(*a))
    cfg = make_cfg(pipeline="P-RLD-MD")
    # No WAN figures: the WAN is derived from a probe engine's decode step (deploy/regime.py).
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(null_eos)), net=NetConfig())
    ws, side, _ = await deploy(cfg)
    assert loads == [str(null_eos)]              # P, RLD, MD and the WAN probe: one load
    p = prompt_of(80)
    r = await chat(ws, prompt_token_ids=p, max_output_tokens=24, temperature=0, return_token_ids=True)
    assert r.final["type"] == "response.completed", r.final
    assert (r.final["response"]["model"], r.timeline["pipeline"]) == (null_eos.name, "P-RLD-MD")
    assert cli.main(["generate", "--model", str(null_eos), "--dtype", "float64", "--max-tokens", "24",
                     "--prompt-ids", ",".join(map(str, p)), "--json"]) == 0
    assert r.token_ids == json.loads(capsys.readouterr().out.splitlines()[-1])["token_ids"]
    g = await chat(ws, prompt_token_ids=p, max_output_tokens=8, text={"format": {
        "type": "json_schema", "name": "x", "schema": {"type": "object"}}})
    assert g.final["type"] == "error"
    assert "states no EOS token" in g.final["error"]["message"], g.final
