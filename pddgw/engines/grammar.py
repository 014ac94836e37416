"""Grammar-constrained decoding: compile a request's grammar, keep its matcher, mask the logits.

Contract.  `SamplingParams.grammar` is `(kind, text)` (`pddgw.core.sampling`).
`Grammars` (built from an engine's tokenizer) compiles each distinct spec once
(cached by SHA-256) and gives each sequence a `Constraint`; before each draw
`Constraint.sync(output)` feeds the matcher the output tokens it has not seen.

Invariant: the matcher state is a pure function of the output tokens, so a
sequence that arrived by handoff or re-drive, or was preempted, rebuilds it by
feeding them (~`REBUILD_US_PER_100` us per 100 tokens) and every node masks
the same logits the same way.

The matcher's stop tokens are the model's EOS ids: a complete grammar admits
only them.  A model with no EOS refuses every grammar (`NO_EOS`); max_tokens
still caps (finish "length", a prefix of a valid text).  A refused token (only
from tokens of another grammar) leaves the constraint `broken`: only EOS is
then admitted.

Compiling runs on the engine's thread (`add_request`), never the event loop;
the front door only checks that a spec compiles (`check_spec`).  xgrammar over
llguidance: measured on batch-32 JSON-schema masks, 0.6-5.0 ms a step against
1.6-11 ms on a 50257-token vocabulary, and 2-20 ms schema compiles against 15-60 ms.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import Any

import torch

from pddgw.engines.types import RequestError

NO_EOS_REASON = "the model states no EOS token, so a constrained output could never end"
NO_EOS = f"grammar: {NO_EOS_REASON}"
CACHE_ENTRIES = 64            # compiled grammars kept per engine (least recently used goes first)
REBUILD_US_PER_100 = 80       # measured: feeding 100 output tokens to a fresh matcher (byte vocab, CPU: 79 us)


def _xgrammar() -> Any:
    """xgrammar, imported on first use: it takes ~3 s to import (it pulls in transformers), which
    every process that never sees a grammar (a node's start, the CLI) should not pay."""
    import xgrammar

    return xgrammar


def _compile(compiler: Any, kind: str, text: str) -> Any:
    if kind == "json_schema":
        # Compact separators: a model (the random tiny one above all) cannot pad forever.
        return compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
    if kind == "structural_tag":
        return compiler.compile_structural_tag(text)
    if kind == "ebnf":
        return compiler.compile_grammar(text)
    if kind == "regex":
        return compiler.compile_regex(text)
    raise RequestError(f"grammar kind {kind!r} is unknown")


def check_spec(kind: str, text: str) -> None:
    """ValueError (its message says why) unless the spec compiles; needs no vocabulary."""
    xg = _xgrammar()
    try:
        if kind == "json_schema":
            xg.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
        elif kind == "structural_tag":
            xg.Grammar.from_structural_tag(text)
        elif kind == "ebnf":
            xg.Grammar.from_ebnf(text)
        elif kind == "regex":
            xg.Grammar.from_regex(text)
        else:
            raise ValueError(f"grammar kind {kind!r} is unknown")
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__) from None


def byte_vocab(vocab_size: int, num_bytes: int = 256) -> list[bytes]:
    """The tiny model's vocabulary (`ByteTokenizer`): ids < 256 are the bytes, the rest special."""
    return [bytes([i]) for i in range(num_bytes)] + [b""] * (vocab_size - num_bytes)


def tokenizer_vocab(tokenizer: Any, vocab_size: int) -> tuple[list[bytes] | list[str], Any]:
    """(encoded vocabulary, xgrammar VocabType) of a pddgw tokenizer, `vocab_size` entries.

    `ByteTokenizer`: raw bytes.  `HFTokenizer`: its tokenizer.json's token strings, spelled
    as its decoder spells them (byte-level BPE: GPT-2's alphabet; byte fallback:
    SentencePiece's <0xAB>); special added tokens are empty (never text).
    """
    from pddgw.engines.tokenizer import ByteTokenizer

    xg = _xgrammar()
    if isinstance(tokenizer, ByteTokenizer):
        return byte_vocab(vocab_size), xg.VocabType.RAW
    from tokenizers import Tokenizer as _Tok

    decoder = json.dumps(json.loads(tokenizer.json_text).get("decoder") or {})
    kind = (xg.VocabType.BYTE_LEVEL if '"ByteLevel"' in decoder
            else xg.VocabType.BYTE_FALLBACK if '"ByteFallback"' in decoder else xg.VocabType.RAW)
    tok = _Tok.from_str(tokenizer.json_text)
    vocab = [""] * vocab_size
    for piece, i in tok.get_vocab(with_added_tokens=True).items():
        if 0 <= i < vocab_size:
            vocab[i] = piece
    for i, added in tok.get_added_tokens_decoder().items():
        if 0 <= i < vocab_size and added.special:
            vocab[i] = ""
    return vocab, kind


