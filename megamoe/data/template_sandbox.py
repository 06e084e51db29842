"""Chat templates from checkpoints rendered in a bounded Jinja sandbox.

A template is code from a file megamoe did not write. jinja2's ``ImmutableSandboxedEnvironment``
keeps it away from Python internals (``__class__``, ``__globals__``, unsafe callables, mutating
builtins): such a template raises ``SecurityError`` and is refused. The sandbox does not bound the
work, so this module adds, per render:

- time: a trace function installed for the render checks a deadline (default 2 s) every 512
  events; template code is traced line by line, so loops that call nothing are counted too;
- size: the rendered text is streamed and stopped past ``max_output`` characters (default the
  larger of 1 MiB and 8x the characters of the variables); ``*``, ``**``, ``%``, ``+`` and ``~``
  are checked before they build anything larger (integers too: ``MAX_INT_BITS``); every call's
  and filter's integer arguments are capped (``MAX_INT_ARG``), their inputs and results measured;
- input: the template source is at most ``MAX_SOURCE`` characters.

Every refusal is a one-line ``TemplateLimitError`` / ``SecurityError`` naming the limit.
"""
from __future__ import annotations

import functools
import re
import sys
import time
from functools import lru_cache

MAX_SOURCE = 1 << 20      # characters of template source
MAX_INT_ARG = 1 << 16     # integer arguments of calls and filters (widths, counts, repeats)
MAX_POWER = 64            # exponent of **
MAX_INT_BITS = 1 << 16    # integers that ** and * build
DEFAULT_SECONDS = 2.0
_WIDTH = re.compile(r"%[-+ #0]*(\d+)?(?:\.(\d+))?")


class TemplateLimitError(RuntimeError):
    """A render went past one of the bounds above."""


def weight(obj, budget: int = 1 << 62) -> int:
    """Characters of the strings in ``obj`` (nested lists, tuples, dicts), counting stops past
    ``budget``; other objects weigh their ``len`` if they have one, else 1."""
    if isinstance(obj, str):
        return len(obj)
    if isinstance(obj, dict):
        obj = [*obj.keys(), *obj.values()]
    if isinstance(obj, (list, tuple)):
        total = 0
        for x in obj:
            total += weight(x, budget - total)
            if total > budget:
                break
        return total
    return 1


class _Render:
    """The bounds of one render (kept in a module global while it runs; renders do not nest)."""

    def __init__(self, seconds: float, max_output: int):
        self.deadline, self.max_output, self.events = time.monotonic() + seconds, max_output, 0

    def size(self, obj, what: str):
        if weight(obj, self.max_output) > self.max_output:
            raise TemplateLimitError(f"{what} is larger than the {self.max_output}-character limit")
        return obj

    def trace(self, frame, event, arg):
        self.events += 1
        if not self.events & 511 and time.monotonic() > self.deadline:
            raise TemplateLimitError("rendering took longer than its time limit")
        return self.trace if frame.f_code.co_filename == "<template>" else None


_ACTIVE: _Render | None = None


def _active() -> _Render:
    if _ACTIVE is None:
        raise TemplateLimitError("a bounded template ran outside render_bounded")
    return _ACTIVE


def _check_args(args, kwargs, what: str) -> None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_INT_ARG:
            raise TemplateLimitError(f"{what}: integer argument {a} is over {MAX_INT_ARG}")


def _bounded_filter(name: str, fn):
    @functools.wraps(fn)  # keeps jinja's pass_context / pass_eval_context marks
    def call(*args, **kwargs):
        r = _active()
        _check_args(args, kwargs, f"filter {name}")
        r.size([a for a in args if isinstance(a, (str, list, tuple, dict))], f"input of filter {name}")
        return r.size(fn(*args, **kwargs), f"result of filter {name}")
    return call


def _bounded_concat(*parts) -> str:
    r = _active()
    r.size(list(parts), "a ~ concatenation")
    return "".join(str(p) for p in parts)


def _environment():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%", "+"})

        def call_binop(self, context, operator, left, right):
            r = _active()
            if operator == "**" and isinstance(right, (int, float)) and (abs(right) > MAX_POWER or (
                    isinstance(left, int) and abs(left).bit_length() * abs(right) > MAX_INT_BITS)):
                raise TemplateLimitError(f"** with exponent {right} is over the limits ({MAX_POWER}, "
                                         f"{MAX_INT_BITS}-bit results)")
            if operator == "*":  # measured before it is built
                seq, n = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and \
                        weight(seq, r.max_output) * max(n, 0) > r.max_output:
                    raise TemplateLimitError(f"a * repetition is larger than the {r.max_output}-character limit")
            if operator == "%" and isinstance(left, str):
                for m in _WIDTH.finditer(left):
                    if any(g and int(g) > MAX_INT_ARG for g in m.groups()):
                        raise TemplateLimitError(f"% format width {m.group(0)!r} is over {MAX_INT_ARG}")
            result = super().call_binop(context, operator, left, right)
            if isinstance(result, int) and result.bit_length() > MAX_INT_BITS:
                raise TemplateLimitError(f"the result of {operator} is over {MAX_INT_BITS} bits")
            return r.size(result, f"the result of {operator}")

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
            _check_args(args, kwargs, f"call of {getattr(__obj, '__name__', type(__obj).__name__)}")
            return _active().size(super().call(__context, __obj, *args, **kwargs), "a call's result")

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters = {name: _bounded_filter(name, fn) for name, fn in env.filters.items()}
    env.globals["__bounded_concat"] = _bounded_concat
    return env


def _concat_as_calls(tree):
    """Jinja compiles ``a ~ b`` to a plain join no sandbox hook sees: make it a call of
    ``__bounded_concat`` (measured before it joins)."""
    from jinja2 import nodes
    from jinja2.visitor import NodeTransformer

    class Concat(NodeTransformer):
        def visit_Concat(self, node):
            self.generic_visit(node)
            return nodes.Call(nodes.Name("__bounded_concat", "load"), node.nodes, [], None, None,
                              lineno=node.lineno)

    return Concat().visit(tree)


@lru_cache(maxsize=16)
def compile_bounded(source: str, globals_key: tuple = ()):
    """The template, parsed and compiled once per source (``globals_key``: extra globals as
    sorted (name, callable) pairs, e.g. ``raise_exception``)."""
    if len(source) > MAX_SOURCE:
        raise TemplateLimitError(f"template source has {len(source)} characters, over the {MAX_SOURCE} limit")
    env = _environment()
    env.globals.update(dict(globals_key))
    return env.from_string(_concat_as_calls(env.parse(source)))


def render_bounded(template, variables: dict, seconds: float = DEFAULT_SECONDS, max_output: int | None = None
                   ) -> str:
    """Render ``template`` (from ``compile_bounded``) within the bounds of the module docstring."""
    global _ACTIVE
    limit = max_output or max(1 << 20, 8 * weight(list(variables.values())))
    r = _Render(seconds, limit)
    previous, _ACTIVE = sys.gettrace(), r
    out, size = [], 0
    sys.settrace(r.trace)
    try:
        for piece in template.generate(**variables):
            size += len(piece)
            if size > limit:
                raise TemplateLimitError(f"rendered text is larger than the {limit}-character limit")
            out.append(piece)
    finally:
        sys.settrace(previous)
        _ACTIVE = None
    return "".join(out)
