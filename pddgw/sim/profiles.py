"""What the cost model knows about GPUs and models: datasheet numbers, config shapes, calibrated efficiencies.

`HardwareProfile` holds one GPU's datasheet peaks (BF16 dense tensor-core
FLOP/s, HBM bandwidth and capacity, NVLink bandwidth) and four numbers that
are not on any datasheet: the fraction of the FLOP/s peak a prefill reaches,
the fraction of the HBM peak a decode reaches, a fixed cost per engine step
and the fixed latency of one tensor-parallel all-reduce, plus the fraction
of the peak an expert-parallel MoE prefill and decode reach (0 on parts with
no MoE row: compute_efficiency).  These are fitted to published end-to-end
measurements (`python -m
pddgw.bench.calibration` prints the comparison; docs/results/calibration.md
says where the fit holds and where it does not).

`ModelProfile` (model_shape.py) is a decoder's shape as its Hugging Face
`config.json` states it.  `model(name)` finds one: a dense profile defined
here (`MODELS`), a shipped config.json under model_configs/, or a path
(`pddgw.sim.hf_config`).

Units: FLOP/s and bytes are decimal (1 TB = 1e12 B, 1 GB = 1e9 B), as on
NVIDIA datasheets; KV sizes are exact byte counts.
"""

from __future__ import annotations

import dataclasses
import functools
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pddgw.core.errors import check as _check
from pddgw.engines.model_spec import RopeScaling
from pddgw.sim import hf_config
from pddgw.sim.model_shape import ModelProfile

