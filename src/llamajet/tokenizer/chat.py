"""Chat templates: rendered with a sandboxed jinja2 set up like transformers'.

The templates come from strangers (tokenizer_config.json, GGUF metadata):
jinja2's ImmutableSandboxedEnvironment refuses attribute access to Python
internals and mutation of the inputs. It does not bound the work a template
does, so this module adds that (docs/limits.md lists the numbers):

- every rendered prompt is at most MAX_OUTPUT_CHARS characters, counted as
  the template streams its output (``Template.generate``), so the whole text
  is never built first;
- every value a template builds — by ``*``, ``**``, ``+``, ``%``, ``~``,
  ``str.format``, a string method, a filter or a namespace store — is
  sized before it is made where the size is known in advance (repetition,
  padding widths, joins, replacements), and checked after otherwise: nothing
  grows past MAX_OUTPUT_CHARS in one operation, so no single step allocates
  more than a small multiple of it;
- loop iterations plus calls (macros, methods, globals) are counted against
  MAX_STEPS per render, so nested loops or exponentially recursive macros
  stop early even when they print nothing. jinja2's own ``range`` cap
  (sandbox.MAX_RANGE = 100,000 items per range) stays, but bounds only one
  loop, not loops nested in one another;
- a render stops after MAX_RENDER_SECONDS of wall time, checked every
  TIME_CHECK_EVERY steps and on every output chunk: the step count bounds
  the number of operations, this bounds their total cost (a step may be
  one 4 MB string operation).

A template over a limit fails with TokenizerError naming the limit, and so
does a template source above MAX_TEMPLATE_CHARS. Real
templates (Llama-3, Qwen2, SmolLM2) stay orders of magnitude below both.
"""

from __future__ import annotations

import json
import re
import string
import time
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache, wraps
from typing import Any

from llamajet.errors import RequestError, TokenizerError

MAX_OUTPUT_CHARS = 4 * 1024 * 1024  # a rendered prompt, and any one string or list a template builds
# loop iterations + calls in one render. Real templates take about 2 per
# message (measured: SmolLM2's 203 and Qwen2.5's 429 with 20 tools, for 202
# messages), so this is a ~100,000-message conversation. It was 10^6 until
# fuzzing timed a nested loop spending it at 0.28 s plain and over 2 s under
# coverage instrumentation (the fuzz campaign's hang limit).
MAX_STEPS = 200_000
# Wall time of one render. Real templates render in 1-5 ms (202 messages with
# 20 tools included); the fuzz campaign calls anything over 2 s a hang.
MAX_RENDER_SECONDS = 1.0
TIME_CHECK_EVERY = 256
# Nesting depth of a template's syntax tree. jinja2's compiler folds
# constants once per level over the levels below (quadratic: 200 chained
# operators took 1.9 s, then Python's own compiler refused the generated code
# with SyntaxError; found by fuzzing). Real templates nest 10 (SmolLM2) and
# 19 (Qwen2.5) deep (tests/test_bounds.py).
MAX_NESTING = 64
MAX_TEMPLATE_CHARS = 1024 * 1024  # a template's source (real ones: 1-30 kB); compiling is linear in it

# name of the global the rewritten loops and concatenations call (see _bounded_ast)
_GUARD = "__llamajet_guard"


class _TemplateLimit(Exception):
    """A render went over a bound (becomes TokenizerError in render)."""


class _Budget:
    """The work one render may still do."""

    def __init__(self) -> None:
        self.steps = MAX_STEPS
        self.deadline = time.monotonic() + MAX_RENDER_SECONDS

    def step(self) -> None:
        self.steps -= 1
        if self.steps < 0:
            raise _TemplateLimit(f"chat template did more than {MAX_STEPS} loop iterations and calls")
        if self.steps % TIME_CHECK_EVERY == 0:
            self.check_time()

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise _TemplateLimit(f"chat template rendered for more than {MAX_RENDER_SECONDS} s")


# The budget of the render in progress on this thread (one compiled template
# may be rendered by several threads at once, so it cannot live on it).
_BUDGET: ContextVar[_Budget | None] = ContextVar("llamajet_template_budget", default=None)


def _step() -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.step()


def _check_size(n: int, what: str) -> None:
    if n > MAX_OUTPUT_CHARS:
        raise _TemplateLimit(f"chat template builds {what} of size {n} (limit {MAX_OUTPUT_CHARS})")


def _check_result(value: Any, what: str) -> Any:
    if isinstance(value, (str, bytes, list, tuple)):
        _check_size(len(value), what)
    return value


def _sized(x: Any) -> int | None:
    return len(x) if isinstance(x, (str, bytes, list, tuple)) else None


