"""Calibration without data: text the model writes itself.

GPTQ, AWQ, SmoothQuant and QAT need inputs that look like what the model will
see. A user often has no such file, or has text of another domain (issue 45:
TinyShakespeare for a model evaluated on Wikipedia). Text sampled from the
model is drawn from the distribution the model itself puts on text, so its
activations cover what the model "knows" rather than one domain (LLM-QAT,
Liu et al. 2023, calibrate and distill on self-generated data for the same
reason).

How: n sequences, each started from one of PROMPTS (short starts of many
kinds: prose, news, science, code, dialogue, lists, several languages; every
third one a chat turn through the model's chat template when it has one, so
the template's tokens and the assistant's register are calibrated too),
sampled at temperature 0.8 / top-p 0.95 with seed `seed * 1_000_003 + i` for
sequence i, up to `length` tokens each. The sequences (prompt included, an
end-of-text token between them) are concatenated and cut into windows of
`length` tokens, BOS first where the model wants one, exactly as
calibration_windows cuts a file; rounds of further seeds run until n windows
are full. Sampling on the engine is bit-reproducible for a seed (batch- and
thread-invariant rows), so the same (model, n, length, seed) gives the same
windows, and the same quantized folder, on every run of a tier.

Generation runs on the source model as LLM(src) loads it (its default
kernels): a few tenths of the calibration's time for GPTQ (measured in
benchmarks/quant_defaults.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from llamajet.errors import LlamajetError

# Varied on purpose: domains, registers, formats and languages, so the activation statistics are
# not one genre's. Short: most of each window is the model's own continuation.
PROMPTS = (
    "The history of the city begins",
    "In mathematics, a group is",
    "def parse_args(argv):\n",
    "Breaking news:",
    "Once upon a time, in a small village,",
    "The recipe calls for",
    "Photosynthesis is the process by which",
    "Dear hiring manager,\n\n",
    "Q: What causes the seasons on Earth?\nA:",
    "import numpy as np\n\n",
    "The court ruled that",
    "Chapter 1\n\n",
    "La révolution française",
    "Here are five tips for",
    "SELECT name, count(*) FROM",
    "The patient presented with",
    "In 1854, the",
    "Abstract. We study",
    "Der Vertrag wurde",
    "The game ended with",
    "<html>\n<head>\n",
    "The following table shows",
    "El clima de la región",
    "Installation\n============\n\n",
    "My favourite book is",
    "The theorem states that for every",
    "User reviews:\n1.",
    "The company reported quarterly",
    "function render(props) {\n",
    "Il était une fois",
)

CHAT_PROMPTS = (
    "Explain how a refrigerator works.",
    "Write a short poem about the sea.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the causes of the First World War.",
    "Give me a recipe for pancakes.",
    "How do I fix a flat bicycle tire?",
    "Translate 'good morning, how are you?' into Spanish and French.",
    "Why is the sky blue?",
    "Write a SQL query that counts orders per customer.",
    "What are the health benefits of walking every day?",
)

TEMPERATURE, TOP_P = 0.8, 0.95


def _prompt_ids(tok, i: int) -> list[int]:
    """Sequence i's prompt as token ids (BOS first where the model wants one; a chat turn's
    template writes its own)."""
    if i % 3 == 2 and tok.chat_template:
        msg = CHAT_PROMPTS[(i // 3) % len(CHAT_PROMPTS)]
        text = tok.apply_chat_template([{"role": "user", "content": msg}], add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)
    return ([tok.bos_id] if tok.add_bos else []) + tok.encode(PROMPTS[i % len(PROMPTS)], add_special_tokens=False)


def self_generated_windows(src: str | Path, tok, n: int, length: int, seed: int = 0,
                           progress: Callable[..., None] | None = None, llm=None,
                           max_context: int | None = None) -> list[list[int]]:
    """`n` windows of `length` token ids written by the model at `src` (module docstring).
    `llm`: the model already loaded (an LLM), else LLM(src) is loaded here and dropped after;
    max_context: the model's context limit when the caller knows it (else read from src's config)."""
    from llamajet import LLM, SamplingParams

    if n < 1 or length < 16:
        raise LlamajetError("calibration needs at least 1 window of at least 16 tokens")
    if llm is None:
        limit = max_context
        if limit is None:
            from llamajet.loaders import load_model

            limit = load_model(src).config.max_position_embeddings  # (mapped: reads headers, no weight bytes)
        # up to 64 sequences a step (decode reads the weights once for all of them), in a KV pool
        # of at most 1 GiB (the engine refuses one that cannot hold a context)
        llm = LLM(src, max_model_len=min(limit, length + 128), enable_prefix_caching=False,
                  max_num_seqs=64, kv_cache_memory="1GiB")
    ctx = llm.max_model_len
    bos = [tok.bos_id] if tok.add_bos else []
    body = length - len(bos)
    sep = tok.eos_id
    stream: list[int] = []
    made = 0  # sequences generated so far: sequence i always has prompt i and seed i
    while len(stream) // body < n:
        missing = n - len(stream) // body
        # each sequence gives at most `length` tokens; a few more than needed cover early stops
        count = missing + max(1, missing // 8)
        prompts = [_prompt_ids(tok, made + j)[: ctx // 2] for j in range(count)]
        params = [SamplingParams(max_tokens=min(length, ctx - len(p)), temperature=TEMPERATURE, top_p=TOP_P,
                                 seed=seed * 1_000_003 + made + j) for j, p in enumerate(prompts)]
        for ids, out in zip(prompts, llm.generate(prompts, params)):
            if bos and ids[:1] == bos:
                ids = ids[1:]  # BOS goes at the start of each window, not inside the stream
            stream += ids + list(out.token_ids)
            if sep is not None and stream[-1] != sep:
                stream.append(sep)
        made += count
        if progress is not None:
            progress(min(n, len(stream) // body), n, "calibration window")
    return [bos + stream[i * body:(i + 1) * body] for i in range(n)]


__all__ = ["self_generated_windows", "PROMPTS", "CHAT_PROMPTS"]
