"""Chat templates: a conversation rendered as the checkpoint's tokenizer_config.json says, and kept between turns.

    template = ChatTemplate.of_export("out/")                   # None where the export has no chat template
    text = template.render([{"role": "user", "content": "Hi"}])  # = transformers' apply_chat_template(tokenize=False,
                                                                 #   add_generation_prompt=True) on the same messages
    chat = Chat(session)                                         # a conversation that keeps its state
    reply = chat.send("Hi", max_new_tokens=64)                   # each turn prefills only its new tokens

A chat template is Jinja2 code from the checkpoint: it is rendered in Jinja2's immutable sandbox (as transformers
renders it: trim_blocks, lstrip_blocks, the loop controls, ``raise_exception``, ``strftime_now``, a ``tojson`` that
keeps non-ASCII text, the ``{% generation %}`` tag), with the tokenizer's special tokens (``bos_token``,
``eos_token``, ...) as variables. Torch-free: needs ``jinja2`` (>= 3.1.6) beside ``tokenizers``.

Like any untrusted code it runs within bounds (``RenderLimits``): time (a clock checked at every loop step, call,
filter and operator), size (what a step would build is measured -- before it is built where it can outgrow its
input: repetition, padding, joins, replacements -- and so is the text rendered) and call depth; whatever fails
(a refusal, a bound, the template's own error) is one ``ChatTemplateError`` line naming the template.
"""

from __future__ import annotations

import ast
import contextvars
import json
import os
import re
import string
import time
from collections.abc import Mapping, Set
from dataclasses import dataclass
from datetime import datetime
from functools import update_wrapper, wraps
from pathlib import Path
from typing import Any, Sequence

from edgelin.errors import ManifestError, RuntimeInputError

CONFIG_FILE = "tokenizer_config.json"
ROLES = ("system", "user", "assistant", "tool")


class ChatTemplateError(RuntimeInputError):
    """A chat template failed on a conversation: it refused it (``raise_exception``), ran past its bounds
    (``RenderLimits``) or broke; the message names the template."""


@dataclass(frozen=True)
class RenderLimits:
    """Bounds on one rendering of a chat template, which is code from the checkpoint.

    seconds: wall time of one rendering (checked at every loop step, call, filter and operator);
    chars: the longest text a template may build or render, and the most a list or mapping may hold counted as
        its text, plus ``GROWTH`` characters per character of the conversation; everything it builds in all
        is at most ``MADE`` times that;
    depth: nested calls of its macros (a macro that calls itself without end stops here)."""

    seconds: float = 5.0
    chars: int = 1 << 20
    depth: int = 64


GROWTH = 8  # a template adds its markup around the conversation's text: allow 8 characters per character of it
MADE = 32  # everything a rendering builds, in all, is at most this many times its largest text
INT_BITS = 1 << 16  # the largest integer a template computes (Python prints at most 4,300 digits anyway)
MAX_LIPSUM = 1_000  # lipsum(): paragraphs and words per paragraph at most


class _Exceeded(Exception):
    """A rendering ran past one of its bounds (the message says which); not a TemplateError, which would read as
    the template refusing the conversation."""


class _Budget:
    """What one rendering (or one compilation: jinja2 folds constant expressions then) may still spend."""

    def __init__(self, limits: RenderLimits, input_chars: int = 0) -> None:
        self.limits = limits
        self.cap = int(limits.chars) + GROWTH * int(input_chars)
        self.total = MADE * self.cap
        self.made = 0
        self.depth = 0
        self.deadline = time.monotonic() + float(limits.seconds)

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise _Exceeded(f"it took longer than {self.limits.seconds:g} s to render (a loop or a recursion that runs away)")

    def fits(self, n: int, what: str = "a value") -> None:
        if n > self.cap:
            raise _Exceeded(f"it would build {what} of about {n:,} characters, more than the {self.cap:,} allowed")

    def make(self, value: Any, what: str = "a value") -> Any:
        """``value`` was just built: it must fit, and counts towards everything built."""
        n = _measure(value, self.cap)[0]
        self.fits(n, what)
        self.made += n
        if self.made > self.total:
            raise _Exceeded(f"it built more than {self.total:,} characters in all")
        return value


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("edgelin_chat_budget", default=None)


def _budget() -> _Budget:
    budget = _BUDGET.get()
    if budget is None:  # the environment used outside ChatTemplate (a test, a debugger): the default bounds
        budget = _Budget(RenderLimits())
        _BUDGET.set(budget)
    return budget