def _weight(seq: Any) -> int:
    """Items in `seq`, counting a string or list element by its length (one
    level deep): ``['x' * 4_000_000] * 1000`` weighs 4e9, though it holds
    1000 references, because printing or joining it builds that much."""
    if isinstance(seq, (list, tuple)):
        return sum(max(_sized(x) or 1, 1) for x in seq)
    return len(seq)


def _joined(items: Any, sep: str) -> list[str]:
    """`items` as the strings a join would concatenate, refused as soon as
    their total passes the limit (before the join allocates it)."""
    texts, total = [], 0
    for x in items:
        text = x if isinstance(x, str) else str(x)
        total += len(text) + len(sep)
        _check_size(total, "a joined string")
        texts.append(text)
    return texts


_WIDTH = re.compile(r"\d+")


def _check_format_spec(fmt: str, what: str) -> None:
    """Refuses a %-format or format-spec string with a width or precision
    above the limit ("%999999999d", "{:>999999999}"): the padding would be
    allocated before any check could see it."""
    for number in _WIDTH.findall(fmt):
        if len(number) > 7 or int(number) > MAX_OUTPUT_CHARS:
            raise _TemplateLimit(f"chat template {what} pads to {number} characters (limit {MAX_OUTPUT_CHARS})")


class _Guard:
    """What the rewritten template calls: ``loop(iterable)`` for each for loop,
    ``concat(*parts)`` for each ``~``."""

    @staticmethod
    def loop(iterable: Any):
        for item in iterable:
            _step()
            yield item

    @staticmethod
    def concat(*parts: Any) -> str:
        texts = [str(p) for p in parts]
        _check_size(sum(map(len, texts)), "a string")
        return "".join(texts)


def _bounded_ast(env: Any, source: str) -> Any:
    """The template's syntax tree with every for loop's iterable wrapped in
    ``_Guard.loop`` (counted iterations) and every ``~`` turned into
    ``_Guard.concat`` (sized before joining). Rewriting the tree keeps
    rendering identical otherwise: the compiler sees ordinary calls."""
    from jinja2 import nodes
    from jinja2.visitor import NodeTransformer

    def guard(method: str, args: list) -> Any:
        return nodes.Call(nodes.Getattr(nodes.Name(_GUARD, "load"), method, "load"), args, [], None, None)

    class Rewrite(NodeTransformer):
        def visit_For(self, node: Any) -> Any:
            node = self.generic_visit(node)
            node.iter = guard("loop", [node.iter])
            return node

        def visit_Concat(self, node: Any) -> Any:
            node = self.generic_visit(node)
            return guard("concat", node.nodes)

    tree = env.parse(source)
    depth = _ast_depth(tree)
    if depth > MAX_NESTING:
        raise TokenizerError(f"chat template nests {depth} levels deep, above the limit of {MAX_NESTING}")
    return Rewrite().visit(tree)


def _ast_depth(tree: Any) -> int:
    """The deepest node of a jinja2 AST, walked without recursion."""
    deepest, stack = 0, [(tree, 1)]
    while stack:
        node, d = stack.pop()
        deepest = max(deepest, d)
        stack.extend((c, d + 1) for c in node.iter_child_nodes())
    return deepest


def render(source: str, messages: list[dict], **variables: Any) -> str:
    """The template `source` rendered for `messages` (None-valued keys dropped,
    as transformers does: OpenAI clients send content=None), within the
    bounds above."""
    template = compile_template(source)
    msgs = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
    budget = _Budget()
    token = _BUDGET.set(budget)
    try:
        parts, size = [], 0
        for chunk in template.generate(messages=msgs, **variables):
            budget.check_time()
            size += len(chunk)
            if size > MAX_OUTPUT_CHARS:
                raise _TemplateLimit(f"chat template output exceeds {MAX_OUTPUT_CHARS} characters")
            parts.append(chunk)
        return "".join(parts)
    except _TemplateLimit as e:
        raise TokenizerError(f"chat template refused: {e}") from None
    except _TemplateRaised as e:  # the template's own check of the messages: the request's fault
        raise RequestError(f"the chat template refused these messages: {e}") from None
    except Exception as e:  # jinja2 TemplateError, or the template's raise_exception
        raise TokenizerError(f"chat template failed: {e}") from e
    finally:
        _BUDGET.reset(token)


class _TemplateRaised(Exception):
    """A template's raise_exception(...): it refuses the messages (roles that do not
    alternate, a system message where none may be, ...)."""


