"""Getting weights into a `LlamaModel`: the built-in tiny model, Hugging Face
checkpoints (safetensors, one file or shards), GGUF files (gguf.py), and
writing a checkpoint back (`export_model`).

What `model.path` names (`load_spec`, `load_model`): "" or "tiny" = the
built-in tiny model; a named alias (`gguf.NAMED`), a `.gguf` file or a
directory holding one = a GGUF checkpoint; else a Hugging Face checkpoint
directory.  `served_model_name` is the id a front door reports.

Name mapping is strict: every tensor the model needs must be in the
checkpoint and every checkpoint tensor must be used (except RoPE `inv_freq`
buffers and an `lm_head.weight` equal to tied embeddings); anything else is
a `WeightsError` naming the tensors.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pddgw.engines.base import engine_class
from pddgw.engines.kv_pool import DTYPES
from pddgw.engines.model import LlamaModel
from pddgw.engines.model_spec import TINY, ModelSpec, WeightsError, is_tiny, quote_names, read_json
from pddgw.engines.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, special_ids

if TYPE_CHECKING:
    from pddgw.config import ModelConfig

# Logit standard deviation of the tiny model over byte tokens (see `build_tiny`).
TINY_LOGIT_STD = 8.0


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r} (one of {', '.join(DTYPES)})") from None


def tiny_spec() -> ModelSpec:
    return ModelSpec(
        arch="tiny", vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
        rope_scaling=None, tie_word_embeddings=False, attention_bias=False, qk_norm=False,
        max_position_embeddings=4096, bos_token_id=ByteTokenizer.BOS,
        eos_token_ids=(ByteTokenizer.EOS, ByteTokenizer.IM_END_ID))


def tiny_output_mask(vocab_size: int) -> torch.Tensor:
    """[vocab] bool: the ids the tiny model emits (printable ASCII and newline)."""
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[32:127] = True
    mask[ord("\n")] = True
    return mask


def _tiny_tensor(name: str, shape: torch.Size, spec: ModelSpec, g: torch.Generator) -> torch.Tensor:
    """Values of one tiny-model weight, float32 on CPU, drawn from `g`."""
    h = spec.hidden_size
    randn = torch.randn(shape, generator=g, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * randn
    if name == "model.embed_tokens.weight":
        return randn
    if name == "lm_head.weight":
        w = randn * (TINY_LOGIT_STD / h ** 0.5)
        w[~tiny_output_mask(spec.vocab_size)] = 0.0   # these ids never win (`build_tiny`)
        return w
    if name.endswith("o_proj.weight"):
        return randn / spec.q_size ** 0.5
    if name.endswith("down_proj.weight"):
        return randn / spec.intermediate_size ** 0.5
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        # Sharper attention than 1/sqrt(h) so context matters for the next token.
        return randn * (2.0 / h ** 0.5)
    return randn / h ** 0.5     # v, gate, up


def build_tiny(seed: int, dtype: torch.dtype | str, device: str | torch.device) -> LlamaModel:
    """The built-in tiny model; identical for a given seed on every machine and process.

    Seeded with a CPU generator in float32 (a float64 copy holds the same values).  Its output
    rows are zero except printable ASCII and newline, scaled so the top logits are far apart:
    greedy output is readable, never flips between dtypes or batchings, and has no eos.
    """
    return build_random(tiny_spec(), seed, dtype, device)


def build_random(spec: ModelSpec, seed: int, dtype: torch.dtype | str, device: str | torch.device) -> LlamaModel:
    """A model of any dense spec with the tiny model's seeded random weights (benchmarks
    that need another KV shape); identical for a given spec and seed everywhere."""
    model = LlamaModel(spec, resolve_dtype(dtype), device)
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, view in model.hf_tensors().items():   # fixed insertion order
            view.copy_(_tiny_tensor(name, view.shape, spec, g))
    return model


def _checkpoint_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise WeightsError(f"{index}: weight_map must be an object of tensor name -> file name")
        return [d / f for f in sorted(set(weight_map.values()))]
    if (d / "model.safetensors").exists():
        return [d / "model.safetensors"]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{d}: no *.safetensors files")
    return files


def _ignorable(name: str) -> bool:
    return name.endswith("rotary_emb.inv_freq")


def _open_safetensors(path: Path):
    """safe_open of one weights file; WeightsError naming it when it is missing or not safetensors."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise WeightsError(f"{path}: not a readable safetensors file ({e})") from None


