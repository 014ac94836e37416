"""Model profiles from a Hugging Face `config.json`: the shipped ones or a user's own file.

`profile_from_hf_config(d, name)` decodes one config at the edge: every key the cost model
needs is checked here and an architecture it cannot price is refused naming the key.
Supported `model_type`s: llama, qwen3 (dense GQA), qwen3_moe (GQA + MoE), deepseek_v3 and
kimi_k2 (MLA + MoE), deepseek_v4 (sliding-window / CSA / HCA + MoE); the last three with their
`num_nextn_predict_layers` MTP layers.

Bytes per parameter: FP8 with `weight_block_size` [a, b] is 1 plus one scale per a x b block
(4 bytes, or 1 with `scale_fmt` "ue8m0"); `expert_dtype` "fp4" makes routed experts MXFP4
(0.53125); otherwise `torch_dtype` (BF16: 2).  KV precision is a serving choice: `kv_dtype`
"auto" is FP8 for DeepSeek-V4 (SGLang's default pool for it), BF16 otherwise.

`load_profile(name_or_path)` resolves a shipped name (model_configs/NAME.json, provenance in
model_configs/SOURCES.md) or a path to a config.json or its directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pddgw.engines.model_spec import RopeScaling
from pddgw.sim.model_shape import ModelProfile

CONFIG_DIR = Path(__file__).resolve().parent / "model_configs"
FP4_BYTES_PER_PARAM = 0.5 + 1 / 32        # MXFP4: E2M1 values, one UE8M0 scale per 32
_MLA_TYPES = ("deepseek_v3", "kimi_k2")
MODEL_TYPES = ("llama", "qwen3", "qwen3_moe", *_MLA_TYPES, "deepseek_v4")


class ModelConfigError(ValueError):
    """A config.json the cost model cannot price; the message names the file and key."""


def shipped() -> list[str]:
    """Names of the shipped config.json files."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def _weight_bytes(d: dict[str, Any], where: str) -> tuple[float, float]:
    """(bytes per parameter, routed-expert bytes per parameter or 0 = the same)."""
    q = d.get("quantization_config")
    expert_dtype = d.get("expert_dtype") or (q or {}).get("expert_dtype")
    if q:
        if q.get("quant_method") != "fp8":
            raise ModelConfigError(f"{where}: quantization_config.quant_method {q.get('quant_method')!r} "
                                   "unsupported (fp8 only)")
        a, b = q.get("weight_block_size") or (0, 0)
        scale = 1 if q.get("scale_fmt") == "ue8m0" else 4
        per_param = 1.0 + (scale / (a * b) if a and b else 0.0)
    else:
        dtype = d.get("torch_dtype") or d.get("dtype") or "bfloat16"
        if dtype not in ("bfloat16", "float16"):
            raise ModelConfigError(f"{where}: torch_dtype {dtype!r} unsupported (bfloat16, float16)")
        per_param = 2.0
    if expert_dtype in (None, "", "fp8", "bf16"):
        return per_param, 0.0
    if expert_dtype != "fp4":
        raise ModelConfigError(f"{where}: expert_dtype {expert_dtype!r} unsupported (fp4)")
    return per_param, FP4_BYTES_PER_PARAM


def _rope_scaling(d: dict[str, Any]) -> RopeScaling | None:
    rs = d.get("rope_scaling")
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
        return RopeScaling(float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"]),
                           int(rs["original_max_position_embeddings"]))
    return None       # YaRN and others change no FLOP or byte