# Weights below this many bytes per parameter are FP4 (0.5, + 1/32 with MXFP4's UE8M0 scales).
FP4_MAX_BYTES = 0.75
PRICES_TOML = Path(__file__).with_name("prices.toml")


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    name: str
    peak_tflops_bf16: float      # dense BF16 tensor-core peak, per GPU (no sparsity)
    hbm_tb_s: float              # HBM bandwidth per GPU, TB/s (1e12 B/s)
    hbm_gb: float                # HBM capacity per GPU, GB (1e9 B)
    interconnect_gb_s: float     # NVLink bandwidth per GPU per direction, GB/s (tensor-parallel all-reduce)
    compute_efficiency: float    # achievable fraction of peak in large GEMMs (prefill)
    bandwidth_efficiency: float  # achievable fraction of HBM bandwidth in decode
    step_overhead_ms: float      # fixed cost per engine step (scheduling, kernel launches, sampling)
    # Fixed latency of one TP all-reduce (launch + NVLink round trips), us; dominates the
    # small decode all-reduces.  0 = bandwidth-only communication.  Expert-parallel
    # all-to-alls pay it too (one launch + one exchange each way).
    allreduce_latency_us: float = 0.0
    # Dense FP8 tensor-core peak per GPU; 0 = no FP8 tensor cores (FP8 weights are then
    # up-cast and run at the BF16 peak).
    peak_tflops_fp8: float = 0.0
    # Scale-out network per GPU per direction, GB/s: what an expert-parallel all-to-all
    # gets to GPUs on other nodes.  0 = the part has no scale-out NIC modeled.
    scaleout_gb_s: float = 0.0
    # Dense FP4 tensor-core peak per GPU; 0 = no native FP4 (FP4 weights then run as the
    # scenario's `fp4_on_non_native` says: `as_run`, `gemm_peak_flops`).
    peak_tflops_fp4: float = 0.0
    # Whether pddgw/sim/calibration.toml holds a published serving measurement on this part.
    # False: the fitted numbers (efficiencies, overhead, latency) are `efficiencies_from`'s,
    # and every report using it says so.
    calibrated: bool = True
    efficiencies_from: str = ""
    # Fraction of the peak an expert-parallel MoE step's GEMMs reach, prefill (normal-mode
    # all-to-all) and decode (low-latency mode); 0 = compute_efficiency.  Fitted, not datasheet
    # numbers: each absorbs what the roofline does not price one by one (grouped expert GEMMs
    # with FP8 block scaling, the SMs DeepEP's normal kernels hold while they overlap - 20 of
    # 132, DeepSeek-V3 technical report, arXiv 2412.19437, sec. 3.2.2 -, the busiest EP rank's
    # expert load, gating and permutation kernels).  Which rows fixed them: below, `_H100`.
    moe_prefill_efficiency: float = 0.0
    moe_decode_efficiency: float = 0.0

    def __post_init__(self) -> None:
        _check(bool(self.name), "name must not be empty")
        for f in ("peak_tflops_bf16", "hbm_tb_s", "hbm_gb", "interconnect_gb_s"):
            _check(getattr(self, f) > 0, f"{f} must be > 0")
        for f in ("compute_efficiency", "bandwidth_efficiency"):
            _check(0 < getattr(self, f) <= 1, f"{f} must be in (0, 1]")
        for f in ("moe_prefill_efficiency", "moe_decode_efficiency"):
            _check(0 <= getattr(self, f) <= 1, f"{f} must be in [0, 1] (0 = compute_efficiency)")
        _check(self.step_overhead_ms >= 0, "step_overhead_ms must be >= 0")
        _check(self.allreduce_latency_us >= 0, "allreduce_latency_us must be >= 0")
        _check(self.peak_tflops_fp8 >= 0, "peak_tflops_fp8 must be >= 0")
        _check(self.scaleout_gb_s >= 0, "scaleout_gb_s must be >= 0")
        _check(self.peak_tflops_fp4 >= 0, "peak_tflops_fp4 must be >= 0")
        _check(self.calibrated == (not self.efficiencies_from),
               "an uncalibrated part names the part its efficiencies come from (efficiencies_from), "
               "a calibrated one none")

    def moe_efficiency(self, prefill: bool) -> float:
        """Fraction of the peak an expert-parallel MoE step reaches: `moe_prefill_efficiency`
        for a step with a prefill chunk, `moe_decode_efficiency` for a decode-only one, each
        `compute_efficiency` when 0."""
        return (self.moe_prefill_efficiency if prefill else self.moe_decode_efficiency) or self.compute_efficiency

    @property
    def native_fp4(self) -> bool:
        return self.peak_tflops_fp4 > 0

    def peak_flops(self, fp8: bool) -> float:
        """FLOP/s peak for a GEMM with FP8 weights (on FP8 tensor cores where the part has them) or BF16 ones."""
        return (self.peak_tflops_fp8 if fp8 and self.peak_tflops_fp8 else self.peak_tflops_bf16) * 1e12

    def gemm_peak_flops(self, bytes_per_param: float) -> float:
        """FLOP/s peak for a GEMM whose weights take `bytes_per_param` as this part runs them:
        FP4 (< 0.75 B) at the FP4 peak where native, else W4A16 (dequantized in the kernel, BF16
        MMA) at the BF16 peak; FP8 (< 1.5 B) at `peak_flops(True)`; wider at the BF16 peak."""
        if bytes_per_param < FP4_MAX_BYTES:
            return self.peak_tflops_fp4 * 1e12 if self.peak_tflops_fp4 else self.peak_tflops_bf16 * 1e12
        return self.peak_flops(bytes_per_param < 1.5)


