"""Tool calls: tools rendered into the prompt, the model's calls parsed back.

Two output formats, chosen by the chat template:
- "hermes" (ChatML / Qwen2.5 templates, which mention `<tool_call>`):
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
- "json" (Llama-3.1/3.2, and the default): a bare JSON object
  `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`).
A template that does not mention `tools` never shows them to the model, so
then the tools are described in a system message we add (in the json
format). `tool_choice` "required" or a named function is enforced by a
grammar over the call (server/grammar.py); "auto" parses whatever came out.
One call per turn (`parallel_tool_calls` true is accepted; at most one call
is generated under a grammar).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

_HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def call_format(template: str | None) -> str:
    return "hermes" if template and "<tool_call>" in template else "json"


def template_shows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def system_prompt(tools: list[dict]) -> str:
    """Describes the tools for a model whose template does not."""
    fns = [t["function"] for t in tools]
    return ("You can call functions. To call one, reply with only a JSON object of the form "
            '{"name": <function name>, "parameters": <arguments object>} and nothing else.\n'
            "Functions:\n" + "\n".join(json.dumps(f) for f in fns))


def closed(schema: Any) -> Any:
    """`schema` with additionalProperties false on every object that does not
    say (as OpenAI's strict mode): a call then holds the declared arguments
    only, which still validates against the caller's own schema."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _call_schema(fn: dict, fmt: str) -> dict:
    args = closed(fn.get("parameters") or {"type": "object"})
    key = "arguments" if fmt == "hermes" else "parameters"
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, key: args},
            "required": ["name", key], "additionalProperties": False}


def call_grammar(tools: list[dict], only: str | None, fmt: str, tokenizer=None) -> str:
    """The lark grammar of exactly one call to `only` (or any of `tools`).
    Where the vocabulary has `<tool_call>` / `</tool_call>` as added tokens
    (Qwen2.5), the grammar names those tokens (llguidance's `<[id]>`): the
    same text spelt in ordinary tokens is not what the model was trained on."""
    fns = [t["function"] for t in tools if only is None or t["function"]["name"] == only]
    schemas = [_call_schema(f, fmt) for f in fns]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    body = "%json " + json.dumps(schema)
    if fmt == "hermes":
        return f'start: {_marker("<tool_call>", tokenizer)} "\\n" call "\\n" {_marker("</tool_call>", tokenizer)}\ncall: {body}\n'
    return f"start: call\ncall: {body}\n"


def _marker(text: str, tokenizer) -> str:
    # An added token (Qwen2.5 marks these as not special, llguidance treats every added token as
    # one): named by id, else llguidance's mask and its token check disagree on the text spelling.
    i = tokenizer.token_to_id(text) if tokenizer is not None else None
    if i is not None and i in tokenizer.added_ids:
        return f"<[{i}]>"
    return json.dumps(text)


def parse_calls(text: str, names: set[str]) -> list[dict] | None:
    """The tool calls in `text` (OpenAI `tool_calls` entries), or None when
    it is not a call to one of `names`."""
    s = text.strip()
    if s.startswith("<|python_tag|>"):
        s = s[len("<|python_tag|>"):].strip()
    found = [m.group(1) for m in _HERMES.finditer(s)] or [s]
    calls = []
    for raw in found:
        try:
            obj = json.loads(raw)
        except ValueError:
            return None
        for o in obj if isinstance(obj, list) else [obj]:
            if not isinstance(o, dict) or o.get("name") not in names:
                return None
            args = o.get("arguments", o.get("parameters", {}))
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    return None
            calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                          "function": {"name": o["name"], "arguments": json.dumps(args)}})
    return calls or None


def history_message(m: Any) -> dict:
    """A request message as the chat template expects it (tool calls'
    arguments as objects, as HF templates render them)."""
    d: dict = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.name is not None:
        d["name"] = m.name
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = []
        for c in m.tool_calls:
            try:
                args = json.loads(c.function.arguments)
            except ValueError:
                args = c.function.arguments
            calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
        d["tool_calls"] = calls
    if d["content"] is None:
        d["content"] = ""
    return d
