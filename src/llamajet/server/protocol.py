"""The OpenAI request shapes the server accepts (pydantic), and the limits on them.

Every field a client may send is declared here and either honoured or
refused with a 400 that names it: unknown fields are refused (`extra =
"forbid"`), never silently dropped, so a client that asks for something we do
not do learns it at once. Responses are plain dicts built in app.py (their
shape is checked by the official `openai` client in the tests).
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from llamajet.engine.sampling import SamplingParams

MAX_SCHEMA_BYTES = 64 * 1024  # a json_schema / tool parameters larger than this is refused


def bounded_schema(v, what: str = "schema"):
    """v, or a ValueError when its text is over MAX_SCHEMA_BYTES (every
    family's schemas: response formats and tool parameters)."""
    if v is not None and len(repr(v)) > MAX_SCHEMA_BYTES:
        raise ValueError(f"{what} is larger than {MAX_SCHEMA_BYTES} bytes")
    return v
MAX_TOOLS = 64
MAX_PROMPTS = 64              # prompts in one /v1/completions request


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content


class JsonSchemaSpec(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Strict):
    """Fields common to chat and completions."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)          # -1 or 0 = off (vLLM accepts -1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=SamplingParams.MAX_N)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    # llamajet's: false opts this request out of speculative decoding (serve --speculative), which
    # never changes the output, only its speed
    speculative: bool = True
    user: str | None = None
    response_format: ResponseFormat | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > SamplingParams.MAX_STOP:
            raise ValueError(f"at most {SamplingParams.MAX_STOP} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if v is None:
            return v
        if len(v) > 300:
            raise ValueError("at most 300 biased tokens")
        for k, b in v.items():
            if not k.lstrip("-").isdigit():
                raise ValueError(f"key {k!r} is not a token id")
            if not -100.0 <= b <= 100.0:
                raise ValueError(f"bias {b} for token {k} is outside [-100, 100]")
        return v

    @field_validator("response_format")
    @classmethod
    def _schema_size(cls, v):
        if v is not None and v.json_schema is not None and v.json_schema.schema_ is not None:
            bounded_schema(v.json_schema.schema_, "json_schema")
        if v is not None and v.type == "json_schema" and (v.json_schema is None or v.json_schema.schema_ is None):
            raise ValueError("type json_schema needs json_schema.schema")
        return v


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=SamplingParams.MAX_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None

    @field_validator("tools")
    @classmethod
    def _tool_size(cls, v):
        for t in v or []:
            bounded_schema(t.function.parameters, f"parameters of {t.function.name}")
        return v


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0: score the prompt only (with echo)
    logprobs: int | None = Field(default=None, ge=0, le=SamplingParams.MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


MAX_EMBED_INPUTS = 2048       # texts in one /v1/embeddings request (OpenAI's limit)


class EmbeddingRequest(_Strict):
    model: str | None = None
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    # llamajet's own (vLLM names them the same way in its pooling params)
    pooling: Literal["mean", "last"] = "mean"
    normalize: bool = True