# Datasheets:
#   A100: "NVIDIA A100 Tensor Core GPU" datasheet, A100 80GB SXM column:
#         BF16 312 TFLOPS (624 with sparsity), HBM2e 80 GB at 2,039 GB/s,
#         NVLink 600 GB/s (both directions together).
#   H100: "NVIDIA H100 Tensor Core GPU" datasheet, H100 SXM column:
#         BF16 1,979 TFLOPS with sparsity (half dense), 80 GB at 3.35 TB/s,
#         NVLink 900 GB/s (both directions together).
#   H200: "NVIDIA H200 Tensor Core GPU" datasheet, H200 SXM column:
#         BF16 1,979 TFLOPS with sparsity (half dense), 141 GB at 4.8 TB/s,
#         NVLink 900 GB/s (both directions together).
# The NVLink figures are bidirectional totals; a ring all-reduce sends and
# receives at once, so each direction carries half.
# FP8: the same H100 SXM / H200 SXM datasheet columns give FP8 Tensor Core
#   3,958 TFLOPS with sparsity, 1,979 dense; A100 has no FP8 tensor cores.
# Scale-out: DGX H100 / DGX H200 datasheets: 8 x ConnectX-7 400 Gb/s (one
#   per GPU) = 50 GB/s per GPU per direction; DGX A100 datasheet: 8 x
#   ConnectX-6 200 Gb/s = 25 GB/s per GPU.
#
# Efficiencies, overheads and all-reduce latencies are fitted to the
# published measurements in pddgw/sim/calibration.toml;
# docs/results/calibration.md lists the rows and the residuals:
#   bandwidth_efficiency 0.8: the HBM fraction weight-streaming GEMVs and
#     decode attention sustain; one value fits the batch-1..8 decode rows of
#     gpt-fast, LMDeploy and vLLM on all three parts.
#   step_overhead_ms: what is left of a tensor_parallel = 1 decode step
#     (vLLM CI, Llama-3-8B, batch 8) after its bytes: scheduling, sampling,
#     launches that CUDA graphs do not hide.  ~2-2.5 ms.
#   allreduce_latency_us: the TP-4 70B step's residual minus the TP-1 8B
#     one, spread over the 2 x 80 all-reduces of the 70B step (vLLM CI pairs,
#     same GPU and build): ~25 us on H100/H200.  The A100 pair says ~45 us,
#     gpt-fast's A100 TP-4/TP-8 rows say less; 30 us keeps every A100 decode
#     row at batch <= 8 within 12 %.
#   compute_efficiency: the MFU of a 2K-token prefill once the all-reduce
#     time is taken out.  A100 reaches ~0.65 (TensorRT-LLM, LMDeploy and
#     Splitwise profiles agree); Splitwise's H100 profile (2023; 16-bit
#     assumed, the data does not say) reaches ~0.4.
#     H200 has the same SMs and clocks as H100 and no published bf16 prefill
#     profile was found, so it inherits H100's.
#
#     It is the fraction of the peak the weights' precision runs at: TensorRT-LLM's H100
#     FP8 first tokens sit within 6 % of 0.40 of the FP8 peak, DeepSeek's H800 prefill
#     profile implies ~0.33 (pddgw/sim/calibration.toml, docs/results/calibration.md).
#
#   moe_prefill_efficiency 0.31, moe_decode_efficiency 0.14 (Hopper; H800 and H200 inherit
#     them): fitted to the expert-parallel rows of SGLang's large-EP blog (H100; prefill EP32
#     at 1K / 2K / 4K, decode EP72) and DeepSeek's profile (H800; prefill EP32, decode
#     EP128): each the value whose geometric-mean ratio over its fit rows is 1 (0.309,
#     0.143), rounded.  DeepSeek's online service and vLLM's wide-EP rows (H200) are checks.
#     The prefill value sits near what those rows imply end to end (~0.27-0.33 of the FP8
#     peak, docs/results/calibration.md).  The decode value is low because a decode step's
#     expert GEMMs see 128-288 tokens per expert per micro-batch in those rows, the attention
#     and gating kernels run twice on half batches, and the busiest rank sets the step; none
#     of these is priced on its own.  Dense steps and TP-only MoE steps keep
#     compute_efficiency.
#
# H800 SXM5 (DeepSeek's own serving part): the H100 SXM die and HBM3 (same
#   FP8 / BF16 peaks, 80 GB at 3.35 TB/s) with NVLink cut to 400 GB/s both
#   directions together (NVIDIA H800 SXM5 specification; DeepSeek-V3
#   technical report, arXiv 2412.19437, sec. 3.1-3.2.2: "NVLink ... 160 GB/s"
#   achieved, "IB (50 GB/s)" per GPU: 8 x 400 Gb/s InfiniBand per node).
#   Efficiencies are H100's (same SMs, clocks and HBM).
#
# Prices are not here: per GPU-hour they are a menu input (prices.toml beside this file,
# overridden by a scenario's or plan's [prices]; `price`).
_H100 = HardwareProfile(
    name="H100-SXM", peak_tflops_bf16=989.5, peak_tflops_fp8=1979.0, hbm_tb_s=3.35, hbm_gb=80.0,
    interconnect_gb_s=450.0, scaleout_gb_s=50.0, allreduce_latency_us=25.0,
    compute_efficiency=0.40, bandwidth_efficiency=0.8, step_overhead_ms=2.0,
    moe_prefill_efficiency=0.31, moe_decode_efficiency=0.14,
)
_FROM_H100 = {"calibrated": False, "efficiencies_from": "H100-SXM"}