def load_hf_weights(model: LlamaModel, directory: str | Path) -> None:
    """Copy a safetensors checkpoint into `model`, cast to its dtype, strictly by name."""
    d = Path(directory)
    targets = model.hf_tensors()
    loaded: set[str] = set()
    unexpected: list[str] = []
    tied_head: torch.Tensor | None = None
    with torch.no_grad():
        for path in _checkpoint_files(d):
            with _open_safetensors(path) as f:
                for name in f.keys():
                    if _ignorable(name):
                        continue
                    if name == "lm_head.weight" and model.spec.tie_word_embeddings:
                        tied_head = f.get_tensor(name)
                        continue
                    view = targets.get(name)
                    if view is None:
                        unexpected.append(name)
                        continue
                    if name in loaded:
                        raise WeightsError(f"{d}: tensor {name!r} appears in two files")
                    t = f.get_tensor(name)
                    if tuple(t.shape) != tuple(view.shape):
                        raise WeightsError(f"{d}: tensor {name!r} has shape {tuple(t.shape)}, "
                                           f"config implies {tuple(view.shape)}")
                    view.copy_(t)
                    loaded.add(name)
    if unexpected:
        raise WeightsError(f"{d}: unexpected tensors {quote_names(unexpected)} "
                           f"(not used by a {model.spec.arch} model with this config)")
    missing = [n for n in targets if n not in loaded]
    if missing:
        raise WeightsError(f"{d}: missing tensors {quote_names(missing)}")
    if tied_head is not None and not torch.equal(tied_head.to(model.dtype).to(model.device),
                                                 model.embed):
        raise WeightsError(f"{d}: tie_word_embeddings is true but lm_head.weight differs "
                           "from model.embed_tokens.weight")


def served_model_name(path: str | None) -> str:
    """The model id /v1/models reports for `model.path`."""
    from pddgw.engines.gguf import served_name

    return "pddgw-tiny" if is_tiny(path) else served_name(path)  # type: ignore[arg-type]


def load_spec(path: str | None) -> tuple[ModelSpec, Tokenizer]:
    """A model's spec and tokenizer without its weights (what a router needs).

    `path` as the module docstring says; eos ids as `tokenizer.special_ids` finds them.
    Without tokenizer.json the tokenizer is a `ByteTokenizer`.  Any file that cannot be
    used is a WeightsError naming it.
    """
    if is_tiny(path):
        spec = tiny_spec()
        return spec, ByteTokenizer(spec.vocab_size)
    from pddgw.engines import gguf

    gguf_file = gguf.resolve_gguf(path)  # type: ignore[arg-type]
    if gguf_file is not None:
        ck = gguf.read_gguf(gguf_file)
        return ck.spec, gguf.gguf_tokenizer(ck)
    d = Path(path)  # type: ignore[arg-type]
    if not d.exists():
        raise WeightsError(f"{d}: no such directory (expected a Hugging Face model directory: "
                           "config.json, *.safetensors, tokenizer.json)")
    if not d.is_dir():
        raise WeightsError(f"{d}: not a directory (expected a Hugging Face model directory: "
                           "config.json, *.safetensors, tokenizer.json)")
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise WeightsError(f"{d}: no config.json (expected a Hugging Face model directory)")
    config = read_json(cfg_path)
    try:
        spec = ModelSpec.from_hf_config(config)
    except (ValueError, TypeError) as e:
        raise WeightsError(f"{cfg_path}: {str(e).removeprefix('config.json: ')}") from None
    if (d / "tokenizer.json").is_file():
        tok = HFTokenizer.from_dir(d, spec.vocab_size, config)
        return dataclasses.replace(spec, eos_token_ids=tok.eos_token_ids), tok
    if spec.vocab_size >= ByteTokenizer.MIN_VOCAB:
        # No tokenizer.json (a saved tiny model, a random test checkpoint): bytes.
        _, eos = special_ids(d, spec.vocab_size, config=config)
        return dataclasses.replace(spec, eos_token_ids=eos), ByteTokenizer(spec.vocab_size, eos)
    raise WeightsError(f"{d}: no tokenizer.json, and vocab_size {spec.vocab_size} is too "
                       f"small for the byte tokenizer (needs {ByteTokenizer.MIN_VOCAB})")


