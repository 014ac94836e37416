"""What the cost model knows about GPUs and models: datasheet numbers, config shapes, calibrated efficiencies.

`HardwareProfile` holds one GPU's datasheet peaks (BF16 dense tensor-core
FLOP/s, HBM bandwidth and capacity, NVLink bandwidth) and four numbers that
are not on any datasheet: the fraction of the FLOP/s peak a prefill reaches,
the fraction of the HBM peak a decode reaches, a fixed cost per engine step
and the fixed latency of one tensor-parallel all-reduce.  Those four are
fitted to published end-to-end measurements (`python -m
pddgw.bench.calibration` prints the comparison; CALIBRATION.md beside this
file says where the fit holds and where it does not).

`ModelProfile` is a decoder's shape as its Hugging Face `config.json` states
it, without weights: enough for FLOPs, bytes and KV size, and for the
`ModelSpec` the paged engine needs (`to_spec`).

Units: FLOP/s and bytes are decimal (1 TB = 1e12 B, 1 GB = 1e9 B), as on
NVIDIA datasheets; KV sizes are exact byte counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pddgw.engines.model_spec import ModelSpec, RopeScaling


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


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
    # small decode all-reduces.  0 = bandwidth-only communication.
    allreduce_latency_us: float = 0.0

    def __post_init__(self) -> None:
        _check(bool(self.name), "name must not be empty")
        for f in ("peak_tflops_bf16", "hbm_tb_s", "hbm_gb", "interconnect_gb_s"):
            _check(getattr(self, f) > 0, f"{f} must be > 0")
        for f in ("compute_efficiency", "bandwidth_efficiency"):
            _check(0 < getattr(self, f) <= 1, f"{f} must be in (0, 1]")
        _check(self.step_overhead_ms >= 0, "step_overhead_ms must be >= 0")
        _check(self.price_per_gpu_hour >= 0, "price_per_gpu_hour must be >= 0")
        _check(self.allreduce_latency_us >= 0, "allreduce_latency_us must be >= 0")


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
#
# Efficiencies, overheads and all-reduce latencies are fitted to the
# published measurements in pddgw/bench/calibration.py; CALIBRATION.md lists
# the rows and the residuals:
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
#     Splitwise profiles agree); the only H100 prefill profile found
#     (Splitwise, 2023; 16-bit assumed, the data does not say) reaches ~0.4.
#     H200 has the same SMs and clocks as H100 and no published bf16 prefill
#     profile was found, so it inherits H100's.
#
# Prices: on-demand USD per GPU-hour at specialty GPU clouds, inside the
# ranges of mercatus-ai.com/blog/cloud-gpu-pricing (May 2026): A100 80GB
# $1.10-1.50, H100 SXM $2.50-3.50, H200 SXM $3.50-4.50.
HARDWARE: dict[str, HardwareProfile] = {p.name: p for p in (
    HardwareProfile(
        name="A100-80G",
        peak_tflops_bf16=312.0,
        hbm_tb_s=2.039,
        hbm_gb=80.0,
        interconnect_gb_s=300.0,
        compute_efficiency=0.65,
        bandwidth_efficiency=0.8,
        step_overhead_ms=2.5,
        price_per_gpu_hour=1.30,
        allreduce_latency_us=30.0,
    ),
    HardwareProfile(
        name="H100-SXM",
        peak_tflops_bf16=989.5,
        hbm_tb_s=3.35,
        hbm_gb=80.0,
        interconnect_gb_s=450.0,
        compute_efficiency=0.40,
        bandwidth_efficiency=0.8,
        step_overhead_ms=2.0,
        price_per_gpu_hour=3.00,
        allreduce_latency_us=25.0,
    ),
    HardwareProfile(
        name="H200-SXM",
        peak_tflops_bf16=989.5,
        hbm_tb_s=4.8,
        hbm_gb=141.0,
        interconnect_gb_s=450.0,
        compute_efficiency=0.40,
        bandwidth_efficiency=0.8,
        step_overhead_ms=2.0,
        price_per_gpu_hour=3.75,
        allreduce_latency_us=25.0,
    ),
)}


@dataclass(frozen=True, slots=True)
class ModelProfile:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    arch: Literal["llama", "qwen3"]     # llama: plain; qwen3: per-head RMSNorm on q and k
    rope_theta: float
    rms_norm_eps: float
    num_experts: int = 0           # MoE: routed experts (0 = dense)
    experts_per_token: int = 0     # MoE: active routed experts per token
    moe_intermediate_size: int = 0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    weight_bytes_per_param: int = 2   # bf16
    kv_bytes_per_value: int = 2       # bf16 KV cache

    def __post_init__(self) -> None:
        _check(bool(self.name), "name must not be empty")
        _check(self.arch in ("llama", "qwen3"), f"arch must be 'llama' or 'qwen3', got {self.arch!r}")
        for f in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
                  "max_position_embeddings", "weight_bytes_per_param", "kv_bytes_per_value"):
            _check(getattr(self, f) > 0, f"{f} must be > 0")
        _check(self.num_heads % self.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads")
        if self.num_experts:
            _check(0 < self.experts_per_token <= self.num_experts,
                   "experts_per_token must be in [1, num_experts]")
            _check(self.moe_intermediate_size > 0, "moe_intermediate_size must be > 0 for a MoE model")
        else:
            _check(self.experts_per_token == 0 and self.moe_intermediate_size == 0,
                   "experts_per_token and moe_intermediate_size need num_experts > 0")
            _check(self.intermediate_size > 0, "intermediate_size must be > 0")

    # ---- parameters (every MLP is SwiGLU: gate, up, down) ------------------------------
    @property
    def _attention_params(self) -> int:
        """q, k, v, o projections (no bias) and, for qwen3, the q/k RMSNorm weights, per layer."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        norms = 2 * self.head_dim if self.arch == "qwen3" else 0
        return self.hidden_size * (q + 2 * kv) + q * self.hidden_size + norms

    @property
    def _expert_params(self) -> int:
        """One routed expert's SwiGLU MLP."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def _mlp_params(self) -> int:
        """Per layer: the dense MLP, or every routed expert plus the router."""
        if self.num_experts:
            return self.num_experts * self._expert_params + self.hidden_size * self.num_experts
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def _embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def param_count(self) -> int:
        """All parameters: embedding, layers (2 RMSNorms each), final norm, LM head unless tied."""
        layer = self._attention_params + self._mlp_params + 2 * self.hidden_size
        head = 0 if self.tie_word_embeddings else self._embedding_params
        return self._embedding_params + self.num_layers * layer + self.hidden_size + head

    @property
    def active_params_per_token(self) -> int:
        """Parameters one token multiplies with: everything but the embedding table (a
        lookup) and the routed experts it does not visit; the LM head counts (tied or not)."""
        inactive = self.num_layers * (self.num_experts - self.experts_per_token) * self._expert_params
        lookup = 0 if self.tie_word_embeddings else self._embedding_params
        return self.param_count - lookup - inactive

    @property
    def weight_bytes(self) -> int:
        return self.param_count * self.weight_bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_value

    def to_spec(self) -> ModelSpec:
        """The paged engine's view of this model (dense models only: the engine has no MoE)."""
        _check(not self.num_experts, f"{self.name}: the engine's ModelSpec has no MoE layers")
        return ModelSpec(
            arch=self.arch,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            tie_word_embeddings=self.tie_word_embeddings,
            attention_bias=False,
            qk_norm=self.arch == "qwen3",
            max_position_embeddings=self.max_position_embeddings,
            bos_token_id=self.bos_token_id,
            eos_token_ids=self.eos_token_ids,
        )


