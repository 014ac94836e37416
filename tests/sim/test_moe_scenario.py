"""Scenarios on MoE models: instances shaped TP x DP-attention x EP, spanning nodes, sized or refused."""

import shutil

import pytest

from pddgw.config import ConfigError
from pddgw.sim import profiles
from pddgw.sim.clock import run_virtual
from pddgw.sim.cluster import run_deployment
from pddgw.sim.costmodel_engine import CostModelEngine
from pddgw.sim.hf_config import CONFIG_DIR
from pddgw.sim.roofline import Parallel, memory_fit
from pddgw.sim.scenario import deployment_config, deployment_price, load_scenario
from pddgw.sim.workload import agentic, shared_prefix

SCENARIO = '''
name = "moe"
seed = 1
model = "{model}"
block_size = 64
kv_frame_mb = 8.0

[workload.agentic]
requests = 4
rate = 2.0
context_tokens = 4096
output_tokens = 8
shared_prefix_tokens = 1024
turns_min = 2
turns_max = 2
think_s_min = 0.5
think_s_max = 1.0

[goodput]
enabled = false

[[links]]
name = "wan"
gbps = 10.0
latency_ms = 15.0
shared = true

[[deployments]]
name = "pdd"
nodes = [ {{ role = "prefill", count = 1, tensor_parallel = 1, data_parallel = 24, hardware = "H100-SXM" }},
          {{ role = "rld", count = 1, tensor_parallel = 8, hardware = "H200-SXM" }},
          {{ role = "md", count = 1, cluster = "B", tensor_parallel = 1, data_parallel = 8, hardware = "H200-SXM" }} ]

[[deployments]]
name = "too-small"
nodes = [ {{ role = "prefill", count = 2, tensor_parallel = 8, hardware = "H100-SXM" }},
          {{ role = "md", count = 1, tensor_parallel = 8, hardware = "H200-SXM" }} ]
'''


def scenario(tmp_path, model="deepseek-v4-pro"):
    p = tmp_path / "moe.toml"
    p.write_text(SCENARIO.format(model=model))
    return load_scenario(p)


def test_instances_span_nodes_and_are_priced_by_their_gpus(tmp_path):
    sc = scenario(tmp_path)
    usd, gpus = deployment_price(sc, sc.deployment("pdd"))
    assert gpus == 24 + 8 + 8
    assert usd == pytest.approx(24 * 3.00 + 16 * 3.75)
    cfg = deployment_config(sc, sc.deployment("pdd"))
    p = cfg.engine_for(next(n for n in cfg.nodes if n.role == "prefill")).costmodel
    # DP24 (3 nodes), as the paper's P: on 16 H100s the weights and the MTP layer leave 0.4 GB a
    # GPU, less than 256 sequences' windows.
    assert (p.tensor_parallel, p.data_parallel, p.gpus) == (1, 24, 24)
    eng, _ = CostModelEngine.from_config(cfg, cfg.engine_for(cfg.nodes[1]))
    assert eng.parallel == Parallel(tp=1, dp=24) and eng.parallel.nodes == 3
    # max_num_seqs 256 on each of the 24 ranks: 6,144 sequences' windows kept.
    assert eng.blocks.num_blocks == memory_fit(profiles.model("deepseek-v4-pro"), profiles.hardware("H100-SXM"),
                                               Parallel(tp=1, dp=24), 0.9, 6144).kv_tokens // 64
    assert (eng.scheduler.max_num_seqs, eng.scheduler.max_num_batched_tokens) == (6144, 24 * 8192)


def test_a_deployment_that_cannot_hold_the_model_is_refused_with_its_numbers(tmp_path):
    sc = scenario(tmp_path)
    with pytest.raises(ConfigError) as ei:
        deployment_config(sc, sc.deployment("too-small"))
    msg = str(ei.value)
    # 846.8 GB of weights: 8 x H100 leaves 72 GB per GPU for 106.5 GB per GPU of them.
    assert msg.startswith("deployment 'too-small', prefill group 2 x 8 x H100-SXM (tensor_parallel 8 x "
                          "data_parallel 1, expert_parallel 8): deepseek-v4-pro does not fit: weights 846.8 GB, ")
    assert "of 80 GB HBM x 0.9 = 72.0 GB usable" in msg and "GB per GPU for KV" in msg


def test_a_moe_deployment_serves_on_the_virtual_clock(tmp_path):
    sc = scenario(tmp_path)
    cfg = deployment_config(sc, sc.deployment("pdd"), wan_gbps=10.0)
    convs = agentic(sc.workload.agentic, sc.seed)
    run = run_virtual(run_deployment(cfg, convs, shared_prefix(1024, sc.seed)))
    assert len(run.requests) == sum(len(c.turns) for c in convs)
    assert all(r.error is None and r.output_tokens == 8 for r in run.requests)
    assert run.leaked_blocks == 0 and run.leaked_pins == 0
    # Every WAN byte is a whole number of 5512-byte wire tokens (V4-Pro's marginal KV rate).
    assert run.wan_kv_bytes > 0 and run.wan_kv_bytes % 5512 == 0


def test_a_user_config_json_next_to_the_scenario(tmp_path):
    # `model` names a directory holding a config.json, relative to the scenario file.
    (tmp_path / "mine").mkdir()
    shutil.copy(CONFIG_DIR / "qwen3-235b-a22b.json", tmp_path / "mine" / "config.json")
    sc = scenario(tmp_path, model="mine")
    assert sc.model == str((tmp_path / "mine").resolve())
    m = profiles.model(sc.model)
    assert (m.num_experts, m.experts_per_token, m.num_layers, m.kv_bytes_per_token) == (128, 8, 94, 192_512)