def load_spec_for(model: ModelConfig) -> tuple[ModelSpec, Tokenizer, str]:
    """`load_spec` for a `ModelConfig`, and the KV dtype its engines use.

    A `profile` (cost-model engine) is a model shape without weights: its
    spec, a byte tokenizer, and the profile's own KV dtype.
    """
    if model.profile:
        # Shapes are the cost-model engine's (the sim layer): reached through the engine registry.
        return engine_class("costmodel").spec_for(model)  # type: ignore[attr-defined]
    from pddgw.engines.dtypes import model_dtype

    spec, tok = load_spec(model.path or None)
    return spec, tok, model_dtype(model)


def load_model(path: str | None, dtype: torch.dtype | str, device: str | torch.device,
               tiny_seed: int = 0) -> tuple[LlamaModel, Tokenizer]:
    """A model and its tokenizer (see `load_spec`); the tokenizer is read before
    gigabytes of weights, so a bad directory fails early."""
    dt = resolve_dtype(dtype)
    if is_tiny(path):
        model = build_tiny(tiny_seed, dt, device)
        return model, ByteTokenizer(model.spec.vocab_size)
    from pddgw.engines import gguf

    spec, tok = load_spec(path)
    model = LlamaModel(spec, dt, device)
    gguf_file = gguf.resolve_gguf(path)  # type: ignore[arg-type]
    if gguf_file is not None:
        gguf.load_gguf_weights(model, gguf_file)
    else:
        load_hf_weights(model, Path(path))  # type: ignore[arg-type]
    return model, tok


class SharedModels:
    """One load of each model for the engines of one process, keyed by (path, dtype, device,
    tiny seed): weights are read, dequantized and held once instead of once per engine.

    Sharing keeps every node bit-identical: an engine only reads its model, and `prepack`
    repacks only weights written since the last pack.  Thread-safe.
    """

    def __init__(self) -> None:
        self._loaded: dict[tuple[str, torch.dtype, str, int], tuple[LlamaModel, Tokenizer]] = {}
        self._lock = threading.Lock()

    def load(self, path: str | None, dtype: torch.dtype | str, device: str | torch.device,
             tiny_seed: int = 0) -> tuple[LlamaModel, Tokenizer]:
        """`load_model`'s model and tokenizer, loaded on the first call for their key."""
        key = (path or TINY, resolve_dtype(dtype), str(torch.device(device)), tiny_seed)
        with self._lock:
            if key not in self._loaded:
                self._loaded[key] = load_model(path, dtype, device, tiny_seed)
            return self._loaded[key]

    def clear(self) -> None:
        """Forget every model (the engines that hold one keep it)."""
        with self._lock:
            self._loaded.clear()


