"""Text <-> token ids.

Two implementations of one contract: `ByteTokenizer` for the built-in tiny
model (UTF-8 bytes plus a few special tokens) and `HFTokenizer` for a
checkpoint's `tokenizer.json`.

Chat template: a checkpoint's own (`pddgw.engines.chat_template`), tokenized
as transformers' `apply_chat_template(tokenize=True)` does (the template
alone decides on bos); otherwise a built-in ChatML-like one:

    [bos]  <|im_start|>{role}\\n{content}<|im_end|>\\n   (per message)
           <|im_start|>assistant\\n                      (generation prompt)

with the markers as special ids when the vocabulary has them, bos when the
tokenizer adds one to plain text.  Message text is always encoded as plain
text: a special-token string typed by a user never becomes a special id.
"""

from __future__ import annotations

import asyncio
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pddgw.engines.chat_template import ChatTemplate, ControlTokens, normalize_messages, read_special_tokens
from pddgw.engines.model_spec import WeightsError, read_json, token_ids
from pddgw.engines.types import RequestError

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Conversations with more text than this are templated off the event loop by
# `apply_chat_template_async` (a Jinja template always is).
INLINE_TEMPLATE_CHARS = 4096


class Tokenizer(ABC):
    """Contract:

    * `encode(text)` -> ids of the text alone: no bos/eos added, special-token
      strings inside `text` are encoded as ordinary text.
    * `decode(ids)` -> text; special tokens are dropped; an incomplete UTF-8
      sequence decodes to U+FFFD rather than raising.
    * `vocab_size` >= every id either method produces or accepts.
    * `bos_token_id` (or None) and `eos_token_ids` (the ids that end generation).
    * `apply_chat_template(messages, *, add_generation_prompt=True, tools=None,
      documents=None, template_kwargs=None)` -> prompt ids (template in the
      module docstring).  `messages`: `(role, content)` pairs or message dicts
      (`{"role", "content", ...}`; the built-in template needs string content, renders
      `tools` as a system message (`builtin_tools_text`), an assistant's `tool_calls` as the
      JSON call it answered with, and takes no documents).  RequestError when the conversation cannot
      be templated (the template's `raise_exception`, a sandbox refusal, ...).
      CPU-bound and blocking: on an event loop use `apply_chat_template_async`.
    Implementations are immutable after construction and safe to share
    between threads.
    """

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: list[int]) -> str: ...

    # Set by each implementation's __init__; the three properties below read them.
    _vocab_size: int
    _bos: int | None
    _eos: tuple[int, ...]

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @abstractmethod
    def _marker(self, text: str) -> list[int]:
        """Ids of a template marker (IM_START / IM_END)."""

    @property
    @abstractmethod
    def _add_bos(self) -> bool: ...

    @property
    def renders_jinja(self) -> bool:
        """True when `apply_chat_template` runs a checkpoint's Jinja template."""
        return False

    @property
    def adds_bos(self) -> bool:
        """Whether this tokenizer puts bos in front of plain text when asked for special
        tokens (transformers' `add_special_tokens=True`)."""
        return self._add_bos and self.bos_token_id is not None

    def apply_chat_template(self, messages: Sequence[tuple[str, str] | Mapping[str, Any]], *,
                            add_generation_prompt: bool = True, tools: list | None = None,
                            documents: list | None = None,
                            template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        if documents is not None:
            raise RequestError("this model's chat template takes no documents")
        start, end = self._marker(IM_START), self._marker(IM_END)
        ids: list[int] = []
        if self.adds_bos:
            ids.append(self.bos_token_id)
        if tools:
            ids += start + self.encode("system\n" + builtin_tools_text(tools)) + end + self.encode("\n")
        for i, m in enumerate(normalize_messages(messages)):
            role, content = m.get("role"), m.get("content", "" if m.get("tool_calls") else None)
            if not isinstance(role, str) or not isinstance(content, str):
                raise RequestError(f"messages[{i}]: role and content must be strings")
            ids += start + self.encode(f"{role}\n{_builtin_content(m, content)}") + end + self.encode("\n")
        if add_generation_prompt:
            ids += start + self.encode("assistant\n")
        return ids

    async def apply_chat_template_async(self, messages: Sequence[tuple[str, str] | Mapping[str, Any]],
                                        **kwargs: Any) -> list[int]:
        """`apply_chat_template` for event-loop code: run in a worker thread
        (`asyncio.to_thread`) for a Jinja template or a conversation of more
        than INLINE_TEMPLATE_CHARS characters, inline otherwise."""
        if self.renders_jinja or _text_chars(messages) > INLINE_TEMPLATE_CHARS:
            return await asyncio.to_thread(self.apply_chat_template, messages, **kwargs)
        return self.apply_chat_template(messages, **kwargs)


def builtin_tools_text(tools: Sequence[Any]) -> str:
    """The built-in template's tool list (a system message before the conversation): one JSON
    function definition a line, and the call format the model is to answer with."""
    lines = [json.dumps(t.get("function", t) if isinstance(t, Mapping) else t, ensure_ascii=False,
                        sort_keys=True) for t in tools]
    return ("You may call these functions. To call one, answer with only "
            '{"name": <function name>, "arguments": <arguments object>}.\n' + "\n".join(lines))


def _builtin_content(m: Mapping[str, Any], content: str) -> str:
    """A message's text in the built-in template: an assistant's tool calls follow its content as
    the JSON the model answers with; a tool result names the call it answers."""
    calls = m.get("tool_calls") or ()
    parts = [content] if content else []
    for c in calls:
        fn = c.get("function", {}) if isinstance(c, Mapping) else {}
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass                   # rendered as the string it is
        parts.append(json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False))
    if m.get("role") == "tool" and m.get("tool_call_id"):
        parts.insert(0, f"[{m['tool_call_id']}]")
    return "\n".join(parts)