def profile_from_hf_config(d: dict[str, Any], name: str, kv_dtype: Literal["auto", "bf16", "fp8"] = "auto",
                           where: str = "config.json") -> ModelProfile:
    """The profile of a decoded config.json (module docstring for what is read)."""
    if "text_config" in d and "model_type" not in d.get("text_config", {}):
        raise ModelConfigError(f"{where}: text_config has no model_type")
    if "text_config" in d:                      # multimodal wrappers keep the decoder there
        d = {**d["text_config"], **{k: v for k, v in d.items() if k == "quantization_config"}}
    mt = d.get("model_type")
    if mt not in MODEL_TYPES:
        raise ModelConfigError(f"{where}: model_type {mt!r} unsupported (supported: {', '.join(MODEL_TYPES)})")

    def req(key: str) -> Any:
        if d.get(key) is None:
            raise ModelConfigError(f"{where}: missing required key {key!r} for model_type {mt!r}")
        return d[key]

    if d.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"{where}: hidden_act {d['hidden_act']!r} unsupported (silu)")
    wbytes, ebytes = _weight_bytes(d, where)
    kv = {"auto": 1 if mt == "deepseek_v4" else 2, "bf16": 2, "fp8": 1}[kv_dtype]
    eos = d.get("eos_token_id")
    layers, hidden, heads = int(req("num_hidden_layers")), int(req("hidden_size")), int(req("num_attention_heads"))
    common: dict[str, Any] = dict(
        name=name, num_layers=layers, hidden_size=hidden, num_heads=heads,
        vocab_size=int(req("vocab_size")), max_position_embeddings=int(req("max_position_embeddings")),
        eos_token_ids=() if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos])),
        bos_token_id=None if d.get("bos_token_id") is None else int(d["bos_token_id"]),
        rope_theta=float(d.get("rope_theta", 10000.0)), rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_scaling=_rope_scaling(d), tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        weight_bytes_per_param=wbytes, expert_bytes_per_param=ebytes, kv_bytes_per_value=kv,
    )
    try:
        if mt in ("llama", "qwen3", "qwen3_moe"):
            kv_heads = int(d.get("num_key_value_heads") or heads)
            moe = {}
            if mt == "qwen3_moe":
                if d.get("mlp_only_layers") or d.get("decoder_sparse_step", 1) != 1:
                    raise ModelConfigError(f"{where}: mlp_only_layers / decoder_sparse_step != 1 unsupported")
                moe = dict(num_experts=int(req("num_experts")), experts_per_token=int(req("num_experts_per_tok")),
                           moe_intermediate_size=int(req("moe_intermediate_size")))
            return ModelProfile(**common, arch="llama" if mt == "llama" else "qwen3", num_kv_heads=kv_heads,
                                head_dim=int(d.get("head_dim") or hidden // heads),
                                intermediate_size=0 if moe else int(req("intermediate_size")), **moe)
        moe = dict(num_experts=int(req("n_routed_experts")), experts_per_token=int(req("num_experts_per_tok")),
                   moe_intermediate_size=int(req("moe_intermediate_size")),
                   num_shared_experts=int(d.get("n_shared_experts") or 0),
                   first_k_dense=int(d.get("first_k_dense_replace") or 0))
        if d.get("moe_layer_freq", 1) != 1:
            raise ModelConfigError(f"{where}: moe_layer_freq != 1 unsupported")
        # DeepSeek's multi-token-prediction layers: held for the draft, priced by memory_fit.
        moe["num_mtp_layers"] = int(d.get("num_nextn_predict_layers") or 0)
        if mt in _MLA_TYPES:
            nope, rope = int(req("qk_nope_head_dim")), int(req("qk_rope_head_dim"))
            return ModelProfile(**common, **moe, arch="llama", attention="mla", num_kv_heads=1,
                                head_dim=nope + rope,
                                intermediate_size=int(req("intermediate_size")) if moe["first_k_dense"] else 0,
                                q_lora_rank=int(d.get("q_lora_rank") or 0), kv_lora_rank=int(req("kv_lora_rank")),
                                qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=int(req("v_head_dim")))
        ratios = tuple(int(r) for r in req("compress_ratios"))
        if len(ratios) < layers:
            raise ModelConfigError(f"{where}: compress_ratios has {len(ratios)} entries for {layers} layers")
        return ModelProfile(**common, **moe, arch="llama", attention="v4", num_kv_heads=1,
                            head_dim=int(req("head_dim")),
                            intermediate_size=int(req("intermediate_size")) if moe["first_k_dense"] else 0,
                            # Entries past num_hidden_layers are the MTP layers' (not run per step here).
                            compress_ratios=ratios[:layers], sliding_window=int(req("sliding_window")),
                            index_n_heads=int(d.get("index_n_heads") or 0),
                            index_head_dim=int(d.get("index_head_dim") or 0),
                            index_topk=int(d.get("index_topk") or 0), q_lora_rank=int(req("q_lora_rank")),
                            qk_rope_head_dim=int(req("qk_rope_head_dim")), o_lora_rank=int(req("o_lora_rank")),
                            o_groups=int(req("o_groups")))
    except ModelConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ModelConfigError(f"{where}: {e}") from None


def load_profile(name_or_path: str | Path, kv_dtype: Literal["auto", "bf16", "fp8"] = "auto") -> ModelProfile:
    """A shipped profile by name, or the profile of a config.json at a path (file or directory)."""
    shipped_path = CONFIG_DIR / f"{name_or_path}.json"
    p = shipped_path if shipped_path.is_file() else Path(name_or_path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ModelConfigError(f"{name_or_path}: neither a shipped model config ({', '.join(shipped())}) "
                               "nor a config.json path")
    try:
        d = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelConfigError(f"{p}: cannot read config.json: {e}") from None
    if not isinstance(d, dict):
        raise ModelConfigError(f"{p}: config.json is not an object")
    return profile_from_hf_config(d, str(name_or_path), kv_dtype, where=str(p))
