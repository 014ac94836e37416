"""One request's sampling settings: the one definition every layer uses.

The HTTP doors decode a body into `SamplingParams`, the wire messages nest it
(`net.frames` decodes it back through this constructor), and the engines read
it.  `__post_init__` is the only place the fields are checked (a broken bound
raises `FieldError` naming the field) and normalises what JSON cannot spell:
lists become tuples, integral floats floats, `logit_bias` keys may be decimal
strings, `top_k` -1 becomes 0.  A new field is added here only; the wire codec
and the doors follow by name.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass

from pddgw.core.errors import FieldError
from pddgw.core.ids import TOKEN_ID_LIMIT

MAX_LOGPROBS = 20            # top alternatives per position, at most (OpenAI's bound)
MAX_STOP_IDS = 64            # stop_token_ids entries, at most
MAX_LOGIT_BIAS = 1024        # logit_bias entries, at most
TOP_K_LIMIT = 1 << 31        # top_k is below this
COUNT_LIMIT = 1 << 31        # max_tokens, min_tokens are below this
SEED_LIMIT = 1 << 63
TEMPERATURE_MAX = 2.0
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty, frequency_penalty
BIAS_RANGE = (-100.0, 100.0)  # logit_bias values
MAX_GRAMMAR_CHARS = 256 * 1024   # a grammar's text, at most (it travels with every hop of the request)
GRAMMAR_KINDS = ("json_schema", "structural_tag", "ebnf", "regex")

_quote = reprlib.Repr()
_quote.maxstring = _quote.maxother = _quote.maxlong = 48
_quote.maxlist = _quote.maxdict = _quote.maxtuple = 4
_quote.maxlevel = 2


def _fail(field: str, what: str, got: object) -> None:
    raise FieldError(field, f"{field} must be {what}, got {_quote.repr(got)}")


def _finite(v: object) -> bool:
    """A finite JSON number (bool is not one; an int too large for a float is not either)."""
    return (type(v) is float and math.isfinite(v)) or (type(v) is int and -(1 << 63) <= v < 1 << 63)


def _int(obj: object, name: str, lo: int, hi: int) -> None:
    """An integer in [lo, hi)."""
    v = getattr(obj, name)
    if type(v) is not int or not lo <= v < hi:
        _fail(name, f"an integer in [{lo}, {hi})", v)


def _float(obj: object, name: str, lo: float, hi: float, lo_open: bool = False) -> None:
    """A finite number in [lo, hi] ((lo, hi] with lo_open), stored as a float."""
    v = getattr(obj, name)
    ok = _finite(v) and (lo < v if lo_open else lo <= v) and v <= hi
    if not ok:
        _fail(name, f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]", v)
    object.__setattr__(obj, name, float(v))


def _bool(obj: object, name: str) -> None:
    v = getattr(obj, name)
    if type(v) is not bool:
        _fail(name, "a boolean", v)


def _token_id(v: object) -> int:
    """A token id as an int, from an int or a decimal string (JSON object keys); -1 if neither."""
    if type(v) is int:
        return v if 0 <= v < TOKEN_ID_LIMIT else -1
    if type(v) is str and v.isascii() and v.isdigit() and len(v) <= 10:
        n = int(v)
        return n if n < TOKEN_ID_LIMIT else -1
    return -1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How output tokens are chosen; meanings are vLLM's (OpenAI's where they agree).

    seed                output position i draws from (seed, i) only
    stop_token_ids      extra tokens that end the output (sampled and kept, as EOS)
    logprobs            k: the sampled token's + k alternatives, of the raw distribution
    repetition_penalty  > 0, 1 = off: over prompt and output tokens, a positive logit / r,
                        a negative one * r
    presence_penalty    [-2, 2], output tokens only: logit -= presence * (count > 0)
    frequency_penalty   [-2, 2], output tokens only: logit -= frequency * count
    logit_bias          ((token id, bias in [-100, 100]), ...) sorted by id, added to the logits
    min_tokens          EOS (unless ignored) and stop_token_ids are masked before this many
                        output tokens (<= max_tokens)
    grammar             (kind, text), kind in GRAMMAR_KINDS: the output must match it
                        (`pddgw.engines.grammar`); not with ignore_eos nor min_tokens
    prompt_logprobs     k: each prompt token's log-probability + k alternatives; such a
                        request takes no prefix-cache hit (vLLM's rule)
    Order on the logits (vLLM's): logit_bias and min_tokens, penalties, temperature, filters.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0          # 0 = no top-k filter
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0      # keep tokens with p >= min_p * p_max; 0 = no min-p filter
    logprobs: int | None = None   # None: no log-probabilities; k: the sampled token's + k top alternatives
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None   # None: none; k: each prompt token's + k top alternatives
    grammar: tuple[str, str] | None = None   # (kind, text): the output must match it

    def __post_init__(self) -> None:
        _int(self, "max_tokens", 1, COUNT_LIMIT)
        _float(self, "temperature", 0.0, TEMPERATURE_MAX)
        if type(self.top_k) is not int or not -1 <= self.top_k < TOP_K_LIMIT:
            _fail("top_k", f"an integer in [-1, {TOP_K_LIMIT}) (-1 or 0: no filter)", self.top_k)
        object.__setattr__(self, "top_k", max(self.top_k, 0))   # -1: vLLM's spelling of "no filter"
        _float(self, "top_p", 0.0, 1.0, lo_open=True)
        _int(self, "seed", 0, SEED_LIMIT)
        self._stop_ids()
        _bool(self, "ignore_eos")
        _float(self, "min_p", 0.0, 1.0)
        lp = self.logprobs
        if lp is not None and (type(lp) is not int or not 0 <= lp <= MAX_LOGPROBS):
            _fail("logprobs", f"null or an integer in [0, {MAX_LOGPROBS}]", lp)
        rp = self.repetition_penalty
        if not (_finite(rp) and rp > 0):
            _fail("repetition_penalty", "a finite number > 0 (1: no penalty)", rp)
        object.__setattr__(self, "repetition_penalty", float(rp))
        _float(self, "presence_penalty", *PENALTY_RANGE)
        _float(self, "frequency_penalty", *PENALTY_RANGE)
        self._logit_bias()
        _int(self, "min_tokens", 0, COUNT_LIMIT)
        if self.min_tokens > self.max_tokens:
            _fail("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        _bool(self, "skip_special_tokens")
        _bool(self, "include_stop_str_in_output")
        plp = self.prompt_logprobs
        if plp is not None and (type(plp) is not int or not 0 <= plp <= MAX_LOGPROBS):
            _fail("prompt_logprobs", f"null or an integer in [0, {MAX_LOGPROBS}]", plp)
        self._grammar()

    def _grammar(self) -> None:
        g = self.grammar
        if g is None:
            return
        if type(g) not in (tuple, list) or len(g) != 2 or not all(type(x) is str for x in g):
            _fail("grammar", "null or [kind, text] (two strings)", g)
        kind, text = g
        if kind not in GRAMMAR_KINDS:
            _fail("grammar", f"of a kind in {GRAMMAR_KINDS}", kind)
        if not text or len(text) > MAX_GRAMMAR_CHARS:
            _fail("grammar", f"a text of 1 to {MAX_GRAMMAR_CHARS} characters", f"{len(text)} characters")
        if self.ignore_eos:
            _fail("grammar", "absent with ignore_eos (the grammar ends the output by EOS)", kind)
        if self.min_tokens:
            _fail("grammar", "absent with min_tokens (the grammar decides where the output ends)", kind)
        object.__setattr__(self, "grammar", (kind, text))

    def _stop_ids(self) -> None:
        v = self.stop_token_ids
        if type(v) not in (tuple, list) or len(v) > MAX_STOP_IDS:
            _fail("stop_token_ids", f"a list of at most {MAX_STOP_IDS} token ids", v)
        for t in v:
            if type(t) is not int or not 0 <= t < TOKEN_ID_LIMIT:
                _fail("stop_token_ids", f"token ids in [0, {TOKEN_ID_LIMIT})", t)
        object.__setattr__(self, "stop_token_ids", tuple(v))

    def _logit_bias(self) -> None:
        """Normalised to ((id, bias), ...) sorted by id: from a mapping (JSON: string keys)
        or from pairs (the wire's form)."""
        v = self.logit_bias
        if isinstance(v, Mapping):
            pairs = list(v.items())
        elif type(v) in (tuple, list):
            pairs = list(v)
            if not all(type(p) in (tuple, list) and len(p) == 2 for p in pairs):
                _fail("logit_bias", "an object of token id -> bias (or [id, bias] pairs)", v)
        else:
            _fail("logit_bias", "an object of token id -> bias", v)
        if len(pairs) > MAX_LOGIT_BIAS:
            _fail("logit_bias", f"at most {MAX_LOGIT_BIAS} entries", f"{len(pairs)} entries")
        out: dict[int, float] = {}
        lo, hi = BIAS_RANGE
        for k, b in pairs:
            tid = _token_id(k)
            if tid < 0:
                _fail("logit_bias", f"keyed by token ids in [0, {TOKEN_ID_LIMIT})", k)
            if tid in out:
                _fail("logit_bias", "keyed by distinct token ids", k)
            if not (_finite(b) and lo <= b <= hi):
                _fail("logit_bias", f"biases in [{lo:g}, {hi:g}]", b)
            out[tid] = float(b)
        object.__setattr__(self, "logit_bias", tuple(sorted(out.items())))

    def check_vocab(self, vocab_size: int) -> None:
        """FieldError unless logit_bias names tokens of a vocabulary of this size (the sampler
        indexes the logits by them; stop_token_ids outside it simply never occur)."""
        bad = next((t for t, _ in self.logit_bias if t >= vocab_size), None)
        if bad is not None:
            _fail("logit_bias", f"keyed by token ids of the vocabulary [0, {vocab_size})", bad)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether the logits depend on the tokens so far (repetition / presence / frequency)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def adjusts_logits(self) -> bool:
        """Whether anything changes the logits before the draw (penalties, bias, min_tokens, a grammar)."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0 or self.grammar is not None
