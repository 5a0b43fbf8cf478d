"""The user-facing API: ``LLM``.

    llm = LLM()                                   # default model
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=32, temperature=0))
    print(out[0].text)
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Iterator, Sequence as Seq

import numpy as np

from llamajet.engine.async_engine import AsyncEngine
from llamajet.config import RuntimeConfig
from llamajet.engine.embedder import POOLINGS, Embedder, Embeddings
from llamajet.engine.engine import Engine, StreamEvent
from llamajet.engine.output import ChoiceOutput, RequestOutputs, token_piece
from llamajet.engine.outliers import plan_file as outlier_plan_file
from llamajet.engine.outliers import load_probe
from llamajet.engine.outliers import save_plan as save_outlier_plan
from llamajet.engine.outliers import saved_plan as saved_outlier_plan
from llamajet.engine.runner import ModelRunner
from llamajet.engine.sampling import SamplingParams
from llamajet.engine.sequence import Sequence
from llamajet.errors import RequestError
from llamajet.formats.saved import META_FILE
from llamajet.loaders import cache as weight_cache
from llamajet.loaders import load_model
from llamajet.loaders.gguf import release_file_pages, trim_heap
from llamajet.models import default_model_path
from llamajet.tokenizer import load_tokenizer, tokenizer_from_gguf
from llamajet.tokenizer.gguf_vocab import is_gguf


@dataclass(frozen=True)
class RequestMetrics:
    ttft_s: float          # arrival -> first token (queueing + prefill)
    total_s: float         # arrival -> finish
    cached_tokens: int     # prompt tokens served from the prefix cache
    preemptions: int       # times the request was preempted (and recomputed)


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability at one position (vLLM's Logprob)."""

    logprob: float
    rank: int | None     # 1 = the most likely token; None: the sampled token, outside the top-k asked for
    decoded_token: str   # the token's own text (a byte-level piece may be part of a character)


@dataclass(frozen=True)
class CompletionOutput:
    """One of a request's n completions (vLLM's CompletionOutput)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # the sum of the sampled tokens' logprobs; None unless logprobs were asked
    logprobs: list[dict[int, Logprob]] | None  # per token: the sampled one and the top-k; None unless asked
    finish_reason: str  # "stop" | "length" | "abort"


@dataclass(frozen=True)
class RequestOutput:
    """One prompt's result: its n completions in `outputs` (vLLM's shape).
    `text`, `token_ids` and `finish_reason` are the first completion's."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics | None = None
    # with SamplingParams(prompt_logprobs=k): None for the first token, then each prompt token's
    # logprob and the top-k at its position
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finished: bool = True

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason


#: chat roles a conversation may hold (OpenAI's, with tool results and developer instructions)
ROLES = ("system", "user", "assistant", "tool", "developer")


