"""A checkpoint's own chat template: Jinja2 in a sandbox, as transformers renders it.

Contract: a conversation without control tokens in its strings renders and
encodes exactly as transformers' `apply_chat_template(..., tokenize=True)`.
Templates come from the checkpoint (`read_chat_templates`); `render` picks
"tool_use" when tools are given and the checkpoint has one, else "default",
and exposes transformers' variables, globals and filters.

Control tokens typed by users (`ControlTokens`): they are wrapped in
transformers' private-use markers before rendering and split out after, so
the user's copies encode as plain text, the template's as their ids
(transformers' `sanitize_control_tokens=True`).

The sandbox: templates are untrusted code.  `ImmutableSandboxedEnvironment`
refuses unsafe attributes, calls and in-place changes; every render also has
a budget (`max_chars`, `timeout_s`) checked at each loop iteration, call,
attribute or item access, filter, operator and output chunk, with sizes
refused before building where they are known in advance; `range()` yields at
most 100000 items.  The budget is cooperative (Python cannot stop a thread):
one builtin operation between two checks runs to its end, bounded by its
capped inputs.  Event-loop code renders via `Tokenizer.apply_chat_template_async`.

Errors: a render failure is a `RequestError` naming the cause; a template
that does not compile, a `ChatTemplateError` at load.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pddgw.engines.types import RequestError
from pddgw.engines.model_spec import WeightsError, read_json

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                      "cls_token", "mask_token")
DEFAULT_MAX_CHARS = 1 << 22          # 4 Mi characters of rendered text
DEFAULT_TIMEOUT_S = 10.0
MAX_INT_BITS = 1 << 16
_MARK_START, _MARK_END = "\U000f0000", "\U000f0001"    # private use, plane 15
_BIG_WIDTH = re.compile(r"\d{7,}")
# Older Jinja2 releases have known sandbox escapes (transformers refuses them too).
MIN_JINJA2 = (3, 1, 6)


class ChatTemplateError(WeightsError):
    """A checkpoint's chat template cannot be used (unreadable, does not compile)."""


class TemplateRaised(jinja2.TemplateError):
    """The template called `raise_exception(message)`."""


class TemplateLimitError(jinja2.exceptions.SecurityError):
    """The render ran out of its time or size budget."""


# ---------------------------------------------------------------- reading a checkpoint

def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]                  # an AddedToken dict
    return None


def read_special_tokens(directory: str | Path) -> dict[str, str]:
    """`bos_token` ... `mask_token` of tokenizer_config.json, the missing ones
    from special_tokens_map.json; values may be strings or AddedToken dicts."""
    d = Path(directory)
    out: dict[str, str] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):    # first wins
        if (d / name).is_file():
            cfg = read_json(d / name)
            for key in SPECIAL_TOKEN_KEYS:
                text = _token_text(cfg.get(key))
                if text is not None:
                    out.setdefault(key, text)
    return out


