"""The user-facing API: ``LLM``.

    llm = LLM()                                   # default model
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=32, temperature=0))
    print(out[0].text)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence as Seq

import numpy as np

from llamajet.engine.engine import Engine, StreamEvent
from llamajet.engine.runner import ModelRunner
from llamajet.engine.sampling import SamplingParams
from llamajet.errors import RequestError
from llamajet.loaders import load_model
from llamajet.models import default_model_path
from llamajet.tokenizer import load_tokenizer, tokenizer_from_gguf


@dataclass(frozen=True)
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"


DEFAULT_MAX_MODEL_LEN = 4096  # KV memory grows with it; models may allow more


class LLM:
    """A loaded model ready to generate.

    path: HF folder or .gguf file; None = the default model (SmolLM2-135M-Instruct).
    max_model_len: context served (prompt + output); default min(model's, 4096).
    n_threads: compute threads (default: physical cores). isa: force a kernel
    tier ("ref", "avx2", "avx512"); default: the best this CPU has.
    """

    def __init__(self, path: str | Path | None = None, *, max_model_len: int | None = None,
                 n_threads: int | None = None, isa: str | None = None,
                 max_tokens_per_step: int = 256) -> None:
        self.path = Path(path) if path is not None else default_model_path()
        self.model = load_model(self.path)
        self.config = self.model.config
        if self.model.gguf_reader is not None:
            self.tokenizer = tokenizer_from_gguf(self.model.gguf_reader)
        else:
            self.tokenizer = load_tokenizer(self.path)
        limit = self.config.max_position_embeddings
        if max_model_len is None:
            max_model_len = min(limit, DEFAULT_MAX_MODEL_LEN)
        if not 2 <= max_model_len <= limit:
            raise RequestError(f"max_model_len={max_model_len} must be in 2..{limit} for this model")
        runner = ModelRunner(self.model, max_model_len=max_model_len,
                             max_tokens=min(max_tokens_per_step, max_model_len),
                             n_threads=n_threads, isa=isa)
        self.engine = Engine(runner, self.tokenizer)

    # -- info

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def isa(self) -> str:
        return self.engine.runner.isa

    @property
    def n_threads(self) -> int:
        return self.engine.runner.n_threads

    # -- generation

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("empty prompt")
            return prompt, self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        return None, ids

    def generate(self, prompts: str | Seq[str] | Seq[Seq[int]],
                 params: SamplingParams | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt (a string, or a list of token ids)."""
        params = params or SamplingParams()
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        # Validate every prompt before running any, so a bad one loses nothing.
        encoded = [self._prompt_ids(p) for p in prompts]
        for _, ids in encoded:
            self.engine.check_prompt(ids)
        return [self._run(text, ids, params) for text, ids in encoded]

    def _run(self, prompt: str | None, ids: list[int], params: SamplingParams) -> RequestOutput:
        text, toks, reason = [], [], "length"
        for ev in self.engine.stream(ids, params):
            text.append(ev.text)
            if ev.token_id is not None:  # None: the closing event of a stop token
                toks.append(ev.token_id)
            if ev.finish_reason:
                reason = ev.finish_reason
        return RequestOutput(prompt, ids, "".join(text), toks, reason)

    def stream(self, prompt: str | Seq[int], params: SamplingParams | None = None) -> Iterator[StreamEvent]:
        """Yields StreamEvents (token id, new text) as tokens are generated."""
        _, ids = self._prompt_ids(prompt)
        return self.engine.stream(ids, params or SamplingParams())

    def chat(self, messages: list[dict], params: SamplingParams | None = None,
             add_generation_prompt: bool = True) -> RequestOutput:
        """Renders `messages` with the model's chat template and generates the reply."""
        ids = self.chat_ids(messages, add_generation_prompt)
        self.engine.check_prompt(ids)
        return self._run(None, ids, params or SamplingParams())

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        # The template writes BOS itself where the model wants one.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def logits(self, token_ids: Seq[int]) -> np.ndarray:
        """Logits for every position: float32 [len(token_ids), vocab]."""
        return self.engine.logits([int(t) for t in token_ids])
