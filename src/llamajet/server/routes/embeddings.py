"""OpenAI `/v1/embeddings`: pooled final hidden states after the final norm
(LLM.embed: a separate program beside generation's, sharing its weights),
mean-pooled and L2-normalized by default; float or base64 encodings;
batches (a batch equals its texts one by one, bit for bit)."""

from __future__ import annotations

import asyncio
import base64
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Depends, Request

from llamajet.errors import RequestError
from llamajet.server.deps import Admission, ReadyLLM, State, served
from llamajet.server.errors import ApiError
from llamajet.server.protocol import MAX_EMBED_INPUTS, EmbeddingRequest

router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(request: Request, req: Annotated[EmbeddingRequest, Depends(served(EmbeddingRequest))], llm: ReadyLLM,
                     state: State, admit: Admission):
    inputs = req.input
    texts = isinstance(inputs, list) and not all(isinstance(x, int) for x in inputs)  # not one token-id list
    if texts and len(inputs) > MAX_EMBED_INPUTS:
        raise ApiError(400, f"at most {MAX_EMBED_INPUTS} inputs in one request", param="input")
    hidden = llm.config.hidden_size
    if req.dimensions is not None and req.dimensions != hidden:
        # a model not trained for shortened (Matryoshka) vectors: truncating would be silently worse
        raise ApiError(400, f"dimensions {req.dimensions}: this model's embeddings have {hidden} dimensions "
                       "and cannot be shortened", param="dimensions")
    admit()
    with state.in_flight():  # a drain waits for it as for a generation
        try:
            out = await asyncio.to_thread(llm.embed_with_counts, inputs, req.pooling, req.normalize)
        except RequestError as e:
            raise ApiError(400, str(e), param="input")
    state.metrics.prompt_tokens.labels(state.settings.model_name).inc(out.prompt_tokens)
    request.state.llamajet_access = {"prompt_tokens": out.prompt_tokens, "completion_tokens": 0}
    data = []
    for i, v in enumerate(out.vectors):
        if req.encoding_format == "base64":  # little-endian float32, as OpenAI's client decodes it
            emb = base64.b64encode(np.ascontiguousarray(v, dtype="<f4").tobytes()).decode("ascii")
        else:
            emb = v.tolist()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    return {"object": "list", "data": data, "model": state.settings.model_name,
            "usage": {"prompt_tokens": out.prompt_tokens, "total_tokens": out.prompt_tokens}}