def save_hf_checkpoint(model: LlamaModel, directory: str | Path) -> None:
    """Write config.json + model.safetensors with Hugging Face names (loadable by
    `transformers` and by `load_model`, which pairs it with a `ByteTokenizer`)."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    cfg = model.spec.to_hf_config()
    cfg["dtype"] = next(k for k, v in DTYPES.items() if v == model.dtype)
    # Clones: the fused layout makes q/k/v (and gate/up) views of one storage,
    # and safetensors refuses tensors that share memory.
    tensors = {n: t.detach().to("cpu").clone() for n, t in model.hf_tensors().items()}
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


# The built-in template (tokenizer.py's module docstring) as Jinja, for an exported
# ByteTokenizer: byte ids do not depend on context, so rendering and encoding the
# whole text gives the ids the built-in template builds piece by piece.
BYTE_CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                      "{{ message['content'] }}<|im_end|>\n{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_tokenizer_json(tok: ByteTokenizer) -> str:
    """`ByteTokenizer` as a `tokenizers` tokenizer.json: a byte-level BPE whose 256
    byte tokens have ids 0..255 (no merges), its specials at their ids, the ids up
    to vocab_size reserved specials (decode drops them, as ByteTokenizer does), and a
    post-processor that puts bos in front (so the built-in template's bos is implied)."""
    from tokenizers import AddedToken, decoders, pre_tokenizers, processors
    from tokenizers import Tokenizer as _Tok
    from tokenizers.models import BPE

    from pddgw.engines.gguf import _byte_alphabet

    alphabet = _byte_alphabet()
    t = _Tok(BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[], fuse_unk=False))
    # use_regex=False: no splitting; with one token per byte the split cannot matter anyway.
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    t.decoder = decoders.ByteLevel()
    names = list(ByteTokenizer.SPECIALS) + [f"<|reserved_{i}|>" for i in range(ByteTokenizer.MIN_VOCAB,
                                                                                 tok.vocab_size)]
    t.add_special_tokens([AddedToken(n, normalized=False, special=True) for n in names])
    bos = ByteTokenizer.SPECIALS[0]
    t.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                     special_tokens=[(bos, ByteTokenizer.BOS)])
    return t.to_str()


def _tokenizer_files(tok: Tokenizer) -> dict[str, str]:
    """tokenizer.json and tokenizer_config.json for `tok` (HFTokenizer or ByteTokenizer)."""
    if isinstance(tok, ByteTokenizer):
        data = byte_tokenizer_json(tok)
        templates: dict[str, str] = {"default": BYTE_CHAT_TEMPLATE}
        specials = {"bos_token": "<bos>", "eos_token": "<|im_end|>", "pad_token": "<pad>"}
        add_bos = True
    elif isinstance(tok, HFTokenizer):
        data = tok.json_text
        tpl = tok.chat_template
        templates = dict(tpl.sources) if tpl is not None else {"default": BYTE_CHAT_TEMPLATE}
        specials = dict(tpl.special_tokens) if tpl is not None else {}
        add_bos = tok._add_bos
    else:
        raise TypeError(f"cannot export a {type(tok).__name__}")
    cfg: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": add_bos,
                 "add_eos_token": False, "clean_up_tokenization_spaces": False, **specials}
    if list(templates) == ["default"]:
        cfg["chat_template"] = templates["default"]
    else:
        cfg["chat_template"] = [{"name": n, "template": s} for n, s in templates.items()]
    return {"tokenizer.json": data, "tokenizer_config.json": json.dumps(cfg, indent=2) + "\n"}


def export_model(model: LlamaModel, tok: Tokenizer, directory: str | Path) -> Path:
    """Write `model` and `tok` as a Hugging Face directory that `transformers`
    (AutoTokenizer, AutoModelForCausalLM) and `load_model` both load: config.json,
    model.safetensors, generation_config.json (eos ids), tokenizer.json and
    tokenizer_config.json (chat template, special tokens)."""
    d = Path(directory)
    save_hf_checkpoint(model, d)
    spec = model.spec
    gen = {"bos_token_id": spec.bos_token_id, "eos_token_id": list(spec.eos_token_ids),
           "do_sample": False}
    (d / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    for name, text in _tokenizer_files(tok).items():
        (d / name).write_text(text, encoding="utf-8")
    return d
