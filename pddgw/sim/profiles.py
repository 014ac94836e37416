"""What the cost model knows about GPUs and models: datasheet numbers, config shapes, calibrated efficiencies.

`HardwareProfile` holds one GPU's datasheet peaks (BF16 dense tensor-core
FLOP/s, HBM bandwidth and capacity, NVLink bandwidth) and four numbers that
are not on any datasheet: the fraction of the FLOP/s peak a prefill reaches,
the fraction of the HBM peak a decode reaches, a fixed cost per engine step
and the fixed latency of one tensor-parallel all-reduce.  Those four are
fitted to published end-to-end measurements (`python -m
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
from dataclasses import dataclass

from pddgw.core.errors import check as _check
from pddgw.engines.model_spec import RopeScaling
from pddgw.sim import hf_config
from pddgw.sim.model_shape import ModelProfile


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
    price_per_gpu_hour: float    # USD, for cost / BCR reports
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

    def __post_init__(self) -> None:
        _check(bool(self.name), "name must not be empty")
        for f in ("peak_tflops_bf16", "hbm_tb_s", "hbm_gb", "interconnect_gb_s"):
            _check(getattr(self, f) > 0, f"{f} must be > 0")
        for f in ("compute_efficiency", "bandwidth_efficiency"):
            _check(0 < getattr(self, f) <= 1, f"{f} must be in (0, 1]")
        _check(self.step_overhead_ms >= 0, "step_overhead_ms must be >= 0")
        _check(self.price_per_gpu_hour >= 0, "price_per_gpu_hour must be >= 0")
        _check(self.allreduce_latency_us >= 0, "allreduce_latency_us must be >= 0")
        _check(self.peak_tflops_fp8 >= 0, "peak_tflops_fp8 must be >= 0")
        _check(self.scaleout_gb_s >= 0, "scaleout_gb_s must be >= 0")

    def peak_flops(self, fp8: bool) -> float:
        """FLOP/s peak for a GEMM with FP8 (or FP4, run as FP8 on Hopper) weights or BF16 ones."""
        return (self.peak_tflops_fp8 if fp8 and self.peak_tflops_fp8 else self.peak_tflops_bf16) * 1e12


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
# H800 SXM5 (DeepSeek's own serving part): the H100 SXM die and HBM3 (same
#   FP8 / BF16 peaks, 80 GB at 3.35 TB/s) with NVLink cut to 400 GB/s both
#   directions together (NVIDIA H800 SXM5 specification; DeepSeek-V3
#   technical report, arXiv 2412.19437, sec. 3.1-3.2.2: "NVLink ... 160 GB/s"
#   achieved, "IB (50 GB/s)" per GPU: 8 x 400 Gb/s InfiniBand per node).
#   Efficiencies are H100's (same SMs, clocks and HBM).  Price: the $2 per
#   H800 GPU-hour DeepSeek's inference-system overview assumes.
#
# Prices: on-demand USD per GPU-hour at specialty GPU clouds, inside the
# ranges of mercatus-ai.com/blog/cloud-gpu-pricing (May 2026): A100 80GB
# $1.10-1.50, H100 SXM $2.50-3.50, H200 SXM $3.50-4.50.
_H100 = HardwareProfile(
    name="H100-SXM", peak_tflops_bf16=989.5, peak_tflops_fp8=1979.0, hbm_tb_s=3.35, hbm_gb=80.0,
    interconnect_gb_s=450.0, scaleout_gb_s=50.0, allreduce_latency_us=25.0,
    compute_efficiency=0.40, bandwidth_efficiency=0.8, step_overhead_ms=2.0, price_per_gpu_hour=3.00,
)
HARDWARE: dict[str, HardwareProfile] = {p.name: p for p in (
    HardwareProfile(
        name="A100-80G", peak_tflops_bf16=312.0, hbm_tb_s=2.039, hbm_gb=80.0,
        interconnect_gb_s=300.0, scaleout_gb_s=25.0, allreduce_latency_us=30.0,
        compute_efficiency=0.65, bandwidth_efficiency=0.8, step_overhead_ms=2.5, price_per_gpu_hour=1.30,
    ),
    _H100,
    # The H100 die and HBM; NVLink cut to half, and DeepSeek's price (above).
    dataclasses.replace(_H100, name="H800-SXM", interconnect_gb_s=200.0, price_per_gpu_hour=2.00),
    # The H100's SMs and clocks with HBM3e: 141 GB at 4.8 TB/s.
    dataclasses.replace(_H100, name="H200-SXM", hbm_tb_s=4.8, hbm_gb=141.0, price_per_gpu_hour=3.75),
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
