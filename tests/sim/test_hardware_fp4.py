"""FP4 experts run as the part runs them: at the FP4 peak where native (B200), else per the
scenario's fp4_on_non_native: "w4a16" (FP4 bytes, BF16 peak) or "fp8_repack" (FP8 bytes and peak).

DeepSeek-V4-Pro by hand (config.json: hidden 7168, moe_intermediate 3072, 61 MoE layers of 384
routed experts, top-6; experts MXFP4 at 0.53125 B a parameter, the rest FP8 with UE8M0 block
scales at 1 + 1/16384).  Differences between branches are pinned, so the parts of a step both
branches price alike (attention, communication) cancel.
"""

import dataclasses

import pytest

from pddgw.config import ConfigError, Config, EngineConfig, ModelConfig
from pddgw.sim import profiles
from pddgw.sim.costmodel_engine import CostModelEngine
from pddgw.sim.roofline import Parallel, _step_consts, decode_step_cost, distinct_experts, memory_fit
from pddgw.sim.scenario import NodeGroup, group_fit, load_scenario

PRO = profiles.model("deepseek-v4-pro")
H100, A100, B200 = (profiles.hardware(n) for n in ("H100-SXM", "A100-80G", "B200"))
EXPERT = 3 * 7168 * 3072                     # 66,060,288 parameters a routed expert
ROUTED = 61 * 384 * EXPERT                   # 1,547,396,186,112
R = 2 * 61 * 6 * EXPERT                      # 48,356,130,816 routed-expert FLOPs a token
FP4, FP8 = 0.53125, 1 + 1 / 16384
PAR = Parallel(tp=1, dp=16)
LENGTHS = [4097] * 64                        # a decode step of 64 sequences: T = 64 tokens
# An expert-parallel decode: compute at the part's MoE decode efficiency (H100's, which B200
# inherits), its weights read by each of two micro-batches of 32 tokens.
EFF = H100.moe_decode_efficiency


def step(model, hw):
    return decode_step_cost(model, hw, PAR, LENGTHS)


def test_the_hand_numbers_are_the_profiles():
    assert (PRO._expert_params, PRO.routed_expert_params, PRO.num_moe_layers, PRO.experts_per_token) == (
        EXPERT, ROUTED, 61, 6)
    assert (PRO.expert_bytes_per_param, PRO.weight_bytes_per_param) == (FP4, FP8)


def test_as_run_repacks_only_fp4_experts_on_a_non_native_part_when_asked():
    assert profiles.as_run(PRO, H100, "w4a16") is PRO
    assert profiles.as_run(PRO, B200, "fp8_repack") is PRO             # native: FP4 whatever the choice
    repacked = profiles.as_run(PRO, H100, "fp8_repack")
    assert repacked.expert_bytes_per_param == FP8
    assert repacked.weight_bytes == round(PRO.param_count * FP8)        # every weight FP8 now
    assert repacked.weight_bytes - PRO.weight_bytes == pytest.approx(ROUTED * (FP8 - FP4), abs=1)
    assert profiles.as_run(repacked, H100, "fp8_repack") is repacked    # idempotent
    v3 = profiles.model("deepseek-v3")                                  # FP8 experts: nothing to repack
    assert profiles.as_run(v3, H100, "fp8_repack") is v3
    bf16 = dataclasses.replace(PRO, weight_bytes_per_param=2.0)         # a BF16 model's repack: block FP8
    assert profiles.as_run(bf16, H100, "fp8_repack").expert_bytes_per_param == 1 + 4 / 16384
    with pytest.raises(ValueError, match="fp4_on_non_native"):
        profiles.as_run(PRO, H100, "fp8")  # type: ignore[arg-type]


def test_hopper_w4a16_runs_the_experts_at_the_bf16_peak():
    w4a16, repack = step(PRO, H100), step(profiles.as_run(PRO, H100, "fp8_repack"), H100)
    assert w4a16.flops == repack.flops
    # 64 tokens x R FLOPs over 16 GPUs, at EFF x 989.5 TFLOP/s instead of EFF x 1,979.
    assert w4a16.compute_s - repack.compute_s == pytest.approx(
        64 * R / 16 * (1 / (EFF * 989.5e12) - 1 / (EFF * 1979e12)), rel=1e-9)
    assert 64 * R / 16 / (0.14 * 1979e12) == pytest.approx(6.981323e-4, rel=1e-6)
    assert EFF == 0.14


def test_hopper_fp8_repack_reads_fp8_expert_bytes():
    w4a16, repack = step(PRO, H100), step(profiles.as_run(PRO, H100, "fp8_repack"), H100)
    visited = 61 * 2 * distinct_experts(384, 6, 32)     # two micro-batches of 32 tokens
    assert repack.bytes - w4a16.bytes == pytest.approx(visited * EXPERT * (FP8 - FP4), rel=1e-12)
    assert repack.memory_s - w4a16.memory_s == pytest.approx(
        visited * EXPERT * (FP8 - FP4) / 16 / (3.35e12 * 0.8), rel=1e-9)