def _measure(value: Any, limit: int) -> tuple[int, int, int]:
    """(about how many characters ``value`` is as text -- a container's as its repr, every shared element counted
    each time it appears, as str() would --, how many values it holds, how deeply nested); stops counting past
    ``limit``. A range is as long as its repr: it holds nothing until it is read into a list, which is measured."""
    size = nodes = depth = 0
    stack = [(value, 0)]
    while stack and size <= limit and nodes <= limit:
        v, d = stack.pop()
        nodes += 1
        depth = max(depth, d)
        if isinstance(v, (str, bytes, bytearray)):
            size += len(v) + (2 if d else 0)  # quoted inside a container's repr
        elif isinstance(v, bool) or v is None:
            size += 5
        elif isinstance(v, int):
            size += v.bit_length() // 3 + 2
        elif isinstance(v, Mapping):
            size += 2
            stack.extend((x, d + 1) for item in v.items() for x in item)
        elif isinstance(v, (list, tuple, Set, type({}.keys()), type({}.values()), type({}.items()))):
            size += 2
            stack.extend((x, d + 1) for x in v)
        elif type(v).__name__ == "Namespace":  # jinja2's namespace(): its attributes
            stack.append((getattr(v, "_Namespace__attrs", {}), d))
        else:
            size += 24
    return size, nodes, depth


_NUMBERS = re.compile(r"\d+")
_PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _ints(values: Any) -> list[int]:
    values = list(values.values()) if isinstance(values, Mapping) else list(values) if isinstance(values, (list, tuple)) else [values]
    return [v for v in values if isinstance(v, int)]


def _check_printf(budget: _Budget, fmt: Any, args: Any) -> None:
    """``fmt % args`` must not pad to more characters than a rendering may build."""
    if not isinstance(fmt, str):
        return
    star = False
    for m in _PRINTF.finditer(fmt):
        for g in m.groups():
            star = star or g == "*"
            if g and g != "*":
                budget.fits(int(g), "a padded field")
    if star:
        for n in _ints(args):
            budget.fits(abs(n), "a padded field")


def _check_format(budget: _Budget, fmt: str, args: Any, kwargs: Any) -> None:
    """``fmt.format(...)``: no width or precision (written, or given through a nested field) past the bound."""
    nested = False
    for _, name, spec, _ in string.Formatter().parse(fmt):
        if spec:
            nested = nested or "{" in spec
            for n in _NUMBERS.findall(spec):
                budget.fits(int(n), "a padded field")
    if nested:
        for n in _ints(args) + _ints(kwargs):
            budget.fits(abs(n), "a padded field")


def _check_replace(budget: _Budget, s: Any, old: Any, new: Any, count: Any = -1) -> None:
    if isinstance(s, (str, bytes)) and isinstance(old, type(s)) and isinstance(new, type(s)):
        hits = s.count(old) if old else len(s) + 1
        if isinstance(count, int) and count >= 0:
            hits = min(hits, count)
        budget.fits(len(s) + hits * (len(new) - len(old)), "a replaced text")


def _check_method(budget: _Budget, method: Any, args: tuple, kwargs: dict) -> tuple:
    """A str / bytes / int method that can build far more than it is given: its result must fit before it is
    built. Returns the arguments to call it with (an iterable given to ``join`` read into a list once)."""
    owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
    if isinstance(owner, (str, bytes, bytearray)):
        width = args[0] if args else kwargs.get("width", kwargs.get("tabsize"))
        if name in ("center", "ljust", "rjust", "zfill") and isinstance(width, int):
            budget.fits(width, f"a text padded by {name}()")
        elif name == "expandtabs" and isinstance(width, int):
            budget.fits(len(owner) + owner.count("\t" if isinstance(owner, str) else b"\t") * max(width, 0), "an expanded text")
        elif name == "join" and len(args) == 1:
            items = list(args[0])
            budget.fits(_measure(items, budget.cap)[0] + len(owner) * len(items), "a joined text")
            args = (items,)
        elif name == "replace" and len(args) >= 2:
            _check_replace(budget, owner, *args[:3])
        elif name == "translate" and args and isinstance(args[0], Mapping):
            longest = max((len(v) for v in args[0].values() if isinstance(v, (str, bytes))), default=1)
            budget.fits(len(owner) * max(longest, 1), "a translated text")
    elif isinstance(owner, int) and name == "to_bytes":
        length = args[0] if args else kwargs.get("length", 1)
        if isinstance(length, int):
            budget.fits(length, "bytes")
    return args