# Parts with no published serving measurement in calibration.toml (calibrated = False):
# datasheet peaks, and the fitted numbers (MoE efficiencies included) of the part named in
# efficiencies_from.
# Dense peaks are the datasheets' "with sparsity" figures halved.  Read 2026-12.
#
# H20 (Hopper, NVIDIA's export part for China): FP8 296 / BF16 148 TFLOPS dense, 96 GB
#   HBM3 at 4.0 TB/s, NVLink 900 GB/s both directions together; NVIDIA published no public
#   datasheet: these are the partner spec-sheet figures reported at its announcement
#   (2023-11), +-5 %.  Scale-out: an HGX H20 node with one 400 Gb/s NIC per GPU assumed
#   (50 GB/s).  No native FP4 (Hopper).  Efficiencies: H100's (same generation; its
#   compute is ~15 % of H100's, so prefill efficiency may differ most).
# B200 (Blackwell): "NVIDIA HGX B200" datasheet (2024), per GPU of eight: FP4 Tensor Core
#   144 PFLOPS, FP8 72, BF16 36 per board with sparsity -> dense 9,000 / 4,500 / 2,250
#   TFLOPS; 1,440 GB HBM3e at 64 TB/s per board -> 180 GB at 8.0 TB/s; NVLink 5 1.8 TB/s
#   both directions together -> 900 GB/s.  Scale-out: DGX B200 datasheet, 8 x ConnectX-7
#   400 Gb/s -> 50 GB/s per GPU.  Native FP4 (NVFP4 / MXFP4 tensor cores).  Efficiencies:
#   H100's, the newest calibrated NVIDIA part (Blackwell's fractions are not measured here).
# MI300X (CDNA 3): "AMD Instinct MI300X" datasheet (2023-12): FP16/BF16 1,307.4 TFLOPS
#   dense, FP8 2,614.9 dense; 192 GB HBM3 at 5.3 TB/s; 7 Infinity Fabric links of 128 GB/s
#   both directions together to the other seven GPUs of a platform -> 448 GB/s per
#   direction in all (a fully connected mesh, not a switch: a TP group below 8 reaches only
#   its links, so the all-reduce figure is optimistic for tp < 8).  Scale-out: 400 Gb/s
#   per GPU assumed (50 GB/s).  No native FP4 (MI355X has it).  No AMD part is calibrated:
#   H100's efficiencies (the part it competes with; HBM efficiency of ROCm decode not measured).
# L40S (Ada): "NVIDIA L40S" datasheet (2023): BF16 362.05 TFLOPS dense (733 with sparsity),
#   FP8 733 dense (1,466); 48 GB GDDR6 at 864 GB/s; no NVLink: PCIe Gen4 x16, 64 GB/s
#   both directions together -> 32 GB/s.  Scale-out: 200 Gb/s per GPU assumed (25 GB/s;
#   L40S servers vary most here).  No native FP4.  Efficiencies: H100's (FP8 generation);
#   its PCIe all-reduce latency is surely above H100's 25 us (not measured).
# Ascend 910C: Huawei CloudMatrix384 paper (Zuo et al., arXiv 2506.12708, 2025-06, sec. 3):
#   two dies of ~376 TFLOPS dense BF16/FP16, 64 GB at 1.6 TB/s each -> 752 TFLOPS, 128 GB,
#   3.2 TB/s per package; no FP8 tensor cores (the paper serves DeepSeek in INT8: FP8
#   weights here run at the BF16 peak); UB scale-up 196 GB/s per direction per die -> 392
#   GB/s; RDMA scale-out 200 Gb/s per die -> 50 GB/s (inside a CloudMatrix384 supernode the
#   UB plane spans 384 NPUs: model it with gpus_per_node = 384).  The paper's serving
#   numbers are not a calibration row yet.  No Ascend part is calibrated: H100's efficiencies.
# Ascend 950PR / 950DT: Huawei Connect 2025 roadmap (2025-09-18), not shipping parts: one die,
#   FP8 1 PFLOPS and FP4 2 PFLOPS (native), interconnect 2 TB/s (taken as both directions
#   together -> 1,000 GB/s); 950PR 128 GB at 1.6 TB/s (HiBL 1.0), 950DT 144 GB at 4.0 TB/s
#   (HiZQ 2.0).  BF16 not announced: FP8 / 2 assumed.  Scale-out as 910C assumed (50 GB/s).
#   Every figure is a roadmap target, +-20 %.  H100's efficiencies.
HARDWARE: dict[str, HardwareProfile] = {p.name: p for p in (
    HardwareProfile(
        name="A100-80G", peak_tflops_bf16=312.0, hbm_tb_s=2.039, hbm_gb=80.0,
        interconnect_gb_s=300.0, scaleout_gb_s=25.0, allreduce_latency_us=30.0,
        compute_efficiency=0.65, bandwidth_efficiency=0.8, step_overhead_ms=2.5,
    ),
    _H100,
    # The H100 die and HBM; NVLink cut to half (above).
    dataclasses.replace(_H100, name="H800-SXM", interconnect_gb_s=200.0),
    # The H100's SMs and clocks with HBM3e: 141 GB at 4.8 TB/s.
    dataclasses.replace(_H100, name="H200-SXM", hbm_tb_s=4.8, hbm_gb=141.0),
    dataclasses.replace(_H100, name="H20", peak_tflops_bf16=148.0, peak_tflops_fp8=296.0, hbm_tb_s=4.0,
                        hbm_gb=96.0, **_FROM_H100),
    dataclasses.replace(_H100, name="B200", peak_tflops_bf16=2250.0, peak_tflops_fp8=4500.0,
                        peak_tflops_fp4=9000.0, hbm_tb_s=8.0, hbm_gb=180.0, interconnect_gb_s=900.0, **_FROM_H100),
    dataclasses.replace(_H100, name="MI300X", peak_tflops_bf16=1307.4, peak_tflops_fp8=2614.9, hbm_tb_s=5.3,
                        hbm_gb=192.0, interconnect_gb_s=448.0, **_FROM_H100),
    dataclasses.replace(_H100, name="L40S", peak_tflops_bf16=362.05, peak_tflops_fp8=733.0, hbm_tb_s=0.864,
                        hbm_gb=48.0, interconnect_gb_s=32.0, scaleout_gb_s=25.0, **_FROM_H100),
    dataclasses.replace(_H100, name="Ascend-910C", peak_tflops_bf16=752.0, peak_tflops_fp8=0.0, hbm_tb_s=3.2,
                        hbm_gb=128.0, interconnect_gb_s=392.0, **_FROM_H100),
    dataclasses.replace(_H100, name="Ascend-950PR", peak_tflops_bf16=500.0, peak_tflops_fp8=1000.0,
                        peak_tflops_fp4=2000.0, hbm_tb_s=1.6, hbm_gb=128.0, interconnect_gb_s=1000.0, **_FROM_H100),
    dataclasses.replace(_H100, name="Ascend-950DT", peak_tflops_bf16=500.0, peak_tflops_fp8=1000.0,
                        peak_tflops_fp4=2000.0, hbm_tb_s=4.0, hbm_gb=144.0, interconnect_gb_s=1000.0, **_FROM_H100),
)}