def test_b200_runs_fp4_experts_at_its_fp4_peak():
    native = step(PRO, B200)
    w4a16 = step(PRO, dataclasses.replace(B200, peak_tflops_fp4=0.0))  # the same part without FP4 cores
    assert native.flops == w4a16.flops and native.bytes == w4a16.bytes
    assert w4a16.compute_s - native.compute_s == pytest.approx(
        64 * R / 16 * (1 / (EFF * 2250e12) - 1 / (EFF * 9000e12)), rel=1e-9)
    # The rest of the step at the FP8 peak: against the experts at FP8 too, FP4 saves half their time.
    fp8_experts = step(dataclasses.replace(PRO, expert_bytes_per_param=FP8), B200)
    assert fp8_experts.compute_s - native.compute_s == pytest.approx(
        64 * R / 16 * (1 / (EFF * 4500e12) - 1 / (EFF * 9000e12)), rel=1e-9)


def test_a100_has_no_fp8_cores_so_both_choices_compute_at_bf16():
    w4a16, repack = step(PRO, A100), step(profiles.as_run(PRO, A100, "fp8_repack"), A100)
    assert w4a16.compute_s == repack.compute_s
    assert repack.bytes > w4a16.bytes


def test_the_routed_flops_are_weighted_by_the_peak_they_run_at():
    # compute time counts each token's linear FLOPs + R x (the rest's peak / the experts' peak - 1).
    def extra(model, hw):
        c = _step_consts(model, hw, PAR)
        return c.linear_time_per_token - c.linear_per_token

    assert extra(PRO, H100) == R * (1979 / 989.5 - 1) == R                          # FP8 rest, BF16 experts
    assert extra(PRO, B200) == R * (4500 / 9000 - 1) == -R / 2                       # FP8 rest, FP4 experts
    assert extra(profiles.as_run(PRO, H100, "fp8_repack"), H100) == 0.0
    assert extra(PRO, A100) == 0.0                                                   # BF16 everything
    assert extra(profiles.model("deepseek-v3"), H100) == 0.0                         # FP8 experts: as before
    assert extra(profiles.model("llama3-70b"), H100) == 0.0                          # dense


def test_the_fit_follows_the_choice():
    fp4 = memory_fit(PRO, H100, PAR)
    fp8 = memory_fit(profiles.as_run(PRO, H100, "fp8_repack"), H100, PAR)
    # The routed experts of the 61 MoE layers and of the MTP layers (their experts at the same
    # precision; none where MTP weights are not modeled) are repacked, split over 16 GPUs.
    moe_layers = 61 + getattr(PRO, "num_mtp_layers", 0)
    assert fp8.weights_gb - fp4.weights_gb == pytest.approx(moe_layers * 384 * EXPERT * (FP8 - FP4) / 16 / 1e9,
                                                            rel=1e-9)
    group = NodeGroup(role="md", hardware="H100-SXM", tensor_parallel=1, data_parallel=24, max_num_seqs=16)
    assert group.costmodel().fp4_on_non_native == "w4a16"
    assert group_fit(PRO, group).kv_tokens > 0                                        # ~54 GB of 72 a GPU
    repacked = dataclasses.replace(group, fp4_on_non_native="fp8_repack")
    assert repacked.costmodel().fp4_on_non_native == "fp8_repack"
    assert group_fit(PRO, repacked).kv_gb < 0                                         # ~85 GB of 72
    assert group_fit(PRO, dataclasses.replace(repacked, data_parallel=32)).kv_tokens > 0


def test_the_cost_model_engine_serves_the_repacked_weights():
    for mode, expert_bytes in (("w4a16", FP4), ("fp8_repack", FP8)):
        group = NodeGroup(role="md", hardware="H100-SXM", tensor_parallel=1, data_parallel=32,
                          fp4_on_non_native=mode)
        cfg = Config(model=ModelConfig(profile="deepseek-v4-pro"))
        eng, _ = CostModelEngine.from_config(cfg, EngineConfig(implementation="costmodel", block_size=64,
                                                               costmodel=group.costmodel()))
        assert eng.profile.expert_bytes_per_param == expert_bytes


def test_a_scenario_chooses_for_its_groups(tmp_path):
    paper = tmp_path / "paper.toml"
    src = (__import__("pathlib").Path(__file__).resolve().parents[2] / "scenarios" / "paper.toml").read_text()
    assert {g.fp4_on_non_native for d in load_scenario_text(tmp_path, src).deployments for g in d.nodes} == {"w4a16"}
    paper.write_text('fp4_on_non_native = "fp8_repack"\n' + src)
    with pytest.raises(ConfigError, match="does not fit"):           # DP24 H100 of FP8 experts: ~85 GB of 72
        load_scenario_and_fit(paper)
    paper.write_text('fp4_on_non_native = "fp4"\n' + src)
    with pytest.raises(ConfigError, match="fp4_on_non_native"):
        load_scenario(paper)


def load_scenario_text(tmp_path, text):
    p = tmp_path / "s.toml"
    p.write_text(text)
    return load_scenario(p)


def load_scenario_and_fit(path):
    from pddgw.sim.scenario import deployment_config
    sc = load_scenario(path)
    for d in sc.deployments:
        deployment_config(sc, d)