class LLM:
    """A loaded model ready to generate.

    path: an HF folder, a .gguf file or a folder saved by ``llamajet
    quantize``; None = the default model (SmolLM2-135M-Instruct).
    config / **options: how it runs — a RuntimeConfig, and/or its fields by
    name (config.py documents each with its default: max_model_len,
    n_threads, isa, kernels, quantize, kv_dtype, kv_cache_tokens,
    block_size, enable_prefix_caching, kv_prefault, fuse, max_num_seqs,
    max_tokens_per_step). Options are checked before the model is read.

        LLM("model.gguf", kv_dtype="int8", max_model_len=8192)
        LLM("hf_folder/", RuntimeConfig(quantize="int4_asym_g32"), n_threads=4)

    Embeddings (``embed``, ``embed_with_counts``) run a second compiled
    program over the same weights, built on the first call
    (engine/embedder.py).

    Threads and event loops (docs/limits.md): one LLM may be shared.
    - ``generate``, ``chat`` and ``logits`` are serialized by a lock inside
      the LLM: calls from two threads run one after the other, each exactly
      as it would alone (same ids, greedy or seeded), and the KV pool is
      whole in between. Serializing costs nothing in throughput: one step
      already uses every core, and batching requests from several threads
      would make a request's result depend on what ran beside it. To batch
      concurrent requests, pass them to one ``generate`` or use the async API.
    - ``stream`` is not serialized (holding a lock across a generator's
      yields would block every other call while its consumer dawdles):
      streams from several threads share the engine's steps, each step whole
      under the Engine's own lock (engine/engine.py).
    - ``astream`` / ``agenerate`` run on one event loop at a time (the
      AsyncEngine's): from a second loop while the first is in use they raise
      ConcurrencyError; one loop after another (``asyncio.run`` twice) works.
    - ``embed`` calls run one at a time among themselves (one arena); each of
      their steps takes the Engine's lock, so they interleave with generation
      steps from any thread, and their results never depend on what ran beside.
    """

    def __init__(self, path: str | Path | None = None, config: RuntimeConfig | None = None, **options) -> None:
        runtime = (config or RuntimeConfig()).with_options(**options)
        self.path = Path(path) if path is not None else default_model_path()
        self.model = None
        #: the repacked-weights cache entry this model was mapped from (weight_cache), else None
        self.cache_entry: Path | None = None
        if runtime.weight_cache and runtime.repack and runtime.load_scheme is None and self.path.is_file() \
                and is_gguf(self.path):
            self._use_weight_cache(Path(runtime.weight_cache).expanduser())
        if self.model is None:
            self.model = load_model(self.path)
        self.config = self.model.config
        if self.model.gguf_reader is not None:
            self.tokenizer = tokenizer_from_gguf(self.model.gguf_reader)
        else:
            self.tokenizer = load_tokenizer(self.path)
        self.runtime = runtime.for_model(self.config)
        # a weight_cache entry, and a model saved by `llamajet quantize`, keep the outlier channels
        # and columns of the first load that probed: later loads skip the probe (engine/outliers.py;
        # 3.6 s of an 8B's load). A cache entry writes its plan then; a saved folder gets its plan
        # from quantize_model (quant/quantize.write_outlier_plan: a load never writes into a model
        # folder). The plan's name counts the probe tokens run (at most one context).
        probe = load_probe(self.tokenizer, self.model, self.runtime)
        saved_folder = self.path.is_dir() and (self.path / META_FILE).is_file()
        plan_root = self.cache_entry if self.cache_entry is not None else self.path if saved_folder else None
        plan_path = plan = None
        if plan_root is not None and probe is not None:
            plan_path = outlier_plan_file(plan_root, self.runtime.act_outliers, len(probe))
            plan = saved_outlier_plan(plan_path)
        runner = ModelRunner(self.model, self.runtime, probe_ids=probe, outlier_plan=plan)
        #: the file this load's outlier plan came from (None: probed, or no outlier channels)
        self.outlier_plan_path = plan_path if plan is not None else None
        if plan_path is not None and plan is None and self.cache_entry is not None:
            try:
                save_outlier_plan(runner.graph, plan_path)
            except OSError as e:
                warnings.warn(f"cannot write {plan_path} ({e})", stacklevel=2)
        self.engine = Engine(runner, self.tokenizer)
        if self.model.gguf_reader is not None and self.runtime.repack:
            release_file_pages(self.model)  # repacked: the file's pages are no longer read
        else:
            trim_heap()
        self.async_engine = AsyncEngine(self.engine)
        self._lock = threading.Lock()  # serializes generate / chat / logits (see the class docstring)
        self._embedder: Embedder | None = None  # built by the first embed call
        self._embedder_lock = threading.Lock()  # builds it once

    def _use_weight_cache(self, root: Path) -> None:
        """Point this load at the cache entry of the GGUF (writing it on a
        miss); a file the cache does not take, or an entry that cannot be
        written (a read-only or full disk: a warning), loads from the GGUF."""
        hit = weight_cache.lookup(root, self.path)
        if hit is None:
            gguf = load_model(self.path)
            why = weight_cache.cacheable(gguf)
            if why is not None:
                self.model = gguf  # loaded already: used as is
                return
            try:
                hit = weight_cache.write_entry(gguf, tokenizer_from_gguf(gguf.gguf_reader),
                                               weight_cache.entry_path(root, self.path))
            except OSError as e:
                warnings.warn(f"weight_cache: cannot write under {root} ({e}); loading {self.path} without it",
                              stacklevel=3)
                self.model = gguf
                return
            del gguf
        self.cache_entry = hit
        self.path = hit

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

    def _prompt_ids(self, prompt, name: str = "prompt") -> tuple[str | None, list[int]]:
        """(text or None, token ids) of one prompt: a non-empty str, or a sequence of token ids;
        RequestError naming `name` for anything else."""
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError(f"{name}: empty prompt")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, np.ndarray):
            prompt = prompt.tolist() if prompt.ndim == 1 else None
        if not isinstance(prompt, (list, tuple)):
            raise RequestError(f"{name}: expected a str or a list of token ids, got {type(prompt).__name__}")
        return None, _token_ids(prompt, name)

    @staticmethod
    def _params(params, n: int, name: str = "params") -> list[SamplingParams]:
        """`params` for n prompts: None (defaults), one SamplingParams for all, or one each."""
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        if isinstance(params, (list, tuple)) and all(isinstance(p, SamplingParams) for p in params):
            if len(params) != n:
                raise RequestError(f"{name}: {len(params)} SamplingParams for {n} prompts")
            return list(params)
        hint = " (build one: SamplingParams(**d))" if isinstance(params, dict) else ""
        raise RequestError(f"{name}: expected a SamplingParams or a list of them, got "
                           f"{type(params).__name__}{hint}")

    def generate(self, prompts: str | Seq[str] | Seq[int] | Seq[Seq[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt (a string, or a list of token ids),
        in order, each with its n completions in `outputs`. All prompts run
        together: continuous batching, one step computes every running
        sequence. `params`: one for all, or one each."""
        if isinstance(prompts, np.ndarray):
            prompts = prompts.tolist()
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and len(prompts) and
                                        all(_is_int(t) for t in prompts)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise RequestError(f"prompts: expected a str, a list of str, a list of token ids or a list of "
                               f"token-id lists, got {type(prompts).__name__}")
        if not prompts:
            raise RequestError("prompts: empty list: give at least one prompt")
        params = self._params(params, len(prompts))
        # Validate every request before running any, so a bad one loses nothing.
        encoded = [self._prompt_ids(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        seqs = [self.engine.new_sequence(ids, p) for (_, ids), p in zip(encoded, params)]
        groups = [[s, *s.forks] for s in seqs]  # (the engine empties `forks` when it starts them)
        with self._lock:
            self.engine.run_all(seqs)
        return [self._output(text, g) for (text, _), g in zip(encoded, groups)]

    def stream(self, prompt: str | Seq[int], params: SamplingParams | None = None) -> Iterator[StreamEvent]:
        """Yields StreamEvents (token id, new text; `index` tells an n > 1
        request's completions apart) as tokens are generated."""
        _, ids = self._prompt_ids(prompt)
        return self.engine.stream(ids, self._params(params, 1)[0])

    async def astream(self, prompt: str | Seq[int],
                      params: SamplingParams | None = None) -> AsyncIterator[StreamEvent]:
        """Async twin of `stream`: `async for ev in llm.astream(...)`. Requests
        streamed concurrently from one event loop share the engine's steps."""
        _, ids = self._prompt_ids(prompt)
        p = self._params(params, 1)[0]
        async for ev in self.async_engine.stream(ids, p):
            yield ev

    async def agenerate(self, prompt: str | Seq[int], params: SamplingParams | None = None) -> RequestOutput:
        """One request, awaited; concurrent calls are batched together."""
        text, ids = self._prompt_ids(prompt)
        p = self._params(params, 1)[0]
        outs = RequestOutputs(p.n)
        async for ev in self.async_engine.stream(ids, p):
            outs.add(ev.index, ev)
        return RequestOutput(text, ids, [self._completion(c) for c in outs.choices])

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | Seq[SamplingParams] | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Renders each conversation with the model's chat template and
        generates its reply: one conversation (a list of {"role", "content"}
        dicts) or a list of them, run together; a list of RequestOutputs, in
        order, as `generate` returns."""
        if isinstance(messages, (list, tuple)) and messages and all(isinstance(c, (list, tuple)) for c in messages):
            convs, names = list(messages), [f"messages[{i}]" for i in range(len(messages))]
        else:
            convs, names = [messages], ["messages"]
        params = self._params(params, len(convs))
        for c, n in zip(convs, names):  # every conversation checked before any is rendered
            _check_conversation(c, n)
        _check_flag(add_generation_prompt)
        ids = [self._render(c, add_generation_prompt) for c in convs]
        return self.generate(ids, params)

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True, *,
                 name: str = "messages") -> list[int]:
        """The token ids of `messages` rendered by the model's chat template."""
        _check_conversation(messages, name)
        _check_flag(add_generation_prompt)
        return self._render(messages, add_generation_prompt)

    def _render(self, messages: list[dict], add_generation_prompt) -> list[int]:
        """chat_ids of a conversation its caller has checked."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=bool(add_generation_prompt))
        # The template writes BOS itself where the model wants one.
        return self.tokenizer.encode(text, add_special_tokens=False)

    # -- results (engine/output.py joins the events, as the server's routes do)

    def _logprobs(self, chosen: int | None, lp: float | None, top) -> dict[int, Logprob]:
        d = {i: Logprob(float(v), r + 1, self._piece(i)) for r, (i, v) in enumerate(top)}
        if chosen is not None and chosen not in d and lp is not None:
            d = {chosen: Logprob(float(lp), None, self._piece(chosen)), **d}
        return d

    def _piece(self, token_id: int) -> str:
        return token_piece(self.tokenizer, token_id)[0]  # the server's logprob token text, the same function

    def _completion(self, c: ChoiceOutput) -> CompletionOutput:
        asked = any(t.logprob is not None for t in c.tokens)
        lps = [self._logprobs(t.id, t.logprob, t.top) for t in c.tokens] if asked else None
        cum = float(sum(t.logprob for t in c.tokens)) if asked else None
        return CompletionOutput(c.index, c.text, c.token_ids, cum, lps, c.finish_reason or "length")

    def _output(self, prompt: str | None, group: list[Sequence]) -> RequestOutput:
        """A finished request's RequestOutput: each completion of its group
        (the head, then its forks) built from its events."""
        seq = group[0]
        group = sorted(group, key=lambda s: s.index)
        outs = RequestOutputs(len(group))
        for s in group:
            for ev in s.events:
                outs.add(ev.index, ev)
            s.events.clear()
            if outs.choices[s.index].finish_reason is None and s.finish_reason is not None:
                outs.choices[s.index].finish_reason = s.finish_reason
        end = seq.finish_time or seq.arrival_time
        metrics = RequestMetrics(ttft_s=(seq.first_token_time or end) - seq.arrival_time,
                                 total_s=end - seq.arrival_time, cached_tokens=seq.num_cached_tokens,
                                 preemptions=seq.num_preemptions)
        plp = None
        if seq.prompt_logprobs is not None:
            ids = seq.prompt_ids
            plp = [None] + [self._logprobs(ids[p], e[0], e[1]) for p, e in enumerate(seq.prompt_logprobs) if p > 0]
        return RequestOutput(prompt, seq.prompt_ids, [self._completion(c) for c in outs.choices], metrics, plp)

    def logits(self, token_ids: Seq[int]) -> np.ndarray:
        """Logits for every position: float32 [len(token_ids), vocab]."""
        if isinstance(token_ids, np.ndarray):
            token_ids = token_ids.tolist() if token_ids.ndim == 1 else None
        if not isinstance(token_ids, (list, tuple)):
            hint = " (tokenize it first: llm.tokenizer.encode(text))" if isinstance(token_ids, str) else ""
            raise RequestError(f"token_ids: expected a list of token ids, got {type(token_ids).__name__}{hint}")
        ids = _token_ids(token_ids, "token_ids")
        with self._lock:
            return self.engine.logits(ids)

    # -- embeddings

    def embed(self, inputs: str | Seq[str] | Seq[int] | Seq[Seq[int]], pooling: str = "mean",
              normalize: bool = True) -> np.ndarray:
        """Embeddings: float32 [n_texts, hidden], one row per text in order.

        A text's embedding is the model's final hidden states (after the final
        RMSNorm) pooled over its tokens: "mean" (default) or "last" (the last
        token's state); L2-normalized unless normalize=False. `inputs`: a str,
        a list of str, one token-id list, or a list of token-id lists. Text is
        tokenized as HF does for embedding models (special tokens added: BOS
        where the tokenizer adds one). A batch gives the same bits as its
        texts one by one. Bad input raises RequestError before anything runs."""
        return self.embed_with_counts(inputs, pooling, normalize).vectors

    def embed_with_counts(self, inputs: str | Seq[str] | Seq[int] | Seq[Seq[int]], pooling: str = "mean",
                          normalize: bool = True) -> Embeddings:
        """`embed` with each text's token count: Embeddings(vectors, token_counts),
        whose prompt_tokens (the sum) is a server's usage.prompt_tokens."""
        if pooling not in POOLINGS:  # before tokenizing: a typo costs nothing
            raise RequestError(f"pooling={pooling!r}: use one of {', '.join(POOLINGS)}")
        if not isinstance(normalize, (bool, np.bool_)):
            raise RequestError(f"normalize={normalize!r}: must be True or False")
        texts = self._embed_ids(inputs)
        return self._embedding_program().embed(texts, pooling, bool(normalize))

    def _embed_ids(self, inputs) -> list[list[int]]:
        """The token-id lists of embed's `inputs`; RequestError naming the
        input at fault for anything else (never a TypeError from inside)."""
        def token(t, i: int) -> int:
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                raise RequestError(f"input {i}: token ids must be integers, got {type(t).__name__}")
            return int(t)

        if isinstance(inputs, str):
            inputs = [inputs]
        elif isinstance(inputs, np.ndarray):
            inputs = inputs.tolist()
        if not isinstance(inputs, (list, tuple)):
            raise RequestError(f"embed inputs must be a str, a list of str, a list of token ids or a list "
                               f"of token-id lists, got {type(inputs).__name__}")
        if len(inputs) == 0:
            raise RequestError("no inputs: give at least one text")
        if all(isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_)) for t in inputs):
            inputs = [inputs]  # one text as token ids
        texts = []
        for i, x in enumerate(inputs):
            if isinstance(x, str):
                if not x:
                    raise RequestError(f"input {i} is an empty string")
                texts.append(self.tokenizer.encode(x))
            elif isinstance(x, (list, tuple, np.ndarray)):
                texts.append([token(t, i) for t in (x.tolist() if isinstance(x, np.ndarray) else x)])
            else:
                raise RequestError(f"input {i}: expected a str or a list of token ids, got {type(x).__name__}")
        return texts

    def _embedding_program(self) -> Embedder:
        """The embedding Program, built on first use (it shares the
        generation Program's weights; its arena and KV pool are its own)."""
        if self._embedder is None:
            with self._embedder_lock:
                if self._embedder is None:
                    self._embedder = Embedder(self.engine.runner, step_lock=self.engine.lock)
        return self._embedder


def _is_int(t) -> bool:
    return isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_))


def _token_ids(ids, name: str) -> list[int]:
    for j, t in enumerate(ids):
        if not _is_int(t):
            raise RequestError(f"{name}[{j}]: token ids must be integers, got {type(t).__name__}")
    return [int(t) for t in ids]


def _check_flag(add_generation_prompt) -> None:
    if not isinstance(add_generation_prompt, (bool, np.bool_)):
        raise RequestError(f"add_generation_prompt={add_generation_prompt!r}: must be True or False")


def _check_conversation(messages, name: str) -> None:
    """RequestError naming the message at fault: a conversation is a non-empty list of dicts,
    each with a known role and text content (or a list of content parts, or None beside tool calls)."""
    if not isinstance(messages, (list, tuple)):
        raise RequestError(f"{name}: expected a list of {{'role', 'content'}} dicts, got {type(messages).__name__}"
                           + (" (a str is one message: [{'role': 'user', 'content': ...}])"
                              if isinstance(messages, str) else ""))
    if not messages:
        raise RequestError(f"{name}: empty conversation")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"{name}[{i}]: expected a dict with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise RequestError(f"{name}[{i}]: role {role!r} is not one of {', '.join(ROLES)}")
        content = m.get("content")
        if not (content is None or isinstance(content, (str, list))):
            raise RequestError(f"{name}[{i}]: content must be a str, got {type(content).__name__}")
