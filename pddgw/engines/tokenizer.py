"""Text <-> token ids.

Two implementations of one contract: `ByteTokenizer` for the built-in tiny
model (UTF-8 bytes plus a few special tokens) and `HFTokenizer` for a
checkpoint's `tokenizer.json`.

Chat template.  Every tokenizer renders a conversation with the same built-in
ChatML-like template (a checkpoint's own Jinja template is not used):

    [bos]  <|im_start|>{role}\\n{content}<|im_end|>\\n   (per message)
           <|im_start|>assistant\\n                      (generation prompt)

`<|im_start|>` / `<|im_end|>` are their special-token ids when the vocabulary
has them, else their literal text.  bos is prepended when the tokenizer adds
one to plain text (Llama yes, Qwen no; always for `ByteTokenizer`).  Message
text is encoded as plain text: a special-token string typed by a user never
becomes a special id.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"


class Tokenizer(ABC):
    """Contract:

    * `encode(text)` -> ids of the text alone: no bos/eos added, special-token
      strings inside `text` are encoded as ordinary text.
    * `decode(ids)` -> text; special tokens are dropped; an incomplete UTF-8
      sequence decodes to U+FFFD rather than raising.
    * `vocab_size` >= every id either method produces or accepts.
    * `bos_token_id` (or None) and `eos_token_ids` (the ids that end generation).
    * `apply_chat_template([(role, content), ...])` -> prompt ids ending with
      the assistant generation prompt (template in the module docstring).
    Implementations are immutable after construction and safe to share
    between threads.
    """

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: list[int]) -> str: ...

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def bos_token_id(self) -> int | None: ...

    @property
    @abstractmethod
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @abstractmethod
    def _marker(self, text: str) -> list[int]:
        """Ids of a template marker (IM_START / IM_END)."""

    @property
    @abstractmethod
    def _add_bos(self) -> bool: ...

    def apply_chat_template(self, messages: list[tuple[str, str]]) -> list[int]:
        start, end = self._marker(IM_START), self._marker(IM_END)
        ids: list[int] = []
        if self._add_bos and self.bos_token_id is not None:
            ids.append(self.bos_token_id)
        for role, content in messages:
            ids += start + self.encode(f"{role}\n{content}") + end + self.encode("\n")
        ids += start + self.encode("assistant\n")
        return ids


class ByteTokenizer(Tokenizer):
    """ids 0..255 are the UTF-8 bytes; specials follow; ids up to `vocab_size`
    beyond the named specials are reserved (decode drops them too)."""

    SPECIALS = ("<bos>", "<eos>", IM_START, IM_END, "<pad>")
    BOS, EOS, IM_START_ID, IM_END_ID, PAD = range(256, 256 + len(SPECIALS))
    MIN_VOCAB = 256 + len(SPECIALS)

    def __init__(self, vocab_size: int = 384) -> None:
        if vocab_size < self.MIN_VOCAB:
            raise ValueError(f"ByteTokenizer needs vocab_size >= {self.MIN_VOCAB}")
        self._vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self.BOS

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.EOS, self.IM_END_ID)

    def _marker(self, text: str) -> list[int]:
        return [{IM_START: self.IM_START_ID, IM_END: self.IM_END_ID}[text]]

    @property
    def _add_bos(self) -> bool:
        return True


class HFTokenizer(Tokenizer):
    """A `tokenizers` tokenizer.json; bos/eos come from the checkpoint's configs
    (see `from_dir`)."""

    def __init__(self, tokenizer_json: str | Path, bos_token_id: int | None,
                 eos_token_ids: tuple[int, ...], vocab_size: int | None = None) -> None:
        from tokenizers import Tokenizer as _Tok

        tok = _Tok.from_file(str(tokenizer_json))
        # Users' text must never turn into control tokens (prompt injection of
        # <|im_end|> etc.); specials are only placed by the template.
        tok.encode_special_tokens = True
        self._tok = tok
        self._bos = bos_token_id
        self._eos = tuple(eos_token_ids)
        self._vocab_size = max(tok.get_vocab_size(with_added_tokens=True), vocab_size or 0)
        # Does the tokenizer's post-processor put bos in front of plain text?
        with_specials = tok.encode("", add_special_tokens=True).ids
        self._bos_added = bos_token_id is not None and with_specials[:1] == [bos_token_id]

    @classmethod
    def from_dir(cls, directory: str | Path, vocab_size: int | None = None) -> HFTokenizer:
        """tokenizer.json of a checkpoint directory; eos from generation_config.json
        if present, else config.json; bos from config.json."""
        import json

        d = Path(directory)
        merged: dict = {}
        for name in ("config.json", "generation_config.json"):     # later wins
            if (d / name).is_file():
                merged.update({k: v for k, v in json.loads((d / name).read_text()).items()
                               if k in ("bos_token_id", "eos_token_id") and v is not None})
        eos = merged.get("eos_token_id")
        eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        bos = merged.get("bos_token_id")
        return cls(d / "tokenizer.json", None if bos is None else int(bos), eos_ids, vocab_size)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    def _marker(self, text: str) -> list[int]:
        tid = self._tok.token_to_id(text)
        return [tid] if tid is not None else self.encode(text)

    @property
    def _add_bos(self) -> bool:
        return self._bos_added