# Shapes from each model's Hugging Face config.json (all: SiLU, no attention
# bias, untied embeddings, bf16 weights).
MODELS: dict[str, ModelProfile] = {p.name: p for p in (
    # meta-llama/Meta-Llama-3-70B config.json.
    ModelProfile(
        name="llama3-70b", num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8, head_dim=128,
        intermediate_size=28672, vocab_size=128256, max_position_embeddings=8192,
        eos_token_ids=(128001,), bos_token_id=128000, arch="llama", rope_theta=500000.0, rms_norm_eps=1e-5,
    ),
    # meta-llama/Llama-3.1-70B config.json: the same layers, 128K context via
    # "llama3" RoPE scaling; the shape for the paper's 64K-token prompts.
    ModelProfile(
        name="llama3.1-70b", num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8, head_dim=128,
        intermediate_size=28672, vocab_size=128256, max_position_embeddings=131072,
        eos_token_ids=(128001,), bos_token_id=128000, arch="llama", rope_theta=500000.0, rms_norm_eps=1e-5,
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
    ),
    # meta-llama/Meta-Llama-3-8B config.json (small fidelity runs).
    ModelProfile(
        name="llama3-8b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
        intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192,
        eos_token_ids=(128001,), bos_token_id=128000, arch="llama", rope_theta=500000.0, rms_norm_eps=1e-5,
    ),
    # meta-llama/Llama-2-70b-hf config.json: the model of most 2023 published
    # measurements (calibration); Llama-3-70B layers with a 32K vocabulary.
    ModelProfile(
        name="llama2-70b", num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8, head_dim=128,
        intermediate_size=28672, vocab_size=32000, max_position_embeddings=4096,
        eos_token_ids=(2,), bos_token_id=1, arch="llama", rope_theta=10000.0, rms_norm_eps=1e-5,
    ),
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


def model(name: str) -> ModelProfile:
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model profile {name!r} (known: {', '.join(sorted(MODELS))})") from None
