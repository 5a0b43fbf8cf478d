"""The OpenAI Responses request shape (`POST /v1/responses`) the server
accepts (pydantic), in the same rule as server/protocol.py: every field a
client may send is declared here and either honoured or refused with a 400
that names it; unknown fields are refused (`extra = "forbid"`).

The fields the official clients send by default are all accepted (their
bodies are kept in tests/data/responses_requests/): `openai`'s
`client.responses.create` sends `model`, `input` (and `stream`);
openai-agents 0.24.0's OpenAIResponsesModel adds `instructions`, `include`
(`[]`), `tools` (`[]` when none) and `tool_choice`, and any ModelSettings
the caller sets (`temperature`, `top_p`, `max_output_tokens`,
`parallel_tool_calls`, `truncation`, `store`, `metadata`, `reasoning`,
`text`, `top_logprobs` with `include: ["message.output_text.logprobs"]`,
...); it leaves out every None-valued setting.

A field whose default we do (or whose value has nothing to do here, e.g.
`max_tool_calls`: there are no built-in tools) is accepted; a value that
asks for something llamajet does not do (`background: true`,
`reasoning.effort: "high"`, `truncation: "auto"`, a hosted tool, an input
image...) is refused by name.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from llamajet.engine.sampling import SamplingParams
from llamajet.server.protocol import MAX_TOOLS, bounded_schema

MAX_INPUT_ITEMS = 4096
MAX_METADATA_KEYS = 16

# `include` values: the one we produce, and the one that is empty here (no reasoning items are made)
INCLUDABLE = ("message.output_text.logprobs", "reasoning.encrypted_content")


def refuse(what: str, why: str = "") -> PydanticCustomError:
    """A refusal as a validation error (a 400 naming the field where it is raised)."""
    return PydanticCustomError("unsupported_value", "{what} is not supported by llamajet{why} "
                               "(it is refused, not ignored)", {"what": what, "why": f": {why}" if why else ""})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


# ---------------------------------------------------------------- input items


class InputText(_Strict):
    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: dict[str, Any] | None = None  # a cache hint: the prefix cache takes every prefix


class OutputText(_Strict):
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None


class Refusal(_Strict):
    type: Literal["refusal"]
    refusal: str


ContentPart = Union[InputText, OutputText, Refusal]
_PART_TYPES = ("input_text", "output_text", "refusal")


def _check_parts(v: Any, where: str) -> Any:
    if isinstance(v, list):
        for i, p in enumerate(v):
            t = p.get("type") if isinstance(p, dict) else None
            if t not in _PART_TYPES and isinstance(t, str):
                raise refuse(f"{where} part type {t!r}", "text parts only (input_text, output_text, refusal)")
    return v


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[ContentPart]]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, v):
        return _check_parts(v, "content")

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.refusal if isinstance(p, Refusal) else p.text for p in self.content)


class _NoCaller(_Strict):
    type: Literal["direct"]


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    caller: _NoCaller | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[InputText]]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    caller: _NoCaller | None = None
    name: str | None = None

    @field_validator("output", mode="before")
    @classmethod
    def _parts(cls, v):
        if isinstance(v, list):
            for p in v:
                t = p.get("type") if isinstance(p, dict) else None
                if t != "input_text" and isinstance(t, str):
                    raise refuse(f"function_call_output part type {t!r}", "text output only (input_text)")
        return v

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


InputItem = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem]
_ITEMS = {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem}


# ---------------------------------------------------------------- tools


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    output_schema: dict[str, Any] | None = None   # describes the function's result: nothing to generate
    defer_loading: bool | None = None
    allowed_callers: list[Literal["direct", "programmatic"]] | None = None

    @field_validator("parameters")
    @classmethod
    def _size(cls, v):
        return bounded_schema(v, "parameters")

    @field_validator("defer_loading")
    @classmethod
    def _defer(cls, v):
        if v:
            raise refuse("defer_loading: true", "no tool search; every tool is in the prompt")
        return v

    @field_validator("allowed_callers")
    @classmethod
    def _callers(cls, v):
        if v is not None and "direct" not in v:
            raise refuse("allowed_callers without 'direct'", "the model calls functions directly")
        return v

    def chat_tool(self) -> dict:
        """As a chat-completions tool dict (what plan_chat and the grammar take)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters if self.parameters is not None else {"type": "object", "properties": {}}
        if self.strict is not None:
            fn["strict"] = self.strict
        return {"type": "function", "function": fn}


class ToolChoiceFunction(_Strict):
    type: Literal["function"]
    name: str


class AllowedTool(_Strict):
    type: Literal["function"]
    name: str


class ToolChoiceAllowed(_Strict):
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[AllowedTool] = Field(min_length=1)


# ---------------------------------------------------------------- text format and other options


class FormatText(_Strict):
    type: Literal["text"]


class FormatJsonObject(_Strict):
    type: Literal["json_object"]


class FormatJsonSchema(_Strict):
    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _size(cls, v):
        return bounded_schema(v, "schema")


class TextConfig(_Strict):
    format: Union[FormatText, FormatJsonObject, FormatJsonSchema, None] = Field(default=None, discriminator="type")
    verbosity: Literal["low", "medium", "high"] | None = None

    @field_validator("verbosity")
    @classmethod
    def _verbosity(cls, v):
        if v not in (None, "medium"):
            raise refuse(f"verbosity {v!r}", "only the default, 'medium'")
        return v


