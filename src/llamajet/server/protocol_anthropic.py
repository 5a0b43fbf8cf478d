"""The Anthropic Messages request shapes the server accepts (pydantic), for
`/v1/messages` and `/v1/messages/count_tokens`.

As in protocol.py, every field is either honoured or refused with a 400 that
names it (`extra = "forbid"`); a field whose value asks for something the
served model cannot do (extended thinking, fast mode, server tools, images)
is refused by that value, with the reason. The SDK sends only the fields its
caller passes (captured: `{"max_tokens", "messages", "model"}`, plus
`"stream": true` from `messages.stream()`), so nothing here is refused by
default.

String shorthands (`content: "hi"`, `system: "..."`, a tool_result's
`content: "..."`) are read as one text block, so an error inside a block
names its place (`messages.0.content.1.input`), not a union branch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from llamajet.engine.sampling import SamplingParams
from llamajet.server.protocol import MAX_TOOLS, bounded_schema

BLOCK_TYPES = ("text", "tool_use", "tool_result")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheControl(_Strict):
    """Accepted on the request, its blocks and tools: prompt prefixes are
    cached automatically (usage.cache_read_input_tokens reports the hits)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: None = None  # a response's text block sent back carries citations: null


def _as_blocks(v: Any) -> Any:
    return [{"type": "text", "text": v}] if isinstance(v, str) else v


def _check_types(v: Any, allowed: tuple[str, ...], what: str) -> Any:
    if isinstance(v, list):
        for i, b in enumerate(v):
            t = b.get("type") if isinstance(b, dict) else None
            if isinstance(t, str) and t not in allowed:
                raise ValueError(f"block {i}: {what} blocks of type {t!r} are not supported by llamajet "
                                 f"(it takes {', '.join(allowed)})")
    return v


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: list[TextBlock] = Field(default_factory=list)
    is_error: bool = False
    cache_control: CacheControl | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v):
        return _check_types(_as_blocks(v), ("text",), "tool_result content")

    def text(self) -> str:
        return "\n".join(b.text for b in self.content)


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock], Field(discriminator="type")]


class Message(_Strict):
    role: Literal["user", "assistant", "system"]
    content: list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v):
        return _check_types(_as_blocks(v), BLOCK_TYPES, "message content")


class Tool(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None

    @field_validator("input_schema")
    @classmethod
    def _schema(cls, v):
        if v.get("type") != "object":
            raise ValueError('input_schema must be a JSON schema of "type": "object"')
        return bounded_schema(v, "input_schema")

    def openai(self) -> dict:
        """The OpenAI function tool dict the serving layer and templates take."""
        fn: dict = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


class ToolChoiceAuto(_Strict):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(_Strict):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(_Strict):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(_Strict):
    type: Literal["none"]


ToolChoice = Annotated[Union[ToolChoiceAuto, ToolChoiceAny, ToolChoiceTool, ToolChoiceNone],
                       Field(discriminator="type")]


class Thinking(_Strict):
    type: str
    budget_tokens: int | None = None
    display: str | None = None

    @field_validator("type")
    @classmethod
    def _off(cls, v):
        if v != "disabled":
            raise ValueError(f"thinking {v!r} is not supported: the served model writes no thinking blocks "
                             "(send {\"type\": \"disabled\"} or leave thinking out)")
        return v


class JsonOutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")

    @field_validator("schema_")
    @classmethod
    def _size(cls, v):
        return bounded_schema(v, "schema")


class OutputConfig(_Strict):
    format: JsonOutputFormat | None = None
    effort: str | None = None

    @field_validator("effort")
    @classmethod
    def _effort(cls, v):
        if v is not None:
            raise ValueError(f"effort {v!r} is not supported: the served model has no effort setting")
        return v


class Metadata(_Strict):
    user_id: str | None = None


class PromptRequest(_Strict):
    """What decides the prompt: shared by messages and count_tokens, so both
    count the same tokens."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: list[TextBlock] | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None
    speed: Literal["standard", "fast"] | None = None

    @field_validator("system", mode="before")
    @classmethod
    def _system(cls, v):
        return _check_types(_as_blocks(v), ("text",), "system")

    @field_validator("speed")
    @classmethod
    def _speed(cls, v):
        if v == "fast":
            raise ValueError("speed 'fast' is not supported: there is one speed here")
        return v

    @field_validator("tools", mode="before")
    @classmethod
    def _server_tools(cls, v):
        if isinstance(v, list):
            for i, t in enumerate(v):
                kind = t.get("type") if isinstance(t, dict) else None
                if kind not in (None, "custom"):
                    raise ValueError(f"tool {i}: server tools (type {kind!r}) are not supported by llamajet; "
                                     "only client tools (name, description, input_schema) are")
        return v


class MessagesRequest(PromptRequest):
    max_tokens: int = Field(ge=1)
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    # llamajet's (as on chat completions): false opts this request out of speculative decoding
    speculative: bool = True

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v):
        if v is None:
            return v
        if len(v) > SamplingParams.MAX_STOP:
            raise ValueError(f"at most {SamplingParams.MAX_STOP} stop sequences")
        if any(not s for s in v):
            raise ValueError("stop sequences must be non-empty")
        return v


class CountTokensRequest(PromptRequest):
    pass
