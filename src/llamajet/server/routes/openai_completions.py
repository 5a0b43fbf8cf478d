"""OpenAI `/v1/completions`: string or token-id prompts, batches of them,
n, logprobs, structured output; streamed as one chunk per generated token."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from llamajet.server.deps import Admission, ReadyLLM, State, served
from llamajet.server.errors import ApiError
from llamajet.server.grammar import Grammars
from llamajet.server.protocol import MAX_PROMPTS, CompletionRequest
from llamajet.server.serving import Job, Run, new_id, openai_sampling, piece, sse

router = APIRouter()


def prompt_ids(llm, prompt) -> list[list[int]]:
    """The request's prompts as token ids (a string is encoded with BOS, as
    the model's tokenizer says; token ids are taken as they are)."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(x, int) for x in prompt):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    if not prompts:
        raise ApiError(400, "prompt is empty", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(400, f"at most {MAX_PROMPTS} prompts in one request", param="prompt")
    encoded = []
    for x in prompts:
        if isinstance(x, str):
            if not x:
                raise ApiError(400, "prompt is empty", param="prompt")
            encoded.append(llm.tokenizer.encode(x))
        else:
            bad = [t for t in x if not 0 <= t < llm.config.vocab_size]
            if bad or not x:
                raise ApiError(400, f"prompt: token id {bad[0]} is outside the vocabulary" if bad
                               else "prompt is empty", param="prompt")
            encoded.append(list(x))
    return encoded


def prompt_texts(llm, prompt, encoded: list[list[int]]) -> list[str]:
    """The text each prompt echoes: a string prompt as sent, token ids decoded."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(x, int) for x in prompt):
        prompt = [prompt]
    return [x if isinstance(x, str) else llm.tokenizer.decode(ids, skip_special_tokens=False)
            for x, ids in zip(prompt, encoded)]


def prompt_entries(llm, ids: list[int], scored: list | None) -> dict:
    """The prompt's part of a completion's logprobs: token texts, logprobs
    (the first null: nothing precedes it), the top alternatives with the
    prompt's own token among them (as vLLM does, so a client can tell
    whether each token was the model's first choice), text offsets."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    off = 0
    for p, t in enumerate(ids):
        text = piece(llm, t)[0]
        entry = scored[p] if scored is not None and p < len(scored) else None
        out["tokens"].append(text)
        out["text_offset"].append(off)
        off += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        lp, top = entry
        alts = {piece(llm, i)[0]: v for i, v in top}
        alts[text] = lp
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append(alts)
    return out


def logprob_entry(llm, tok) -> tuple[str, float | None, dict, int]:
    t, _ = piece(llm, tok.id)
    return t, tok.logprob, {piece(llm, i)[0]: lp for i, lp in tok.top}, tok.offset


@router.post("/v1/completions")
async def completions(request: Request, req: Annotated[CompletionRequest, Depends(served(CompletionRequest))],
                      llm: ReadyLLM, state: State, admit: Admission):
    t0 = time.perf_counter()
    for f in ("suffix", "best_of"):
        if getattr(req, f) not in (None, 1 if f == "best_of" else None):
            raise ApiError(400, f"{f} is not supported", param=f)
    encoded = prompt_ids(llm, req.prompt)
    max_tokens = req.max_tokens if req.max_tokens is not None else 16
    if max_tokens == 0 and not req.echo:
        raise ApiError(400, "max_tokens 0 scores the prompt only: it needs echo: true (and logprobs for the "
                       "scores)", param="max_tokens")
    # echo with logprobs (lm-eval's loglikelihood requests): every prompt token's logprob, from the
    # prompt's own prefill (engine: SamplingParams.prompt_logprobs); echo with max_tokens 0 scores only
    prompt_lp = None
    if req.echo and (req.logprobs is not None or max_tokens == 0):
        prompt_lp = req.logprobs or 0
    plist = [openai_sampling(req, len(ids), max_tokens, req.logprobs, llm, prompt_lp) for ids in encoded]
    grammar = None
    if req.response_format is not None and req.response_format.type != "text":
        rf = req.response_format
        grammar = Grammars.from_json_schema(rf.json_schema.schema_ if rf.type == "json_schema" else None)
    admit()
    jobs = []
    for ids, params in zip(encoded, plist):
        c = (await asyncio.to_thread(state.grammars.constraint, grammar)) if grammar else None
        jobs.append(Job(ids, params, c))
    run = Run(state, llm, request, jobs, t0)
    rid = new_id("cmpl-")
    if not await run.start():
        return Response(status_code=499)
    base = {"id": rid, "created": int(time.time()), "model": state.settings.model_name,
            "system_fingerprint": state.fingerprint}
    want_lp = req.logprobs is not None
    texts = prompt_texts(llm, req.prompt, encoded) if req.echo else None

    def echoed(index: int) -> tuple[str, dict | None]:
        """Choice `index`'s echoed prompt: its text and (with logprobs) its
        tokens' entries, the first token's logprob null, as vLLM answers."""
        k = index // run.n
        return texts[k], (prompt_entries(llm, encoded[k], run.prompt_logprobs(k)) if want_lp else None)

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        extra = {"usage": None} if include_usage else {}

        async def body():
            if req.echo:
                for i in range(len(run.outputs.choices)):
                    text, lp = echoed(i)
                    yield sse({**base, "object": "text_completion",
                               "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": None}],
                               **extra})
            shift = {i: len(echoed(i)[0]) if req.echo else 0 for i in range(len(run.outputs.choices))}
            async for out, tok, ev in run.events():
                lp = None
                if want_lp and tok is not None and tok.logprob is not None:
                    t, l, top, off = logprob_entry(llm, tok)
                    lp = {"tokens": [t], "token_logprobs": [l], "top_logprobs": [top],
                          "text_offset": [off + shift[out.index]]}
                if ev.text or lp is not None or ev.finish_reason is not None:
                    yield sse({**base, "object": "text_completion",
                               "choices": [{"index": out.index, "text": ev.text, "logprobs": lp,
                                            "finish_reason": ev.finish_reason}], **extra})
            if include_usage:
                yield sse({**base, "object": "text_completion", "choices": [], "usage": run.usage()})
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": rid})

    if not await run.drain():
        return Response(status_code=499)
    choices = []
    for out in run.outputs.choices:
        head, head_lp = echoed(out.index) if req.echo else ("", None)
        lps = None
        if want_lp:
            entries = [logprob_entry(llm, t) for t in out.tokens if t.logprob is not None]
            lps = {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
                   "top_logprobs": [e[2] for e in entries], "text_offset": [e[3] + len(head) for e in entries]}
            if head_lp is not None:
                lps = {k: head_lp[k] + lps[k] for k in lps}
        choices.append({"index": out.index, "text": head + out.text, "logprobs": lps,
                        "finish_reason": out.finish_reason or "abort"})
    return {**base, "object": "text_completion", "choices": choices, "usage": run.usage()}