# Shapes from each model's Hugging Face config.json (all: SiLU, no attention
# bias, untied embeddings, bf16 weights).  The other Llamas are Llama-3-70B's
# shape with what their config.json changes.
# meta-llama/Meta-Llama-3-70B config.json.
_LLAMA3_70B = ModelProfile(
    name="llama3-70b", num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8, head_dim=128,
    intermediate_size=28672, vocab_size=128256, max_position_embeddings=8192,
    eos_token_ids=(128001,), bos_token_id=128000, arch="llama", rope_theta=500000.0, rms_norm_eps=1e-5,
)
MODELS: dict[str, ModelProfile] = {p.name: p for p in (
    _LLAMA3_70B,
    # meta-llama/Llama-3.1-70B config.json: the same layers, 128K context via
    # "llama3" RoPE scaling; the shape for the paper's 64K-token prompts.
    dataclasses.replace(_LLAMA3_70B, name="llama3.1-70b", max_position_embeddings=131072,
                        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                 original_max_position_embeddings=8192)),
    # meta-llama/Meta-Llama-3-8B config.json (small fidelity runs): 32 narrower layers.
    dataclasses.replace(_LLAMA3_70B, name="llama3-8b", num_layers=32, hidden_size=4096, num_heads=32,
                        intermediate_size=14336),
    # meta-llama/Llama-2-70b-hf config.json: the model of most 2023 published
    # measurements (calibration); Llama-3-70B layers with a 32K vocabulary.
    dataclasses.replace(_LLAMA3_70B, name="llama2-70b", vocab_size=32000, max_position_embeddings=4096,
                        eos_token_ids=(2,), bos_token_id=1, rope_theta=10000.0),
    # Qwen/Qwen3-32B config.json: 64 query heads of 128 (8192 wide) on a 5120
    # residual stream; sliding window off.
    ModelProfile(
        name="qwen3-32b", num_layers=64, hidden_size=5120, num_heads=64, num_kv_heads=8, head_dim=128,
        intermediate_size=25600, vocab_size=151936, max_position_embeddings=40960,
        eos_token_ids=(151645,), bos_token_id=151643, arch="qwen3", rope_theta=1000000.0, rms_norm_eps=1e-6,
    ),
)}