def _text_chars(messages: Sequence[Any]) -> int:
    n = 0
    for m in messages:
        if isinstance(m, Mapping):
            content = m.get("content")
            if not isinstance(content, str):
                return INLINE_TEMPLATE_CHARS + 1         # structured content: off the loop
            n += len(content)
        elif isinstance(m, (tuple, list)):
            n += sum(len(x) for x in m if isinstance(x, str))
    return n


class ByteTokenizer(Tokenizer):
    """ids 0..255 are the UTF-8 bytes; specials follow; ids up to `vocab_size`
    beyond the named specials are reserved (decode drops them too)."""

    SPECIALS = ("<bos>", "<eos>", IM_START, IM_END, "<pad>")
    BOS, EOS, IM_START_ID, IM_END_ID, PAD = range(256, 256 + len(SPECIALS))
    MIN_VOCAB = 256 + len(SPECIALS)

    def __init__(self, vocab_size: int = 384, eos_token_ids: tuple[int, ...] | None = None) -> None:
        """`eos_token_ids`: what a checkpoint without tokenizer.json states (None: <eos>, <|im_end|>)."""
        if vocab_size < self.MIN_VOCAB:
            raise ValueError(f"ByteTokenizer needs vocab_size >= {self.MIN_VOCAB}")
        self._vocab_size = vocab_size
        self._bos = self.BOS
        self._eos = (self.EOS, self.IM_END_ID) if eos_token_ids is None else tuple(eos_token_ids)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def _marker(self, text: str) -> list[int]:
        return [{IM_START: self.IM_START_ID, IM_END: self.IM_END_ID}[text]]

    @property
    def _add_bos(self) -> bool:
        return True


def special_ids(directory: Path, vocab_size: int, special_tokens: Mapping[str, str] | None = None,
                token_to_id: Any = None, config: Mapping[str, Any] | None = None) -> tuple[int | None, tuple[int, ...]]:
    """(bos id, eos ids) of a checkpoint directory, each from the first place that states it:
    generation_config.json, then config.json (the ids generation stops at, as transformers'
    `generate` reads them), then the tokenizer's own `bos_token` / `eos_token` text
    (tokenizer_config.json or special_tokens_map.json: `special_tokens`, looked up with
    `token_to_id`).  A model that states no eos has none: it serves, and only a request
    that needs one (a grammar) is refused.  WeightsError naming the file and key when a
    stated id is not a token id of the vocabulary.  `config`: config.json's contents where the
    caller has read them already (None: read here)."""
    found: dict[str, tuple[int, ...]] = {}
    for name in ("generation_config.json", "config.json"):            # the first wins
        path = directory / name
        if name == "config.json" and config is not None:
            cfg = config
        elif not path.is_file():
            continue
        else:
            cfg = read_json(path)
        for key in ("bos_token_id", "eos_token_id"):
            if key not in found:
                ids = token_ids(cfg.get(key), f"{path}: {key}", vocab_size)
                if ids:
                    found[key] = ids
    for key, text_key in (("bos_token_id", "bos_token"), ("eos_token_id", "eos_token")):
        text = (special_tokens or {}).get(text_key)
        tid = token_to_id(text) if text is not None and token_to_id is not None else None
        if key not in found and tid is not None and 0 <= tid < vocab_size:
            found[key] = (tid,)
    bos = found.get("bos_token_id", ())
    if len(bos) > 1:
        raise WeightsError(f"{directory}: bos_token_id must be one id, got {list(bos)}")
    return (bos[0] if bos else None), found.get("eos_token_id", ())