class Reasoning(_Strict):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None
    context: Literal["auto", "current_turn", "all_turns"] | None = None  # which reasoning is replayed: none here
    mode: str | None = None

    @field_validator("effort")
    @classmethod
    def _effort(cls, v):
        if v not in (None, "none"):
            raise refuse(f"reasoning effort {v!r}", "the model does not reason; only null or 'none'")
        return v

    @field_validator("summary", "generate_summary")
    @classmethod
    def _summary(cls, v):
        if v is not None:
            raise refuse(f"a reasoning summary ({v!r})", "the model does not reason")
        return v

    @field_validator("mode")
    @classmethod
    def _mode(cls, v):
        if v not in (None, "standard"):
            raise refuse(f"reasoning mode {v!r}", "only 'standard'")
        return v


class StreamOptions(_Strict):
    include_obfuscation: bool | None = None


# ---------------------------------------------------------------- the request


class ResponseRequest(_Strict):
    model: str
    input: Union[str, list[Any]]                 # list: InputItem instances (parsed by _items)
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None                      # None: true (as OpenAI)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # llamajet's (as on chat completions): false opts this request out of speculative decoding
    speculative: bool = True
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None            # a hint; the prefix cache is automatic
    prompt_cache_retention: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_output_tokens: int | None = Field(default=None, ge=1)
    max_tool_calls: int | None = Field(default=None, ge=0)   # built-in tools only: there are none
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Union[Literal["none", "auto", "required"], ToolChoiceFunction, ToolChoiceAllowed, None] = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=SamplingParams.MAX_LOGPROBS)
    truncation: str | None = None
    reasoning: Reasoning | None = None
    service_tier: str | None = None
    background: bool | None = None
    # asked-for features llamajet does not have: accepted only when null (or empty)
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    prompt_cache_options: Any = None
    moderation: Any = None
    access_programs: Any = None
    background_options: Any = None
    image: Any = None

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, v):
        """Each item parsed as its own type, its errors named `input[i].field`."""
        if not isinstance(v, list):
            return v
        if len(v) > MAX_INPUT_ITEMS:
            raise ValueError(f"at most {MAX_INPUT_ITEMS} input items")
        out = []
        for i, item in enumerate(v):
            if not isinstance(item, dict):
                raise PydanticCustomError("invalid_item", "input[{i}] must be an object", {"i": i})
            kind = item.get("type", "message" if "role" in item else None)
            if kind not in _ITEMS:
                raise refuse(f"input[{i}] item type {kind!r}",
                             "input items are messages, function_call and function_call_output")
            try:
                out.append(_ITEMS[kind].model_validate(item))
            except ValidationError as e:
                err = e.errors()[0]
                where = f"input[{i}]" + "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in err["loc"])
                if err["type"] == "extra_forbidden":
                    raise PydanticCustomError("extra_item_field", "unsupported field {where}: llamajet does not "
                                              "implement it (it is refused, not ignored)", {"where": where})
                raise PydanticCustomError("invalid_item", "{where}: {msg}", {"where": where, "msg": err["msg"]})
        return out

    @field_validator("tools", mode="before")
    @classmethod
    def _tool_types(cls, v):
        for i, t in enumerate(v or []):
            kind = t.get("type") if isinstance(t, dict) else None
            if kind != "function":
                raise refuse(f"tools[{i}] of type {kind!r}", "function tools only")
        return v

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice_type(cls, v):
        if isinstance(v, dict) and v.get("type") not in ("function", "allowed_tools"):
            raise refuse(f"tool_choice of type {v.get('type')!r}", "function tools only")
        return v

    @field_validator("include")
    @classmethod
    def _include(cls, v):
        for x in v or []:
            if x not in INCLUDABLE:
                raise refuse(f"include value {x!r}", f"only {', '.join(INCLUDABLE)}")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v):
        if v is not None:
            if len(v) > MAX_METADATA_KEYS:
                raise ValueError(f"at most {MAX_METADATA_KEYS} metadata keys")
            for k, x in v.items():
                if len(k) > 64 or len(x) > 512:
                    raise ValueError("metadata keys are at most 64 characters, values at most 512")
        return v

    @field_validator("truncation")
    @classmethod
    def _truncation(cls, v):
        if v not in (None, "disabled"):
            raise refuse(f"truncation {v!r}", "only 'disabled' (a prompt over the context is a 400)")
        return v

    @field_validator("service_tier")
    @classmethod
    def _tier(cls, v):
        if v not in (None, "auto", "default"):
            raise refuse(f"service_tier {v!r}", "only 'auto' or 'default'")
        return v

    @field_validator("prompt_cache_retention")
    @classmethod
    def _retention(cls, v):
        if v not in (None, "in_memory"):
            raise refuse(f"prompt_cache_retention {v!r}", "the prefix cache is in memory only")
        return v

    @field_validator("background")
    @classmethod
    def _background(cls, v):
        if v:
            raise refuse("background: true", "responses are generated while the request waits")
        return v

    @field_validator("conversation", "prompt", "context_management", "prompt_cache_options", "moderation",
                     "access_programs", "background_options", "image")
    @classmethod
    def _absent(cls, v, info):
        if v is not None and v != [] and v != {}:
            raise refuse(info.field_name, {"conversation": "use previous_response_id",
                                           "prompt": "no stored prompt templates"}.get(info.field_name, ""))
        return v

    @property
    def stored(self) -> bool:
        return self.store is not False

    @property
    def logprobs(self) -> int | None:
        """The engine's logprobs setting: the top_logprobs count when the output's logprobs are included."""
        if "message.output_text.logprobs" in (self.include or []):
            return self.top_logprobs or 0
        return None
