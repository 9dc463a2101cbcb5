"""Bounded rendering of chat templates: a template is Jinja2 code from a checkpoint, untrusted like any code, so it
is rendered in Jinja2's immutable sandbox within ``RenderLimits``: time (a clock checked at every loop step, call,
filter and operator: jinja2's compiled loops are rewritten to go through a hook), size (what a step would build is
measured -- before it is built where it can outgrow its input: repetition, padding, joins, replacements -- and so
is the text rendered) and call depth. runtime/chat.py renders with it and turns every failure into one line.
"""

from __future__ import annotations

import ast
import contextvars
import json
import re
import string
import time
from collections import Counter
from collections.abc import Mapping, Set
from dataclasses import dataclass
from datetime import datetime
from functools import update_wrapper, wraps
from typing import Any

from edgelin.errors import RuntimeInputError


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


class Exceeded(Exception):
    """A rendering ran past one of its bounds (the message says which); not a TemplateError, which would read as
    the template refusing the conversation."""


class Budget:
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
            raise Exceeded(f"it took longer than {self.limits.seconds:g} s to render (a loop or a recursion that runs away)")

    def fits(self, n: int, what: str = "a value") -> None:
        if n > self.cap:
            raise Exceeded(f"it would build {what} of about {n:,} characters, more than the {self.cap:,} allowed")

    def make(self, value: Any, what: str = "a value") -> Any:
        """``value`` was just built: it must fit, and counts towards everything built."""
        n = measure(value, self.cap)[0]
        self.fits(n, what)
        self.made += n
        if self.made > self.total:
            raise Exceeded(f"it built more than {self.total:,} characters in all")
        return value


BUDGET: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("edgelin_chat_budget", default=None)


def _budget() -> Budget:
    budget = BUDGET.get()
    if budget is None:  # the environment used outside ChatTemplate (a test, a debugger): the default bounds
        budget = Budget(RenderLimits())
        BUDGET.set(budget)
    return budget


