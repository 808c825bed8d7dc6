"""The sandbox that model chat templates render in.

A chat template read from a model file is untrusted input. Jinja's immutable sandbox
stops it from reaching Python internals, but not from spending memory and time:
``'x' * 10**9``, a string doubled in a loop, nested loops over ``range``. Rendering
happens on the caller's thread (the event loop, for some runtimes), so every value a
template builds is size-checked, work is counted in steps, and a render has a deadline.

:class:`SandboxedTemplate` is the whole interface: compile once, render per request.
jinja2 is imported on first use: most models never need a template.
"""

from __future__ import annotations

import inspect
import json
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextvars import ContextVar
from datetime import datetime
from functools import wraps
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from jinja2 import nodes
    from jinja2.runtime import Context

__all__ = ["MAX_OUTPUT_CHARS", "SandboxedTemplate", "TemplateLimitError"]

MAX_OUTPUT_CHARS = 1_000_000  # the rendered prompt, and any single value built on the way
_MAX_PRODUCED_CHARS = 8 * MAX_OUTPUT_CHARS  # all output, captured blocks and macros included
_MAX_STEPS = 1_000_000  # loop iterations, calls, operators and filters
_MAX_RENDER_SECONDS = 2.0
_MAX_INT_BITS = 4096
# Methods of strings a template may call: none of them builds a string much larger
# than its inputs, except replace and join, which are estimated before they run.
_SAFE_STR_METHODS = frozenset(
    {
        "capitalize", "casefold", "count", "endswith", "find", "index", "isalnum",
        "isalpha", "isascii", "isdecimal", "isdigit", "isidentifier", "islower",
        "isnumeric", "isprintable", "isspace", "istitle", "isupper", "join", "lower",
        "lstrip", "partition", "removeprefix", "removesuffix", "replace", "rfind",
        "rindex", "rpartition", "rsplit", "rstrip", "split", "splitlines", "startswith",
        "strip", "swapcase", "title", "upper",
    }
)  # fmt: skip
_HUGE_FORMAT_WIDTH = re.compile(r"\d{6,}")


class TemplateLimitError(Exception):
    """A model template went past one of the sandbox's limits."""


class _Budget:
    """What one render may still spend."""

    __slots__ = ("deadline", "produced", "steps")

    def __init__(self) -> None:
        self.steps = 0
        self.produced = 0
        self.deadline = time.monotonic() + _MAX_RENDER_SECONDS

    def step(self) -> None:
        self.steps += 1
        if self.steps > _MAX_STEPS:
            raise TemplateLimitError(f"the template did more than {_MAX_STEPS} steps")
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"the template ran longer than {_MAX_RENDER_SECONDS} s")

    def produce(self, chars: int) -> None:
        self.produced += chars
        if self.produced > _MAX_PRODUCED_CHARS:
            raise TemplateLimitError(f"the template produced over {_MAX_PRODUCED_CHARS} chars")


_BUDGET: ContextVar[_Budget | None] = ContextVar("prompt_template_budget", default=None)


def _spend() -> _Budget:
    budget = _BUDGET.get()
    if budget is None:
        # Template code only runs inside SandboxedTemplate.render, which sets one.
        raise TemplateLimitError("template code ran outside a render")
    budget.step()
    return budget


def _check_size(value: Any) -> Any:
    """``value`` unchanged, unless it is larger than any value a template may build."""
    if isinstance(value, str | list | tuple | dict | set | frozenset) and (
        len(value) > MAX_OUTPUT_CHARS
    ):
        raise TemplateLimitError(f"the template built a value of {len(value)} items")
    if isinstance(value, int) and value.bit_length() > _MAX_INT_BITS:
        raise TemplateLimitError("the template built a huge number")
    return value


def _check_estimate(chars: int) -> None:
    if chars > MAX_OUTPUT_CHARS:
        raise TemplateLimitError(f"the template would build a value of {chars} chars")


def _check_ints(values: Iterable[Any]) -> None:
    for value in values:
        if isinstance(value, int) and abs(value) > MAX_OUTPUT_CHARS:
            raise TemplateLimitError(f"the template passed {value} as an argument")


def _str_len(value: Any) -> int:
    return len(value) if isinstance(value, str) else len(str(value))


def _estimate_replace(text: str, old: Any, new: Any, count: Any = -1) -> None:
    if not isinstance(old, str) or not isinstance(new, str):
        return
    hits = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    _check_estimate(len(text) + hits * (len(new) - len(old)))


