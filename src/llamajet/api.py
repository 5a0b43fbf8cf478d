"""The user-facing API: ``LLM``.

    llm = LLM()                                   # default model
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=32, temperature=0))
    print(out[0].text)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Iterator, Sequence as Seq

import numpy as np

from llamajet.engine.async_engine import AsyncEngine
from llamajet.engine.config import EngineConfig
from llamajet.engine.engine import Engine, StreamEvent
from llamajet.engine.runner import ModelRunner
from llamajet.engine.sampling import SamplingParams
from llamajet.engine.sequence import Sequence
from llamajet.errors import RequestError
from llamajet.loaders import load_model
from llamajet.loaders.gguf import release_file_pages
from llamajet.models import default_model_path
from llamajet.tokenizer import load_tokenizer, tokenizer_from_gguf


@dataclass(frozen=True)
class RequestMetrics:
    ttft_s: float          # arrival -> first token (queueing + prefill)
    total_s: float         # arrival -> finish
    cached_tokens: int     # prompt tokens served from the prefix cache
    preemptions: int       # times the request was preempted (and recomputed)


@dataclass(frozen=True)
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    metrics: RequestMetrics | None = None


DEFAULT_MAX_MODEL_LEN = 4096  # KV memory grows with it; models may allow more


class LLM:
    """A loaded model ready to generate.

    path: HF folder or .gguf file; None = the default model (SmolLM2-135M-Instruct).
    max_model_len: context served (prompt + output); default min(model's, 4096).
    n_threads: compute threads (default: physical cores). isa: force a kernel
    tier ("ref", "avx2", "avx512", "amx"); default: the best this CPU has.
    kernels: "fast" (GGUF Q4_0/Q4_1/Q8_0 repacked losslessly, int8 activations),
    "a16" (same weights, float activations) or "reference" (weights as loaded,
    dequantized in fp32). quantize: a scheme name (quant/schemes.py) to
    RTN-quantize float weights at load, e.g. "int4_asym_g32".
    Engine options (engine/config.py EngineConfig): max_num_seqs (sequences
    per step), max_tokens_per_step (token budget of a step), block_size (KV
    block, in tokens), kv_cache_tokens (KV pool size; default
    max(max_model_len, 8192)), kv_dtype ("f16" default — half the memory and
    the bandwidth of "f32" at a measured cost of KL 5e-7 nats on WikiText-2,
    llama.cpp's default too; "f32", "bf16", "int8"),
    enable_prefix_caching, kv_prefault (commit the pool's memory at start;
    default True). fuse: run the fusion passes (graph/passes: QKV +
    RoPE + KV write, gate/up + SwiGLU, residual epilogues, add + RMSNorm with
    int8 on write, final norm in the LM head); fused weights are stacked once
    at load.
    """

    def __init__(self, path: str | Path | None = None, *, max_model_len: int | None = None,
                 n_threads: int | None = None, isa: str | None = None,
                 max_tokens_per_step: int = 256, kernels: str = "fast",
                 quantize: str | None = None, max_num_seqs: int = 64, block_size: int = 16,
                 kv_cache_tokens: int | None = None, kv_dtype: str = "f16",
                 enable_prefix_caching: bool = True, kv_prefault: bool = True, fuse: bool = True) -> None:
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
        ec = EngineConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                          max_tokens_per_step=max_tokens_per_step, block_size=block_size,
                          kv_cache_tokens=kv_cache_tokens, kv_dtype=kv_dtype,
                          enable_prefix_caching=enable_prefix_caching, kv_prefault=kv_prefault)
        runner = ModelRunner(self.model, max_model_len=max_model_len, max_tokens=ec.step_tokens,
                             max_seqs=min(ec.max_num_seqs, ec.step_tokens), block_size=block_size,
                             num_blocks=ec.num_kv_blocks, n_threads=n_threads, isa=isa, kv_dtype=kv_dtype,
                             kernels=kernels, scheme=quantize, fuse=fuse, prefault_kv=kv_prefault)
        self.engine = Engine(runner, self.tokenizer, ec)
        if self.model.gguf_reader is not None and kernels != "reference":
            release_file_pages(self.model)  # repacked: the file's pages are no longer read
        self.async_engine = AsyncEngine(self.engine)

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
                 params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt (a string, or a list of token ids),
        in order. All prompts run together: continuous batching, one step
        computes every running sequence. `params`: one for all, or one each."""
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise RequestError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        # Validate every request before running any, so a bad one loses nothing.
        encoded = [self._prompt_ids(p) for p in prompts]
        seqs = [self.engine.new_sequence(ids, p) for (_, ids), p in zip(encoded, params)]
        self.engine.run_all(seqs)
        return [_output(text, seq) for (text, _), seq in zip(encoded, seqs)]

    def stream(self, prompt: str | Seq[int], params: SamplingParams | None = None) -> Iterator[StreamEvent]:
        """Yields StreamEvents (token id, new text) as tokens are generated."""
        _, ids = self._prompt_ids(prompt)
        return self.engine.stream(ids, params or SamplingParams())

    async def astream(self, prompt: str | Seq[int],
                      params: SamplingParams | None = None) -> AsyncIterator[StreamEvent]:
        """Async twin of `stream`: `async for ev in llm.astream(...)`. Requests
        streamed concurrently from one event loop share the engine's steps."""
        _, ids = self._prompt_ids(prompt)
        async for ev in self.async_engine.stream(ids, params or SamplingParams()):
            yield ev

    async def agenerate(self, prompt: str | Seq[int], params: SamplingParams | None = None) -> RequestOutput:
        """One request, awaited; concurrent calls are batched together."""
        text, ids = self._prompt_ids(prompt)
        parts, toks, reason = [], [], "length"
        async for ev in self.async_engine.stream(ids, params or SamplingParams()):
            parts.append(ev.text)
            if ev.token_id is not None:
                toks.append(ev.token_id)
            reason = ev.finish_reason or reason
        return RequestOutput(text, ids, "".join(parts), toks, reason)

    def chat(self, messages: list[dict], params: SamplingParams | None = None,
             add_generation_prompt: bool = True) -> RequestOutput:
        """Renders `messages` with the model's chat template and generates the reply."""
        ids = self.chat_ids(messages, add_generation_prompt)
        return self.generate([ids], params)[0]

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        # The template writes BOS itself where the model wants one.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def logits(self, token_ids: Seq[int]) -> np.ndarray:
        """Logits for every position: float32 [len(token_ids), vocab]."""
        return self.engine.logits([int(t) for t in token_ids])


def _output(prompt: str | None, seq: Sequence) -> RequestOutput:
    """A finished sequence's events, joined."""
    text, toks = [], []
    for ev in seq.events:
        text.append(ev.text)
        if ev.token_id is not None:  # None: the closing event of a stop token
            toks.append(ev.token_id)
    seq.events.clear()
    end = seq.finish_time or seq.arrival_time
    metrics = RequestMetrics(ttft_s=(seq.first_token_time or end) - seq.arrival_time,
                             total_s=end - seq.arrival_time, cached_tokens=seq.num_cached_tokens,
                             preemptions=seq.num_preemptions)
    return RequestOutput(prompt, seq.prompt_ids, "".join(text), toks, seq.finish_reason or "length", metrics)