def read_chat_templates(directory: str | Path) -> dict[str, str]:
    """name -> template source; {} when the checkpoint has none.

    As transformers reads a local directory: `chat_template.jinja` ("default") plus
    `additional_chat_templates/{name}.jinja` win when any exist; else `tokenizer_config.json`'s
    `chat_template`, one string ("default") or a list of {"name", "template"}.
    """
    d = Path(directory)
    files: dict[str, str] = {}
    if (d / CHAT_TEMPLATE_FILE).is_file():
        files["default"] = (d / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if (d / CHAT_TEMPLATE_DIR).is_dir():
        for f in sorted((d / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            files[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    if files:
        return files
    if not (d / "tokenizer_config.json").is_file():
        return {}
    tpl = read_json(d / "tokenizer_config.json").get("chat_template")
    if tpl is None:
        return {}
    if isinstance(tpl, str):
        return {"default": tpl}
    if isinstance(tpl, list) and all(isinstance(t, Mapping) and isinstance(t.get("name"), str)
                                     and isinstance(t.get("template"), str) for t in tpl):
        return {t["name"]: t["template"] for t in tpl}
    raise ChatTemplateError(f"{d / 'tokenizer_config.json'}: chat_template must be a string or a "
                            "list of {name, template}")


# ---------------------------------------------------------------- template data

def _plain(value: Any, where: str) -> Any:
    """JSON-shaped copy of request data (the template sees no other objects)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k, where): _plain(v, where) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    raise RequestError(f"{where}: a {type(value).__name__} cannot be passed to a chat template")


def normalize_messages(messages: Iterable[Any]) -> list[dict[str, Any]]:
    """`(role, content)` pairs or message dicts -> plain dicts without None values."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, Mapping):
            d = _plain(m, f"messages[{i}]")
            out.append({k: v for k, v in d.items() if v is not None})
        elif isinstance(m, (tuple, list)) and len(m) == 2 and all(isinstance(x, str) for x in m):
            out.append({"role": str.__str__(m[0]), "content": str.__str__(m[1])})
        else:
            raise RequestError(f"messages[{i}]: expected (role, content) or a message object")
    return out


class ControlTokens:
    """The tokens that only a template may write (see the module docstring).
    Immutable after construction."""

    __slots__ = ("tokens", "_find", "_split")

    def __init__(self, tokens: Iterable[str]) -> None:
        self.tokens = tuple(sorted(set(tokens), key=lambda t: (-len(t), t)))   # longest first
        tok = "|".join(map(re.escape, self.tokens)) or "(?!)"
        self._find = re.compile(tok)
        self._split = re.compile(f"{_MARK_START}({tok}){_MARK_END}|[{_MARK_START}{_MARK_END}]")

    def mark(self, obj: Any) -> Any:
        """Strings (recursively; not dict keys) with their control tokens wrapped in
        markers; markers already in them are dropped, so none can be forged."""
        if isinstance(obj, str):
            if _MARK_START in obj or _MARK_END in obj:
                obj = obj.replace(_MARK_START, "").replace(_MARK_END, "")
            return self._find.sub(f"{_MARK_START}\\g<0>{_MARK_END}", obj)
        if isinstance(obj, dict):
            return {k: self.mark(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.mark(v) for v in obj]
        return obj

    def split(self, text: str) -> list[tuple[str, bool]]:
        """Rendered text -> [(piece, is_marked_user_text)], markers removed; the
        first piece is kept even when empty; a lone marker (the template cut a
        marked token) only separates pieces."""
        if _MARK_START not in text and _MARK_END not in text:
            return [(text, False)]
        pieces = self._split.split(text)      # [text, token, text, token-or-None, ..., text]
        return [(pieces[0], False)] + [(p, i % 2 == 1) for i, p in enumerate(pieces[1:], 1) if p]


# ---------------------------------------------------------------- the sandbox

@dataclass(slots=True)
class _Budget:
    deadline: float
    timeout_s: float
    max_chars: int
    out_chars: int = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"rendering took longer than {self.timeout_s:g} s")


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("pddgw_template_budget",
                                                                         default=None)


def _tick() -> _Budget | None:
    b = _BUDGET.get()
    if b is not None:
        b.tick()
    return b


def _refuse_size(n: int, b: _Budget | None, what: str) -> None:
    if b is not None and n > b.max_chars:
        raise TemplateLimitError(f"{what} would be {n} items long (limit {b.max_chars})")


def _check_value(value: Any, b: _Budget | None, what: str) -> Any:
    if b is None:
        return value
    if isinstance(value, (str, list, tuple, dict)):
        _refuse_size(len(value), b, what)
    elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
        raise TemplateLimitError(f"{what} is an integer of more than {MAX_INT_BITS} bits")
    return value


def _check_format(fmt: Any) -> None:
    if isinstance(fmt, str) and _BIG_WIDTH.search(fmt):
        raise TemplateLimitError("format widths of a million characters or more are refused")


def _len(x: Any) -> int:
    return len(x) if isinstance(x, (str, list, tuple)) else 0


_WIDTH_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})


def _predict_str_call(name: str, s: str, args: tuple, kwargs: dict, b: _Budget | None) -> None:
    """Refuse a str method call whose result would be over budget, before it runs."""
    if b is None:
        return
    if name in _WIDTH_METHODS:
        for a in (*args, *kwargs.values()):
            if isinstance(a, int):
                _refuse_size(a * (8 if name == "expandtabs" else 1) + len(s), b, f"str.{name}()")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        count = s.count(args[0]) if args[0] else len(s) + 1
        _refuse_size(len(s) + count * max(0, len(args[1]) - len(args[0])), b, "str.replace()")
    elif name == "join" and args and isinstance(args[0], (list, tuple)):
        items = args[0]
        _refuse_size(len(s) * max(0, len(items) - 1) + sum(_len(x) for x in items), b, "str.join()")
    elif name in ("format", "format_map"):
        _check_format(s)


def _guard_iter(iterable: Any) -> Iterator[Any]:
    """Every `for` loop's iterable passes through here: one budget tick per item."""
    b = _BUDGET.get()
    if b is None:
        yield from iterable
        return
    for item in iterable:
        b.tick()
        yield item


def _raise_exception(message: Any) -> None:
    raise TemplateRaised(str(message))


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; transformers' does not.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _dict(*args: Any, **kwargs: Any) -> dict:
    # A function, not the `dict` type, so templates cannot reach type attributes.
    return dict(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` without underscore names, with its values size-checked."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (Jinja's signature trick)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for k, v in attrs.items():
            _Namespace._check(k, v)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name, value)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any, value: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")
        _check_value(value, _tick(), f"namespace value {name!r}")


_INT_FILTER_ARGS_EXEMPT = frozenset({"default", "d", "tojson", "round", "int", "float", "string"})


def _guard_filter(name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)            # keeps jinja_pass_arg (pass_context etc.)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        b = _tick()
        if b is not None:
            values = [a for a in (*args, *kwargs.values())
                      if not isinstance(a, (jinja2.runtime.Context, jinja2.nodes.EvalContext,
                                            jinja2.Environment))]
            if name not in _INT_FILTER_ARGS_EXEMPT:
                for a in values[1:]:
                    if isinstance(a, int) and not isinstance(a, bool):
                        _refuse_size(abs(a), b, f"filter {name}'s argument")
            if name == "tojson":
                ind = kwargs.get("indent", values[2] if len(values) > 2 else None)
                if isinstance(ind, int) or isinstance(ind, str):
                    _refuse_size(ind if isinstance(ind, int) else len(ind), b, "tojson indent")
            elif name == "format" and values:
                _check_format(values[0])
            elif name == "replace" and len(values) >= 3 and all(isinstance(v, str) for v in values[:3]):
                _predict_str_call("replace", values[0], tuple(values[1:3]), {}, b)
            elif name == "join" and values and isinstance(values[0], (list, tuple)):
                sep = values[1] if len(values) > 1 and isinstance(values[1], str) else ""
                _predict_str_call("join", sep, (list(values[0]),), {}, b)
            elif name == "indent" and values and isinstance(values[0], str):
                w = values[1] if len(values) > 1 else kwargs.get("width", 4)
                w = len(w) if isinstance(w, str) else w if isinstance(w, int) else 0
                _refuse_size(len(values[0]) + (values[0].count("\n") + 1) * w, b, "filter indent")
        return _check_value(fn(*args, **kwargs), b, f"filter {name}'s result")

    return guarded


class _Sandbox(ImmutableSandboxedEnvironment):
    """transformers' environment plus the budget hooks (module docstring)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        b = _tick()
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            _predict_str_call(getattr(__obj, "__name__", ""), owner, args, kwargs, b)
        result = super().call(__context, __obj, *args, **kwargs)
        return _check_value(result, b, "a call's result")

    def getattr(self, obj: Any, attribute: str) -> Any:
        _tick()
        if isinstance(obj, str) and attribute in ("format", "format_map"):
            _check_format(obj)
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _tick()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        b = _tick()
        if b is not None:
            ints = all(isinstance(x, int) and not isinstance(x, bool) for x in (left, right))
            if operator == "*":
                if ints:
                    if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                        raise TemplateLimitError("integer product too large")
                elif isinstance(left, int) or isinstance(right, int):
                    n, seq = (left, right) if isinstance(left, int) else (right, left)
                    _refuse_size(max(0, n) * _len(seq), b, "a repetition")
            elif operator == "**" and ints and right > 0 and abs(left) > 1:
                if left.bit_length() * right > MAX_INT_BITS:
                    raise TemplateLimitError("integer power too large")
            elif operator == "+":
                _refuse_size(_len(left) + _len(right), b, "a concatenation")
            elif operator == "%" and isinstance(left, str):
                _check_format(left)
                if "*" in left:
                    raise TemplateLimitError("'*' widths in %-formatting are refused")
        return _check_value(super().call_binop(context, operator, left, right), b, "an operator's result")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant
    tokens with it for training masks): renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _guard_loops(ast: nodes.Template) -> nodes.Template:
    """Rewrite every `for x in EXPR` as `for x in EXPR|pddgw_guard_iter` (a
    template naming that filter itself only gets the same pass-through)."""
    for loop in ast.find_all(nodes.For):
        loop.iter = nodes.Filter(loop.iter, _GUARD_FILTER, [], [], None, None, lineno=loop.lineno)
    return ast


_GUARD_FILTER = "pddgw_guard_iter"


def _environment() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.filters = {name: _guard_filter(name, fn) for name, fn in env.filters.items()}
    env.filters[_GUARD_FILTER] = _guard_iter
    env.globals.pop("lipsum", None)
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_dict,
                       namespace=_Namespace)
    return env


# ---------------------------------------------------------------- ChatTemplate

def _version(text: str) -> tuple[int, ...]:
    return tuple(int(m) for m in re.findall(r"\d+", text)[:3])


class ChatTemplate:
    """A checkpoint's chat template(s), compiled once; `render` is thread-safe."""

    def __init__(self, templates: str | Mapping[str, str], special_tokens: Mapping[str, str] | None = None,
                 *, max_chars: int = DEFAULT_MAX_CHARS, timeout_s: float = DEFAULT_TIMEOUT_S,
                 origin: str = "chat template") -> None:
        if _version(jinja2.__version__) < MIN_JINJA2:
            raise ChatTemplateError(f"{origin}: chat templates need jinja2 >= "
                                    f"{'.'.join(map(str, MIN_JINJA2))} (sandbox fixes), found {jinja2.__version__}")
        if isinstance(templates, str):
            templates = {"default": templates}
        if not templates:
            raise ChatTemplateError(f"{origin}: no templates")
        if max_chars < 1 or timeout_s <= 0:
            raise ValueError("max_chars and timeout_s must be positive")
        self.sources = dict(templates)
        self.special_tokens = dict(special_tokens or {})
        self.max_chars = max_chars
        self.timeout_s = timeout_s
        self._env = _environment()
        self._compiled: dict[str, jinja2.Template] = {}
        for name, src in self.sources.items():
            try:
                self._compiled[name] = self._env.from_string(_guard_loops(self._env.parse(src)))
            except jinja2.TemplateSyntaxError as e:
                raise ChatTemplateError(f"{origin} {name!r}: line {e.lineno}: {e.message}") from None

    @classmethod
    def from_dir(cls, directory: str | Path, special_tokens: Mapping[str, str] | None = None,
                 **kw: Any) -> ChatTemplate | None:
        """The checkpoint's template (see `read_chat_templates`), or None without one;
        `special_tokens` as `read_special_tokens(directory)` gives them (None: read here)."""
        templates = read_chat_templates(directory)
        if not templates:
            return None
        if special_tokens is None:
            special_tokens = read_special_tokens(directory)
        return cls(templates, special_tokens, origin=f"{directory}: chat template", **kw)

    def select(self, tools: Any = None) -> str:
        """The template name a render uses (transformers' `get_chat_template`)."""
        if tools is not None and "tool_use" in self._compiled:
            return "tool_use"
        if "default" in self._compiled:
            return "default"
        if len(self._compiled) == 1:
            return next(iter(self._compiled))
        raise RequestError(f"the model has several chat templates ({', '.join(sorted(self._compiled))}) "
                           "and none is named 'default'")

    def render(self, messages: Iterable[Any], *, add_generation_prompt: bool = True,
               tools: list | None = None, documents: list | None = None,
               control_tokens: ControlTokens | None = None, **kwargs: Any) -> str:
        """The conversation as text.  With `control_tokens`, control tokens in
        the request's strings come back marked (split them with
        `control_tokens.split`).  RequestError on any template failure."""
        msgs: Any = normalize_messages(messages)
        tools = None if tools is None else _plain(tools, "tools")
        documents = None if documents is None else _plain(documents, "documents")
        extra = _plain(kwargs, "template arguments")
        if control_tokens is not None:
            msgs, tools, documents, extra = (control_tokens.mark(x) for x in (msgs, tools, documents, extra))
        name = self.select(tools)
        context = {**self.special_tokens, **extra, "messages": msgs, "tools": tools,
                   "documents": documents, "add_generation_prompt": bool(add_generation_prompt)}
        budget = _Budget(time.monotonic() + self.timeout_s, self.timeout_s, self.max_chars)
        token = _BUDGET.set(budget)
        try:
            parts: list[str] = []
            for chunk in self._compiled[name].generate(context):
                budget.tick()
                budget.out_chars += len(chunk)
                if budget.out_chars > self.max_chars:
                    raise TemplateLimitError(f"the rendered text is longer than {self.max_chars} characters")
                parts.append(chunk)
            return "".join(parts)
        except TemplateRaised as e:
            raise RequestError(f"the model's chat template refused the conversation: {e.message}") from None
        except TemplateLimitError as e:
            raise RequestError(f"chat template stopped: {e.message}") from None
        except jinja2.exceptions.SecurityError as e:
            raise RequestError(f"chat template blocked by the sandbox: {e.message}") from None
        except jinja2.TemplateError as e:
            raise RequestError(f"chat template error: {e.message}") from None
        except RequestError:
            raise
        except RecursionError:
            raise RequestError("chat template error: recursion too deep") from None
        except Exception as e:  # noqa: BLE001 (template code can raise anything)
            raise RequestError(f"chat template error: {type(e).__name__}: {e}") from None
        finally:
            _BUDGET.reset(token)