def measure(value: Any, limit: int) -> tuple[int, int, int]:
    """(about how many characters ``value`` is as text -- a container's as its repr, every shared element counted
    each time it appears, as str() would --, how many values it holds, how deeply nested); stops counting past
    ``limit``. A range is as long as its repr: it holds nothing until it is read into a list, which is measured."""
    size = nodes = depth = 0
    stack = [(value, 0, 1)]  # (value, depth, how many times it appears)
    while stack and size <= limit and nodes <= limit:
        v, d, m = stack.pop()
        nodes += m
        depth = max(depth, d)
        if isinstance(v, (str, bytes, bytearray)):
            size += m * (len(v) + (2 if d else 0))  # quoted inside a container's repr
        elif isinstance(v, bool) or v is None:
            size += m * 5
        elif isinstance(v, int):
            size += m * (v.bit_length() // 3 + 2)
        elif isinstance(v, Mapping):
            size += m * 2
            stack.extend((x, d + 1, m) for item in v.items() for x in item)
        elif isinstance(v, (list, tuple, Set, type({}.keys()), type({}.values()), type({}.items()))):
            size += m * 2
            items = v if isinstance(v, (list, tuple)) else list(v)
            counts = Counter(map(id, items))
            if len(counts) == len(items):
                stack.extend((x, d + 1, m) for x in items)
            else:  # one object appearing many times ([[0]] * 100000) is walked once, counted each time
                first = {id(x): x for x in items}
                stack.extend((first[i], d + 1, m * c) for i, c in counts.items())
        elif type(v).__name__ == "Namespace":  # jinja2's namespace(): its attributes
            stack.append((getattr(v, "_Namespace__attrs", {}), d, m))
        else:
            size += m * 24
    return size, nodes, depth


_NUMBERS = re.compile(r"\d+")


_PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _ints(values: Any) -> list[int]:
    values = list(values.values()) if isinstance(values, Mapping) else list(values) if isinstance(values, (list, tuple)) else [values]
    return [v for v in values if isinstance(v, int)]


def _check_printf(budget: Budget, fmt: Any, args: Any) -> None:
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


def _check_format(budget: Budget, fmt: str, args: Any, kwargs: Any) -> None:
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


def _check_replace(budget: Budget, s: Any, old: Any, new: Any, count: Any = -1) -> None:
    if isinstance(s, (str, bytes)) and isinstance(old, type(s)) and isinstance(new, type(s)):
        hits = s.count(old) if old else len(s) + 1
        if isinstance(count, int) and count >= 0:
            hits = min(hits, count)
        budget.fits(len(s) + hits * (len(new) - len(old)), "a replaced text")


def _check_method(budget: Budget, method: Any, args: tuple, kwargs: dict) -> tuple:
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
            budget.fits(measure(items, budget.cap)[0] + len(owner) * len(items), "a joined text")
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


def _check_binop(budget: Budget, op: str, left: Any, right: Any) -> None:
    """``left op right`` must not build more than a rendering may: repetition, powers, printf padding."""
    if op == "*":
        if isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > INT_BITS:
                raise Exceeded(f"it would compute an integer of more than {INT_BITS:,} bits")
            return
        seq, n = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(n, int) and isinstance(seq, (str, bytes, list, tuple)):
            budget.fits(measure(seq, budget.cap)[0] * max(n, 0), "a repeated text or list")
    elif op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        if left.bit_length() * right > INT_BITS:
            raise Exceeded(f"it would compute an integer of more than {INT_BITS:,} bits")
    elif op == "%" and isinstance(left, str):
        _check_printf(budget, left, right)


def _filter_checks(budget: Budget, name: str, a: dict) -> None:
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
        budget.fits(measure(items, budget.cap)[0] + len(text(a.get("d"))) * n, "a joined text")
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
        # counting stops once the copies would pass the total: a long list of small sequences is refused early
        size = measure(items, min(budget.cap, budget.total // max(len(items), 1)))[0]
        budget.fits(size, "a sum")
        if len(items) * size > budget.total:  # sum() adds sequences one by one: each addition copies the total so far
            raise Exceeded(f"summing {len(items):,} sequences would copy more than {budget.total:,} characters")
    elif name in ("tojson", "pprint"):
        size, nodes, depth = measure(a.get("x", a.get("value")), budget.cap)
        indent = a.get("indent")
        width = indent if isinstance(indent, int) else len(indent) if isinstance(indent, str) else 1
        budget.fits(size + nodes * (depth * max(width, 0) + 4), f"{name} text")
    elif name == "string":
        budget.fits(measure(a.get("value"), budget.cap)[0], "a text")
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


def jinja():
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


def environment():
    """Jinja2's immutable sandbox as transformers sets it up, bounded: every loop step, call, filter and operator
    ticks the clock of the rendering; what they build is measured (before, where it can outgrow its input);
    macro calls nest ``RenderLimits.depth`` deep at most; no constant folding at compile time (it would run the
    template's code outside these checks)."""
    jinja2 = jinja()
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
                    raise Exceeded(f"its calls nest more than {budget.limits.depth} deep (a macro that calls itself without end?)")
                result = super().call(__context, __obj, *args, **kwargs)
            finally:
                budget.depth -= 1
            if isinstance(__obj, Macro):  # its text was built (and counted) by concat
                _budget().fits(measure(result, budget.cap)[0], "a macro's text")
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
            budget.fits(measure(value, budget.cap)[0], "a text")
            text = str(value)
            return text if text is value else budget.make(text, "a text")

        def _join(self, join, seq):
            budget = _budget()
            budget.tick()
            seq = list(seq)
            budget.fits(sum(measure(x, budget.cap)[0] for x in seq), "a joined text")
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
                raise Exceeded(f"lipsum({name}={value}) is past its bound of {MAX_LIPSUM:,}")
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


__all__ = ["BUDGET", "Budget", "Exceeded", "RenderLimits", "environment", "jinja", "measure"]
