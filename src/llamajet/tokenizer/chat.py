"""Chat templates: rendered with a sandboxed jinja2 set up like transformers'.

The templates come from strangers (tokenizer_config.json, GGUF metadata):
jinja2's ImmutableSandboxedEnvironment refuses attribute access to Python
internals and mutation of the inputs.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from llamajet.errors import TokenizerError


def render(source: str, messages: list[dict], **variables: Any) -> str:
    """The template `source` rendered for `messages` (None-valued keys dropped,
    as transformers does: OpenAI clients send content=None)."""
    template = compile_template(source)
    msgs = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
    try:
        return template.render(messages=msgs, **variables)
    except Exception as e:  # jinja2 TemplateError, or the template's raise_exception
        raise TokenizerError(f"chat template failed: {e}") from e


@lru_cache(maxsize=16)
def compile_template(source: str) -> Any:
    """Compile a chat template in a jinja2 sandbox configured like transformers'."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

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

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise TokenizerError(f"chat template does not compile: {e}") from e