def grammar_stops(eos_token_ids: Collection[int], vocab_size: int) -> list[int]:
    """The EOS ids a grammar can end its output with (those the model can sample), sorted;
    none: every grammar is refused (`NO_EOS`)."""
    return sorted(t for t in eos_token_ids if 0 <= t < vocab_size)


class Grammars:
    """One engine's grammar compiler over its vocabulary, with the compiled-grammar cache.

    Thread-safe: the engine thread compiles; the cache lock is held only around the map.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Collection[int], max_threads: int = 1):
        stops = grammar_stops(stop_token_ids, vocab_size)
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stops)
        self._tokenizer = tokenizer
        self._max_threads = max_threads
        self._compiler: Any = None     # built on the first grammar: most engines never see one
        self._cache: OrderedDict[bytes, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0          # compilations run (cache misses)

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                xg = _xgrammar()
                vocab, kind = tokenizer_vocab(self._tokenizer, self.vocab_size)
                info = xg.TokenizerInfo(vocab, kind, vocab_size=self.vocab_size,
                                        stop_token_ids=list(self.stop_token_ids))
                # The cache below keys by spec hash; xgrammar's own cache would hold a second copy.
                self._compiler = xg.GrammarCompiler(info, max_threads=self._max_threads, cache_enabled=False)
            return self._compiler

    def compile(self, grammar: tuple[str, str]) -> Any:
        """The compiled grammar of a spec (cached by its hash); RequestError naming the field."""
        kind, text = grammar
        key = hashlib.sha256(kind.encode() + b"\0" + text.encode()).digest()
        with self._lock:
            got = self._cache.get(key)
            if got is not None:
                self._cache.move_to_end(key)
                return got
        try:
            got = _compile(self._get_compiler(), kind, text)
        except (RuntimeError, ValueError, TypeError) as e:
            raise RequestError(f"grammar: the {kind} does not compile: {str(e).strip()[:300]}") from None
        with self._lock:
            self.compiled += 1
            self._cache[key] = got
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return got

    def constraint(self, grammar: tuple[str, str]) -> Constraint:
        if not self.stop_token_ids:
            raise RequestError(NO_EOS)
        xg = _xgrammar()
        return Constraint(xg.GrammarMatcher(self.compile(grammar)), self.stop_token_ids)


class Constraint:
    """One sequence's matcher and how many of its output tokens it has consumed."""

    __slots__ = ("matcher", "fed", "broken", "stops")

    def __init__(self, matcher: Any, stops: tuple[int, ...]):
        self.matcher = matcher
        self.fed = 0
        self.broken = False
        self.stops = stops

    def sync(self, output: Sequence[int]) -> None:
        """Feed the matcher the output tokens it has not consumed (a handoff's, a re-drive's, or
        the last step's)."""
        if len(output) < self.fed:
            raise RequestError("grammar: the output got shorter than the tokens the matcher consumed")
        while self.fed < len(output) and not self.broken:
            if not self.matcher.accept_token(output[self.fed]):
                self.broken = True
            self.fed += 1

    @property
    def finished(self) -> bool:
        return self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of an int32 [R, ceil(V / 32)] bitmask: the tokens admitted next."""
        if self.broken or self.matcher.is_terminated():
            bitmask[row].zero_()
            for t in self.stops:
                bitmask[row, t // 32] |= _bit(t % 32)
            return
        self.matcher.fill_next_token_bitmask(bitmask, row)


def _bit(i: int) -> int:
    """Bit i of an int32 word (bit 31 is the sign)."""
    return -(1 << 31) if i == 31 else 1 << i


def mask_rows(x: torch.Tensor, constraints: Sequence[Constraint], outputs: Sequence[Sequence[int]]) -> None:
    """In place: row j of x [R, V] keeps only the tokens constraints[j] admits after outputs[j]."""
    xg = _xgrammar()
    n, vocab = x.shape
    bitmask = xg.allocate_token_bitmask(n, vocab)                                       # int32 [R, ceil(V/32)]
    for j, (c, out) in enumerate(zip(constraints, outputs)):
        c.sync(out)
        c.fill(bitmask, j)
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float16, torch.bfloat16):
        xg.apply_token_bitmask_inplace(x, bitmask)
        return
    # float64 (tests, the CPU reference) or another device: the bits as a bool mask.
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)[:, :vocab]          # [R, V]
    x.masked_fill_(~allowed.to(x.device), float("-inf"))