class HFTokenizer(Tokenizer):
    """A `tokenizers` tokenizer.json; bos/eos come from the checkpoint's configs
    and the chat template from its tokenizer_config.json / chat_template.jinja
    (see `from_dir`); `chat_template` None = the built-in template."""

    def __init__(self, tokenizer_json: str | Path | None, bos_token_id: int | None,
                 eos_token_ids: tuple[int, ...], vocab_size: int | None = None,
                 chat_template: ChatTemplate | None = None, *, json_text: str | None = None) -> None:
        """`tokenizer_json`: a tokenizer.json file, or None with its text in `json_text`
        (a tokenizer built in memory, e.g. from a GGUF's vocabulary)."""
        from tokenizers import Tokenizer as _Tok

        if (tokenizer_json is None) == (json_text is None):
            raise ValueError("give a tokenizer.json path or json_text, not both")
        data = json_text if json_text is not None else Path(tokenizer_json).read_text(encoding="utf-8")
        self.json_text = data          # what `export-model` writes as tokenizer.json
        tok = _Tok.from_str(data)
        # Users' text must never turn into control tokens (prompt injection of
        # <|im_end|> etc.); specials are only placed by the template.
        tok.encode_special_tokens = True
        self._tok = tok
        self._template = chat_template
        if chat_template is not None:
            # The rendered template is encoded with special tokens recognised
            # (a second instance: encode_special_tokens is per instance).
            self._tok_tpl = _Tok.from_str(data)
            self._control = ControlTokens(t.content for t in tok.get_added_tokens_decoder().values()
                                          if t.special)
            self._newline = self._tok_tpl.encode("\n", add_special_tokens=False).ids
        self._vocab_size = max(tok.get_vocab_size(with_added_tokens=True), vocab_size or 0)
        self._set_special_ids(bos_token_id, eos_token_ids)

    def _set_special_ids(self, bos_token_id: int | None, eos_token_ids: tuple[int, ...]) -> None:
        self._bos = bos_token_id
        self._eos = tuple(eos_token_ids)
        # Does the tokenizer's post-processor put bos in front of plain text?
        with_specials = self._tok.encode("", add_special_tokens=True).ids
        self._bos_added = bos_token_id is not None and with_specials[:1] == [bos_token_id]

    @classmethod
    def from_dir(cls, directory: str | Path, vocab_size: int | None = None,
                 config: Mapping[str, Any] | None = None) -> HFTokenizer:
        """tokenizer.json of a checkpoint directory, its bos / eos ids as `special_ids` reads
        them (`config`: config.json's contents, if already read), and the chat template as
        `ChatTemplate.from_dir` reads it.  WeightsError naming the file when one of them cannot
        be used."""
        d = Path(directory)
        path = d / "tokenizer.json"
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise WeightsError(f"{path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
        special_tokens = read_special_tokens(d)
        template = ChatTemplate.from_dir(d, special_tokens)
        try:
            tok = cls(None, None, (), vocab_size, template, json_text=text)
        except Exception as e:       # noqa: BLE001 (the tokenizers library raises a bare Exception)
            raise WeightsError(f"{path}: not a tokenizer.json the tokenizers library reads "
                               f"({str(e).splitlines()[0][:200]})") from None
        # Its ids once parsed: the tokenizer's own eos_token is looked up in its vocabulary.
        tok._set_special_ids(*special_ids(d, vocab_size or tok.vocab_size, special_tokens,
                                          tok._tok.token_to_id, config))
        return tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    @property
    def renders_jinja(self) -> bool:
        return self._template is not None

    @property
    def chat_template(self) -> ChatTemplate | None:
        return self._template

    def apply_chat_template(self, messages: Sequence[tuple[str, str] | Mapping[str, Any]], *,
                            add_generation_prompt: bool = True, tools: list | None = None,
                            documents: list | None = None,
                            template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        if self._template is None:
            return super().apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                               tools=tools, documents=documents,
                                               template_kwargs=template_kwargs)
        text = self._template.render(messages, add_generation_prompt=add_generation_prompt,
                                     tools=tools, documents=documents, control_tokens=self._control,
                                     **dict(template_kwargs or {}))
        pieces = self._control.split(text)
        if len(pieces) == 1 and not pieces[0][1]:
            return self._tok_tpl.encode(text, add_special_tokens=False).ids
        # A user typed a control token: it is encoded as text, the rest as usual.
        # Pieces after the first are encoded after a newline that is then cut
        # off (no SentencePiece prefix space), as transformers does.
        ids: list[int] = []
        for i, (piece, as_text) in enumerate(pieces):
            tok = self._tok if as_text else self._tok_tpl
            if i == 0:
                ids += tok.encode(piece, add_special_tokens=False).ids
                continue
            got = tok.encode("\n" + piece, add_special_tokens=False).ids
            nl = len(self._newline)
            ids += got[nl:] if got[:nl] == self._newline else tok.encode(piece, add_special_tokens=False).ids
        return ids

    def _marker(self, text: str) -> list[int]:
        tid = self._tok.token_to_id(text)
        return [tid] if tid is not None else self.encode(text)

    @property
    def _add_bos(self) -> bool:
        return self._bos_added