@lru_cache(maxsize=16)
def compile_template(source: str) -> Any:
    """Compile a chat template in a jinja2 sandbox configured like transformers',
    with the bounds of this module."""
    if len(source) > MAX_TEMPLATE_CHARS:
        raise TokenizerError(f"chat template of {len(source)} characters, above the limit of {MAX_TEMPLATE_CHARS}")
    import jinja2
    import jinja2.ext
    from jinja2.filters import make_attrgetter
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

    class _Generation(jinja2.ext.Extension):
        # {% generation %}...{% endgeneration %} marks assistant text for training
        # masks in transformers; for rendering it is just its body.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    class BoundedNamespace(Namespace):
        # {% set ns.x = ... %} in a loop is how a template grows a value across
        # iterations (lists are immutable here): size each store.
        def __setitem__(self, name: str, value: Any) -> None:
            super().__setitem__(name, _check_result(value, f"namespace value {name!r}"))

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
            if op == "*":  # repetition: 'x' * 10**9, [0] * 10**9
                for seq, n in ((left, right), (right, left)):
                    if _sized(seq) is not None and isinstance(n, int) and not isinstance(n, bool):
                        _check_size(_weight(seq) * max(n, 0), "a repeated value")
            elif op == "**":  # 10 ** 10 ** 10 takes forever before it is printed
                if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
                    _check_size(right * abs(left).bit_length() * 3 // 10, "a number of digits")
            elif op == "+":
                if _sized(left) is not None and _sized(right) is not None:
                    _check_size(_sized(left) + _sized(right), "a sum")
            elif op == "%" and isinstance(left, str):
                _check_format_spec(left, "%-format")
            return _check_result(super().call_binop(context, op, left, right), f"an {op!r} result")

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            _step()
            owner = getattr(__obj, "__self__", None)
            if isinstance(owner, (str, bytes)):
                # str.ljust/center/zfill/expandtabs(10**9), sep.join(...), s.replace(a, b)
                name = getattr(__obj, "__name__", "")
                if any(isinstance(a, int) and a > MAX_OUTPUT_CHARS for a in (*args, *kwargs.values())):
                    raise _TemplateLimit(f"chat template calls str.{name} with a size above {MAX_OUTPUT_CHARS}")
                if name == "join" and args:
                    args = (_joined(args[0], str(owner)), *args[1:])
                elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) \
                        and isinstance(args[1], str):
                    hits = owner.count(args[0]) if args[0] else len(owner) + 1
                    _check_size(len(owner) + hits * (len(args[1]) - len(args[0])), "a replaced string")
            return _check_result(super().call(__context, __obj, *args, **kwargs), "a call's result")

        def wrap_str_format(self, value: Any) -> Any:
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None
            for _, _, spec, _ in string.Formatter().parse(value.__self__):
                _check_format_spec(spec or "", "str.format")
            return wrapped

    def bounded_filter(name: str, f: Any) -> Any:
        # Each filter's result is sized after it ran; those whose result size is
        # set by an argument (padding widths, joins, replacements) are checked
        # before, so the big value is never allocated.
        @wraps(f)
        def run(*args: Any, **kwargs: Any) -> Any:
            value_at = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0
            params = args[value_at + 1:]
            if name in ("center", "indent", "wordwrap", "truncate", "tojson", "batch", "slice") and any(
                    isinstance(a, int) and a > MAX_OUTPUT_CHARS for a in (*params, *kwargs.values())):
                raise _TemplateLimit(f"chat template filter {name} asks for a size above {MAX_OUTPUT_CHARS}")
            if name == "format" and isinstance(args[value_at], str):
                _check_format_spec(args[value_at], "format filter")
            if name == "join":
                items = args[value_at]
                attribute = params[1] if len(params) > 1 else kwargs.pop("attribute", None)
                if attribute is not None:  # resolve it here, so the sizes are those joined
                    items = map(make_attrgetter(env, attribute), items)
                    params = params[:1]
                sep = params[0] if params else kwargs.get("d", "")
                args = (*args[:value_at], _joined(items, str(sep)), *params)
            if name == "replace" and len(params) >= 2:
                s, old, new = str(args[value_at]), str(params[0]), str(params[1])
                hits = s.count(old) if old else len(s) + 1
                _check_size(len(s) + hits * (len(new) - len(old)), "a replaced string")
            return _check_result(f(*args, **kwargs), f"the {name} filter's result")

        return run

    def raise_exception(message: str) -> None:
        raise _TemplateRaised(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                             extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.filters = {name: bounded_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["namespace"] = BoundedNamespace
    env.globals[_GUARD] = _Guard
    try:
        return env.from_string(_bounded_ast(env, source))
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise TokenizerError(f"chat template does not compile: {e}") from e
    except (RecursionError, SyntaxError, MemoryError):
        # jinja2's parser and compiler recurse per nesting level, and Python's
        # compiler refuses deeply nested generated code (found by fuzzing)
        raise TokenizerError("chat template nests too deeply to compile") from None