def hardware(name: str) -> HardwareProfile:
    try:
        return HARDWARE[name]
    except KeyError:
        raise KeyError(f"unknown hardware profile {name!r} (known: {', '.join(sorted(HARDWARE))})") from None


@functools.lru_cache(maxsize=1)
def shipped_prices() -> dict[str, float]:
    """prices.toml: part -> USD per GPU-hour (each entry's source and date are in the file)."""
    with PRICES_TOML.open("rb") as f:
        table = tomllib.load(f)["prices"]
    out = {}
    for name, entry in table.items():
        _check(name in HARDWARE, f"{PRICES_TOML.name}: prices.{name}: unknown hardware "
                                 f"(known: {', '.join(sorted(HARDWARE))})")
        _check(set(entry) == {"usd_per_gpu_hour", "source", "date"},
               f"{PRICES_TOML.name}: prices.{name}: needs usd_per_gpu_hour, source and date, got {sorted(entry)}")
        out[name] = float(entry["usd_per_gpu_hour"])
    return out


def price(name: str, prices: Mapping[str, float] | None = None) -> float:
    """USD per GPU-hour of part `name`: `prices` (a scenario's or plan's [prices]) first,
    then prices.toml; KeyError naming the key when neither has it."""
    if prices and name in prices:
        return prices[name]
    shipped = shipped_prices()
    if name not in shipped:
        raise KeyError(f"prices.{name}: no price for hardware {name!r}: add [prices] \"{name}\" = USD per "
                       f"GPU-hour to the scenario or plan (shipped: {', '.join(sorted(shipped))})")
    return shipped[name]