def _materialize(items: Any) -> list[Any]:
    """A list of ``items``, counted against the budget as it is read."""
    budget = _spend()
    out: list[Any] = []
    for item in items:
        budget.step()
        out.append(item)
    _check_size(out)
    return out


def _estimate_join(separator: str, items: list[Any]) -> None:
    _check_estimate(sum(_str_len(i) for i in items) + len(separator) * max(len(items) - 1, 0))


def _estimate_format(fmt: Any, args: Iterable[Any]) -> None:
    """``%``-formatting, checked before it runs: a width alone can ask for gigabytes."""
    if not isinstance(fmt, str):
        return
    if _HUGE_FORMAT_WIDTH.search(fmt):
        raise TemplateLimitError("the template used a huge format width")
    values = list(args)
    widest = max((abs(v) for v in values if isinstance(v, int)), default=0)
    _check_estimate(len(fmt) + sum(_str_len(v) for v in values) + fmt.count("%") * widest)


def _guard_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` (a Jinja filter) with the sandbox's limits around it."""
    # Filters marked with pass_context/pass_environment get that object first.
    skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0

    @wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _spend()
        head, (value, *rest) = args[:skip], args[skip:]
        _check_ints((*rest, *kwargs.values()))
        if name == "join":
            value = _materialize(value)
            separator = rest[0] if rest else kwargs.get("d", "")
            _estimate_join(separator if isinstance(separator, str) else "", value)
        elif name == "replace" and isinstance(value, str) and len(rest) >= 2:
            _estimate_replace(value, *rest[:3])
        elif name == "indent" and isinstance(value, str):
            width = rest[0] if rest else kwargs.get("width", 4)
            per_line = width if isinstance(width, int) else _str_len(width)
            _check_estimate(len(value) + per_line * (value.count("\n") + 1))
        elif name == "wordwrap" and isinstance(value, str):
            width = rest[0] if rest else kwargs.get("width", 79)
            wrap = (rest[3] if len(rest) > 3 else kwargs.get("wrapstring")) or "\n"
            lines = len(value) // max(width if isinstance(width, int) else 1, 1) + 1
            _check_estimate(len(value) + lines * _str_len(wrap))
        elif name == "format":
            _estimate_format(value, (*rest, *kwargs.values()))
        elif name == "center":
            width = rest[0] if rest else kwargs.get("width", 80)
            _check_estimate(width if isinstance(width, int) else 0)
        return _check_size(func(*head, value, *rest, **kwargs))

    return guarded


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Chat templates are written for transformers' tojson, which keeps non-ASCII
    # text and does not HTML-escape (Jinja's own does both).
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _build_sandbox() -> Any:
    """A sandboxed Jinja environment with the limits above; built on first use."""
    from jinja2 import nodes
    from jinja2.exceptions import SecurityError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.visitor import NodeTransformer

    class GuardedSandbox(ImmutableSandboxedEnvironment):
        # Arithmetic is routed through call_binop for these, so sizes can be checked.
        intercepted_binops = frozenset({"+", "*", "**", "%"})

        def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
            # The default hands back an Undefined that renders as "" until it is used
            # further; an escape attempt should fail the render at once.
            raise SecurityError(
                f"access to attribute {attribute!r} of {type(obj).__name__!r} is unsafe"
            )

        def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
            _spend()
            if operator == "*":
                for seq, times in ((left, right), (right, left)):
                    if isinstance(seq, str | list | tuple) and isinstance(times, int):
                        _check_estimate(len(seq) * times)
            elif operator == "**" and isinstance(left, int) and isinstance(right, int):
                if right > 0 and abs(left) > 1:
                    _check_int_power(left, right)
            elif operator == "%" and isinstance(left, str):
                args = right if isinstance(right, tuple) else (right,)
                _estimate_format(left, args)
            return _check_size(super().call_binop(context, operator, left, right))

        def call(self, context: Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
            _spend()
            if getattr(obj, "__self__", None) is not self:  # the hooks below take any value
                _check_ints((*args, *(v for k, v in kwargs.items() if not k.startswith("_"))))
            method = inspect.unwrap(obj)
            owner = getattr(method, "__self__", None)
            if inspect.isbuiltin(method) and isinstance(owner, str):
                name = method.__name__
                if name not in _SAFE_STR_METHODS:
                    raise SecurityError(f"str.{name} is not available to chat templates")
                if name == "replace" and len(args) >= 2:
                    _estimate_replace(owner, *args[:3])
                elif name == "join" and args:
                    items = _materialize(args[0])
                    _estimate_join(owner, items)
                    args = (items, *args[1:])
            return _check_size(super().call(context, obj, *args, **kwargs))

        def pool_iter(self, iterable: Any) -> Iterator[Any]:
            budget = _spend()
            for item in iterable:
                budget.step()
                yield item

        def pool_concat(self, *parts: Any) -> str:
            _spend()
            texts = [str(p) for p in parts]
            _check_estimate(sum(len(t) for t in texts))
            return "".join(texts)

        def pool_output(self, value: Any) -> Any:
            _spend().produce(_str_len(value))
            return value

        def pool_bounded(self, value: Any) -> Any:
            return _check_size(value)

    class Instrument(NodeTransformer):
        """Routes loops, ``~`` joins, block captures and output through the budget.

        The calls go to attributes of the environment, a name a template cannot
        shadow with ``{% set %}``.
        """

        def _hook(self, name: str, args: list[nodes.Expr], node: nodes.Node) -> nodes.Call:
            return nodes.Call(
                nodes.EnvironmentAttribute(name, lineno=node.lineno),
                args,
                [],
                None,
                None,
                lineno=node.lineno,
            )

        def visit_For(self, node: nodes.For) -> nodes.Node:
            self.generic_visit(node)
            node.iter = self._hook("pool_iter", [cast("nodes.Expr", node.iter)], node)
            return node

        def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
            self.generic_visit(node)
            return self._hook("pool_concat", list(node.nodes), node)

        def visit_Output(self, node: nodes.Output) -> nodes.Node:
            self.generic_visit(node)
            node.nodes = [self._hook("pool_output", [child], child) for child in node.nodes]
            return node

        def visit_AssignBlock(self, node: nodes.AssignBlock) -> nodes.Node:
            # `{% set x %}...{% endset %}` captures output; check what it captured.
            self.generic_visit(node)
            node.filter = nodes.Filter(
                node.filter, "pool_bounded", [], [], None, None, lineno=node.lineno
            )
            return node

    # Constant folding would run filters at compile time, outside any budget.
    env = GuardedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols], optimized=False
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _guard_filter(name, f) for name, f in env.filters.items()}
    env.filters["pool_bounded"] = env.pool_bounded
    # lipsum(n=...) writes paragraphs on demand; no chat template needs it.
    env.globals.pop("lipsum", None)
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)

    def compile_template(source: str) -> Any:
        tree = env.parse(source)
        Instrument().visit(tree)
        return env.from_string(tree)

    return compile_template


def _check_int_power(base: int, exponent: int) -> None:
    if exponent * base.bit_length() > _MAX_INT_BITS:
        raise TemplateLimitError("the template computed a huge power")


_compile_template: Callable[[str], Any] | None = None


def _compile(source: str) -> Any:
    global _compile_template
    if _compile_template is None:
        # jinja2 is imported on first use: most models never need a template.
        _compile_template = _build_sandbox()
    return _compile_template(source)


class SandboxedTemplate:
    """A chat template compiled in the sandbox, ready to render any number of times.

    Args:
        source: the Jinja source (untrusted).

    Raises:
        Exception: whatever Jinja raises for a template that does not compile.
    """

    def __init__(self, source: str) -> None:
        self._compiled = _compile(source)

    def render(self, variables: Mapping[str, Any]) -> str:
        """The template's output for ``variables``, within the sandbox's limits.

        Raises:
            TemplateLimitError: the render went past a limit (size, steps, time, or
                :data:`MAX_OUTPUT_CHARS` of output).
            RecursionError: the template recursed too deeply.
            Exception: whatever else the template raised (``SecurityError``,
                ``TemplateError``, its own bugs).
        """
        budget_token = _BUDGET.set(_Budget())
        try:
            pieces: list[str] = []
            size = 0
            for chunk in self._compiled.generate(**variables):
                size += len(chunk)
                if size > MAX_OUTPUT_CHARS:
                    raise TemplateLimitError(f"the prompt is over {MAX_OUTPUT_CHARS} chars")
                pieces.append(chunk)
            return "".join(pieces)
        finally:
            _BUDGET.reset(budget_token)