def _check_binop(budget: _Budget, op: str, left: Any, right: Any) -> None:
    """``left op right`` must not build more than a rendering may: repetition, powers, printf padding."""
    if op == "*":
        if isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > INT_BITS:
                raise _Exceeded(f"it would compute an integer of more than {INT_BITS:,} bits")
            return
        seq, n = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(n, int) and isinstance(seq, (str, bytes, list, tuple)):
            budget.fits(_measure(seq, budget.cap)[0] * max(n, 0), "a repeated text or list")
    elif op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        if left.bit_length() * right > INT_BITS:
            raise _Exceeded(f"it would compute an integer of more than {INT_BITS:,} bits")
    elif op == "%" and isinstance(left, str):
        _check_printf(budget, left, right)


def _filter_checks(budget: _Budget, name: str, a: dict) -> None:
    """Filters whose result can be far larger than their input: checked before they run (``a``: the filter's
    arguments by name)."""
    def text(x):
        return x if isinstance(x, str) else ""

    if name == "center" and isinstance(a.get("width"), int):
        budget.fits(len(text(a.get("value"))) + a["width"], "a centred text")
    elif name == "indent":
        s, w = text(a.get("s")), a.get("width")
        w = w if isinstance(w, int) else len(w) if isinstance(w, str) else 0
        budget.fits(len(s) + (s.count("\n") + 1) * max(w, 0), "an indented text")
    elif name == "format":
        _check_printf(budget, a.get("value"), list(a.get("args", ())) + list(a.get("kwargs", {}).values()))
    elif name == "replace":
        _check_replace(budget, a.get("s"), a.get("old"), a.get("new"), a.get("count") if a.get("count") is not None else -1)
    elif name == "join":
        items = a["value"] = list(a["value"]) if not isinstance(a.get("value"), (str, Mapping)) else a.get("value")
        n = len(items) if hasattr(items, "__len__") else 0
        budget.fits(_measure(items, budget.cap)[0] + len(text(a.get("d"))) * n, "a joined text")
    elif name == "wordwrap":
        s, width = text(a.get("s")), a.get("width")
        lines = len(s) // max(width if isinstance(width, int) else 1, 1) + s.count("\n") + 1
        budget.fits(len(s) + lines * len(text(a.get("wrapstring")) or "\n"), "a wrapped text")
    elif name in ("batch", "slice"):
        n = a.get("linecount", a.get("slices"))
        if isinstance(n, int):
            budget.fits(n, f"a {name} of that many lists")
    elif name == "sum":
        items = a["iterable"] = list(a.get("iterable", ()))
        size = _measure(items, budget.cap)[0]
        budget.fits(size, "a sum")
        if len(items) * size > budget.total:  # sum() adds sequences one by one: each addition copies the total so far
            raise _Exceeded(f"summing {len(items):,} sequences would copy more than {budget.total:,} characters")
    elif name in ("tojson", "pprint"):
        size, nodes, depth = _measure(a.get("x", a.get("value")), budget.cap)
        indent = a.get("indent")
        width = indent if isinstance(indent, int) else len(indent) if isinstance(indent, str) else 1
        budget.fits(size + nodes * (depth * max(width, 0) + 4), f"{name} text")
    elif name == "string":
        budget.fits(_measure(a.get("value"), budget.cap)[0], "a text")
    elif name == "urlize":
        s = text(a.get("value"))
        extra = len(text(a.get("target"))) + len(text(a.get("rel"))) + 64
        budget.fits(len(s) + (len(s) // 4 + 1) * extra, "an urlized text")


def _guard_filter(name: str, func):
    """A filter that ticks the clock, is checked before it runs where its result can outgrow its input, and whose
    result must fit (jinja2's markers of what the filter is passed -- context, environment -- are kept)."""
    import inspect

    from jinja2.utils import _PassArg

    inner = inspect.unwrap(func)
    # jinja2's sync/async filters take an eval context that their wrapper drops before the function it wraps
    extra = 1 if _PassArg.from_obj(func) is not None and _PassArg.from_obj(inner) is None else 0
    try:
        signature = inspect.signature(inner)
    except (TypeError, ValueError):
        signature = None

    @wraps(func)
    def guarded(*args, **kwargs):
        budget = _budget()
        budget.tick()
        if signature is not None:
            try:
                bound = signature.bind(*args[extra:], **kwargs)
            except TypeError:
                bound = None  # the filter itself says what is wrong with its arguments
            if bound is not None:
                bound.apply_defaults()
                _filter_checks(budget, name, bound.arguments)
                args, kwargs = args[:extra] + bound.args, bound.kwargs
        return budget.make(func(*args, **kwargs), f"the result of the {name} filter")

    return guarded


class _Guard(ast.NodeTransformer):
    """Rewrites the Python jinja2 compiles a template to: every loop steps through ``environment.edgelin_loop``
    (which ticks the clock), and every ``str()`` / ``~`` goes through the environment's bounded versions."""

    NAMES = {"str": "edgelin_str", "str_join": "edgelin_str_join", "markup_join": "edgelin_markup_join"}

    @staticmethod
    def _env(name: str, where: ast.AST) -> ast.AST:
        return ast.copy_location(ast.Attribute(ast.Name("environment", ast.Load()), name, ast.Load()), where)

    def _loop(self, node):
        self.generic_visit(node)
        node.iter = ast.copy_location(ast.Call(self._env("edgelin_loop", node.iter), [node.iter], []), node.iter)
        return node

    visit_For = visit_comprehension = _loop

    def visit_Call(self, node):
        self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id in self.NAMES:
            node.func = self._env(self.NAMES[node.func.id], node.func)
        return node


def _jinja():
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise RuntimeInputError("chat templates need the jinja2 package: pip install 'jinja2>=3.1.6'") from None
    major, minor, patch = (int(x) for x in (jinja2.__version__.split(".") + ["0", "0"])[:3] if x.isdigit())
    if (major, minor, patch) < (3, 1, 6):
        raise RuntimeInputError(f"jinja2 {jinja2.__version__} has known sandbox escapes; chat templates are code from the checkpoint: pip install -U 'jinja2>=3.1.6'")
    return jinja2


def _environment():
    """Jinja2's immutable sandbox as transformers sets it up, bounded: every loop step, call, filter and operator
    ticks the clock of the rendering; what they build is measured (before, where it can outgrow its input);
    macro calls nest ``RenderLimits.depth`` deep at most; no constant folding at compile time (it would run the
    template's code outside these checks)."""
    jinja2 = _jinja()
    from jinja2.runtime import Macro, markup_join, str_join
    from jinja2.utils import generate_lorem_ipsum

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (marks the assistant's part for training): renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Bounded(jinja2.sandbox.ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["+", "-", "*", "/", "//", "%", "**"])

        def _compile(self, source, filename):
            tree = ast.fix_missing_locations(_Guard().visit(ast.parse(source, filename)))
            return compile(tree, filename, "exec")

        def call_binop(self, context, operator, left, right):
            budget = _budget()
            budget.tick()
            _check_binop(budget, operator, left, right)
            return budget.make(super().call_binop(context, operator, left, right), f"the result of {operator!r}")

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's signature)
            budget = _budget()
            budget.tick()
            args = _check_method(budget, __obj, args, kwargs)
            budget.depth += 1
            try:
                if budget.depth > budget.limits.depth:
                    raise _Exceeded(f"its calls nest more than {budget.limits.depth} deep (a macro that calls itself without end?)")
                result = super().call(__context, __obj, *args, **kwargs)
            finally:
                budget.depth -= 1
            if isinstance(__obj, Macro):  # its text was built (and counted) by concat
                _budget().fits(_measure(result, budget.cap)[0], "a macro's text")
                return result
            return budget.make(result, f"the result of {getattr(__obj, '__name__', 'a call')}()")

        def getitem(self, obj, argument):
            budget = _budget()
            budget.tick()
            value = super().getitem(obj, argument)
            return budget.make(value, "a slice") if isinstance(argument, slice) else value

        def wrap_str_format(self, value):
            formatted = super().wrap_str_format(value)
            if formatted is None:
                return None
            fmt = value.__self__

            def checked(*args, **kwargs):
                _check_format(_budget(), fmt, args, kwargs if kwargs or not args else args[0])
                return formatted(*args, **kwargs)

            return update_wrapper(checked, formatted)

        def edgelin_loop(self, iterable):
            budget = _budget()
            for item in iterable:
                budget.tick()
                yield item

        def edgelin_str(self, value=""):
            budget = _budget()
            budget.fits(_measure(value, budget.cap)[0], "a text")
            text = str(value)
            return text if text is value else budget.make(text, "a text")

        def _join(self, join, seq):
            budget = _budget()
            budget.tick()
            seq = list(seq)
            budget.fits(sum(_measure(x, budget.cap)[0] for x in seq), "a joined text")
            return budget.make(join(seq), "a joined text")

        def edgelin_str_join(self, seq):
            return self._join(str_join, seq)

        def edgelin_markup_join(self, seq):
            return self._join(markup_join, seq)

        def concat(self, pieces):  # the text of a macro, a block, a loop: the pieces are texts already
            budget = _budget()
            pieces = list(pieces)
            budget.fits(sum(len(p) for p in pieces), "a block's text")
            return budget.make("".join(pieces), "a block's text")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(fmt):
        budget = _budget()
        if isinstance(fmt, str):
            _check_printf(budget, fmt, ())
            budget.fits(len(fmt) * 64, "a date")
        return datetime.now().strftime(fmt)

    def lipsum(n=5, html=True, min=20, max=100):  # noqa: A002 (jinja2's argument names)
        for name, value in (("n", n), ("min", min), ("max", max)):
            if isinstance(value, int) and not 0 <= value <= MAX_LIPSUM:
                raise _Exceeded(f"lipsum({name}={value}) is past its bound of {MAX_LIPSUM:,}")
        return generate_lorem_ipsum(n=n, html=html, min=min, max=max)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, optimized=False, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.filters = {name: _guard_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["lipsum"] = lipsum
    return env


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: its text, or an object with ``content``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class ChatTemplate:
    """A checkpoint's chat template and the special tokens it is rendered with.

    ``origin`` names the template in messages (default: tokenizer_config.json); ``limits`` bounds each rendering
    (``RenderLimits``: time, size, nesting): a template that runs past them, or fails in any other way, is a
    ``ChatTemplateError`` of one line."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, *, origin: str | None = None,
                 limits: RenderLimits | None = None) -> None:
        self.origin = f"the chat template of {CONFIG_FILE}" if origin is None else str(origin)
        if not isinstance(source, str) or not source:
            raise ManifestError(f"{CONFIG_FILE}: chat_template must be a non-empty text ({self.origin})")
        if special_tokens is not None and not isinstance(special_tokens, Mapping):
            raise RuntimeInputError(f"special_tokens must be a dict of names to texts, got {type(special_tokens).__name__}")
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.limits = limits or RenderLimits()
        jinja2 = _jinja()
        token = _BUDGET.set(_Budget(self.limits, len(source)))  # compiling evaluates constant output
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ManifestError(f"{CONFIG_FILE}: the chat template does not parse ({exc.message}, line {exc.lineno}; "
                                f"{self.origin}); re-export with a fixed tokenizer_config.json") from None
        except (_Exceeded, RecursionError, MemoryError) as exc:  # a template nested past what the compiler can take
            raise ManifestError(f"{self.origin} cannot be compiled ({_one_line(exc)}); re-export with a fixed tokenizer_config.json") from None
        finally:
            _BUDGET.reset(token)

    @classmethod
    def of_config(cls, config: dict[str, Any], name: str = "default", *, origin: str | None = None) -> "ChatTemplate | None":
        """From tokenizer_config.json's data: its ``chat_template`` (a text, or a list of {name, template}: the one
        named ``name``), None where it has none."""
        if not isinstance(config, Mapping):
            raise RuntimeInputError(f"a tokenizer config is a dict (tokenizer_config.json's data), got {type(config).__name__}")
        origin = f"the chat template of {origin or CONFIG_FILE}"
        source = config.get("chat_template")
        if source is None:
            return None
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            if name not in named:
                raise RuntimeInputError(f"{CONFIG_FILE} has no chat template named {name!r}; it has {', '.join(map(str, named))}")
            source, origin = named[name], f"{origin} named {name!r}"
        special = {k: text for k, v in config.items() if k.endswith("_token") and (text := _token_text(v)) is not None}
        return cls(source, special, origin=origin)

    @classmethod
    def of_export(cls, export_dir: str | os.PathLike, manifest=None) -> "ChatTemplate | None":
        """The chat template of an export's tokenizer (its tokenizer_config.json, checked against the manifest's
        sha256); None where the export has none."""
        from edgelin.runtime.manifest import Manifest, file_sha256

        manifest = manifest or Manifest.load(export_dir)
        files = (manifest.tokenizer or {}).get("files") or {}
        if CONFIG_FILE not in files:
            return None
        path = Path(export_dir) / CONFIG_FILE
        if not path.is_file() or file_sha256(path) != files[CONFIG_FILE]:
            raise ManifestError(f"{path} is missing or is not the file edgelin.json describes (its sha256 differs); re-export the model")
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError(f"{path} is not JSON ({exc}); re-export the model") from None
        return cls.of_config(config, origin=str(path)) if isinstance(config, dict) else None

    def render(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True, **variables: Any) -> str:
        """The conversation as text, ending with the assistant's turn opened (``add_generation_prompt``).

        Bounded by ``self.limits``; any failure of the template is a ChatTemplateError naming it."""
        checked = check_messages(messages)
        jinja2 = _jinja()
        values = {**self.special_tokens, **variables, "messages": checked, "add_generation_prompt": add_generation_prompt}
        budget = _Budget(self.limits, _measure(values, 1 << 62)[0])
        token = _BUDGET.set(budget)
        try:
            pieces, n = [], 0
            render = self._template.root_render_func(self._template.new_context(values))
            try:
                for piece in render:
                    n += len(piece)
                    budget.fits(n, "a conversation's text")
                    pieces.append(piece)
            finally:
                render.close()
            text = "".join(pieces)
        except _Exceeded as exc:
            raise ChatTemplateError(f"{self.origin} ran past its bounds: {exc}; it is code from the checkpoint -- fix its "
                                    "chat_template (tokenizer_config.json) and re-export, or prompt with plain text") from None
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused the conversation: {_one_line(exc)} ({self.origin})") from None
        except Exception as exc:  # any other failure of the template's code (RecursionError, OverflowError, ...)
            raise ChatTemplateError(f"{self.origin} failed on this conversation ({type(exc).__name__}: {_one_line(exc)}); "
                                    "fix its chat_template (tokenizer_config.json) and re-export, or prompt with plain text") from None
        finally:
            _BUDGET.reset(token)
        at = _surrogate_at(text)
        if at is not None:
            raise ChatTemplateError(f"{self.origin} rendered a lone surrogate {text[at]!r} at character {at}, which is not text; "
                                    "fix its chat_template (tokenizer_config.json) and re-export")
        return text

    def ids(self, tokenizer, messages: Sequence[dict[str, Any]]) -> list[int]:
        """The ids of ``messages`` rendered, the assistant's turn opened; an error where the template renders nothing
        (there would be nothing to prompt the model with)."""
        ids = encode_rendered(tokenizer, self.render(messages, add_generation_prompt=True))
        if not ids:
            raise ChatTemplateError(f"{self.origin} rendered nothing for this conversation, so there is nothing to prompt the "
                                    "model with; fix its chat_template (tokenizer_config.json) and re-export, or prompt with plain text")
        return ids


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__


def _surrogate_at(text: str) -> int | None:
    """Where ``text`` holds a lone surrogate (no text: UTF-8 cannot hold it), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """A list of {"role", "content"} messages with known roles and text content; a one-line error otherwise."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise RuntimeInputError("a conversation is a non-empty list of {'role': ..., 'content': ...} messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise RuntimeInputError(f"message {i} must be {{'role': one of {', '.join(ROLES)}, 'content': text}}, got {str(m)[:80]}")
        at = _surrogate_at(m["content"])
        if at is not None:
            raise RuntimeInputError(f"message {i}'s content holds a lone surrogate {m['content'][at]!r} at character {at}, "
                                    "which is not text; pass valid Unicode text")
    return [dict(m) for m in messages]


def encode_rendered(tokenizer, text: str) -> list[int]:
    """The ids of a rendered conversation: the template's text holds its own special tokens (its bos among them),
    so nothing is added (transformers' apply_chat_template(tokenize=True) encodes it the same way)."""
    if not isinstance(text, str):
        raise RuntimeInputError(f"a rendered conversation is text (str), got {type(text).__name__}")
    at = _surrogate_at(text)
    if at is not None:
        raise RuntimeInputError(f"the text holds a lone surrogate {text[at]!r} at character {at}, which is not text; pass valid Unicode text")
    return tokenizer.tokenizer.encode(text, add_special_tokens=False).ids


def chat_ids(export_dir: str | os.PathLike, messages: Sequence[dict[str, Any]], manifest=None) -> list[int]:
    """The ids of ``messages`` rendered with the export's chat template, the assistant's turn opened."""
    from edgelin.runtime.manifest import Manifest
    from edgelin.runtime.tokenizer import make_tokenizer

    manifest = manifest or Manifest.load(export_dir)
    template = ChatTemplate.of_export(export_dir, manifest)
    if template is None:
        raise RuntimeInputError("this export's tokenizer has no chat template (tokenizer_config.json's chat_template); prompt it with plain text")
    tokenizer = make_tokenizer(manifest.tokenizer, export_dir, manifest.vocab_size)
    return template.ids(tokenizer, messages)


class Chat:
    """A conversation with an export that keeps the model's state between turns.

    Each turn renders the whole conversation with the chat template and feeds the model only the ids after those
    it has already seen (the previous prompts and replies, eos included); where the rendering of the past does not
    start with exactly those ids (a template that rewrites earlier turns, a reply that re-tokenizes differently),
    the conversation is prefilled again from a fresh state -- the same result, more work (``self.refills`` counts)."""

    def __init__(self, session, *, system: str | None = None, template: ChatTemplate | None = None) -> None:
        from edgelin.runtime.tokenizer import make_tokenizer

        if not hasattr(session, "manifest") or not hasattr(session, "export_dir"):
            raise RuntimeInputError(f"Chat takes a Session (edgelin.runtime.load(export_dir)), got {type(session).__name__}")
        if template is not None and not isinstance(template, ChatTemplate):
            raise RuntimeInputError(f"template must be a ChatTemplate, got {type(template).__name__}")
        self.session = session
        self.template = template or ChatTemplate.of_export(session.export_dir, session.manifest)
        if self.template is None:
            raise RuntimeInputError("this export's tokenizer has no chat template (tokenizer_config.json's chat_template); prompt it with plain text")
        if system is not None:
            check_messages([{"role": "system", "content": system}])  # text, else every later turn would fail on it
        self.tokenizer = make_tokenizer(session.manifest.tokenizer, session.export_dir, session.manifest.vocab_size)
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.state = None
        self.fed: list[int] = []  # every id the state has seen
        self.refills = 0  # turns that prefilled the whole conversation again
        self.last_prefill = 0
        self.last_stats = None  # the last turn's generate timings (Stats: first_token_s, prefill_s, decode_tokens_per_s, ...)

    def prompt_ids(self, messages: Sequence[dict[str, Any]] | None = None) -> list[int]:
        """The ids of the conversation so far (or of ``messages``) with the assistant's turn opened."""
        return self.template.ids(self.tokenizer, self.messages if messages is None else messages)

    def send(self, content: str, **options: Any) -> str:
        """The user's message -> the assistant's reply (Generator options: max_new_tokens, temperature, stop, ...).

        A refused turn (bad content or options, a template that fails, a prompt past the model's context, an
        interrupted generation) leaves the conversation as it was: the message is recorded only with its reply."""
        from edgelin.runtime.generate import Generator

        messages = check_messages(self.messages + [{"role": "user", "content": content}])
        ids = self.template.ids(self.tokenizer, messages)
        fresh = self.state is None or ids[: len(self.fed)] != self.fed or len(ids) == len(self.fed)
        state, fed = (None, []) if fresh else (self.state, self.fed)
        new = ids[len(fed):]
        gen = Generator(self.session, [new], state=state, **options)  # checks the options and ids; the state is untouched
        try:
            gen.run()
            after = gen.state
        except BaseException:
            if state is not None:  # the state went partly through this turn: the next one prefills the conversation anew
                self.state, self.fed = None, []
            raise
        result = gen.results[0]
        if fresh and self.state is not None:
            self.refills += 1
        self.state, self.last_stats, self.last_prefill = after, gen.stats, len(new)  # last_prefill: prompt tokens fed this turn
        self.fed = ids + result.ids + ([result.eos_id] if result.eos_id is not None else [])
        self.messages = messages + [{"role": "assistant", "content": result.text}]
        return result.text


__all__ = ["Chat", "ChatTemplate", "ChatTemplateError", "RenderLimits", "chat_ids", "check_messages", "encode_rendered"]