def check_prices(prices: Mapping[str, float]) -> None:
    """ValueError naming the key of a [prices] entry that is no known part or not >= 0."""
    for name, usd in prices.items():
        _check(name in HARDWARE, f"prices.{name}: unknown hardware (known: {', '.join(sorted(HARDWARE))})")
        _check(usd >= 0, f"prices.{name}: must be >= 0, got {usd}")


def uncalibrated(names: Iterable[str]) -> dict[str, str]:
    """Of the parts `names`, those with no calibration row: name -> the part whose efficiencies they use."""
    return {n: HARDWARE[n].efficiencies_from for n in sorted(set(names)) if not HARDWARE[n].calibrated}


def uncalibrated_line(parts: Mapping[str, str]) -> str:
    """The line a report prints when it uses uncalibrated parts ("" when none)."""
    if not parts:
        return ""
    return ("uncalibrated hardware (no published serving measurement in calibration.toml; efficiencies of "
            "the part named): " + ", ".join(f"{n} <- {src}" for n, src in parts.items()))


# FP4 weights on a part without FP4 tensor cores (Hopper, A100, MI300X, L40S, 910C) run one of two ways:
#   w4a16:      the FP4 bytes stay, each GEMM dequantizes them in the kernel and multiplies in
#               BF16 (the BF16 peak).  The engines' default: vLLM's MXFP4 MoE below SM100 is
#               Marlin or triton_kernels under `mxfp4_w4a16_moe_quant_config`
#               (vllm/model_executor/layers/quantization/mxfp4.py, 2025-10), SGLang's the
#               same Marlin W4A16 path.
#   fp8_repack: the checkpoint repacked to FP8 (the model's own FP8 format, block scales
#               included): ~1.9 x the expert bytes, at the FP8 peak.
# A native part (peak_tflops_fp4 > 0) runs FP4 bytes at the FP4 peak whatever the choice.
Fp4Mode = Literal["w4a16", "fp8_repack"]
FP4_MODES: tuple[Fp4Mode, ...] = ("w4a16", "fp8_repack")
# FP8 weights with one FP32 scale per 128 x 128 block (DeepSeek's format): the repack of a
# model whose other weights are not FP8.
FP8_BLOCK_BYTES = 1.0 + 4 / (128 * 128)


def fp4_experts(model: ModelProfile) -> bool:
    return 0 < model.expert_bytes_per_param < FP4_MAX_BYTES


@functools.lru_cache(maxsize=64)
def as_run(model: ModelProfile, hw: HardwareProfile, fp4_on_non_native: Fp4Mode) -> ModelProfile:
    """`model` as `hw` serves it: the same profile unless its routed experts are FP4, the part
    has no FP4 tensor cores and the choice is "fp8_repack" - then experts of FP8 bytes (the
    model's FP8 bytes per parameter, else `FP8_BLOCK_BYTES`).  The peak each GEMM runs at
    follows from its bytes (`HardwareProfile.gemm_peak_flops`); weights for the fit from the
    profile's bytes."""
    if fp4_on_non_native not in FP4_MODES:
        raise ValueError(f"fp4_on_non_native must be one of {FP4_MODES}, got {fp4_on_non_native!r}")
    if fp4_on_non_native == "w4a16" or hw.native_fp4 or not fp4_experts(model):
        return model
    fp8 = model.weight_bytes_per_param if model.weight_bytes_per_param < 1.5 else FP8_BLOCK_BYTES
    return dataclasses.replace(model, expert_bytes_per_param=fp8)


@functools.lru_cache(maxsize=32)
def model(name: str) -> ModelProfile:
    """A model profile: a dense one defined here, a shipped config.json (model_configs/NAME.json),
    or the path of a config.json (a file or the directory holding one)."""
    if name in MODELS:
        return MODELS[name]
    try:
        return hf_config.load_profile(name)
    except hf_config.ModelConfigError as e:
        known = ", ".join(sorted({*MODELS, *hf_config.shipped()}))
        raise KeyError(f"unknown model profile {name!r} (known: {known}; or a config.json path): {e}") from None
