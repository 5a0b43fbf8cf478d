"""Health, readiness, metrics, the model list, and vLLM's /tokenize and
/detokenize."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from llamajet.errors import LlamajetError
from llamajet.server import tools as toolmod
from llamajet.server.deps import ReadyLLM, State, served
from llamajet.server.errors import ApiError
from llamajet.server.protocol import DetokenizeRequest, TokenizeRequest

router = APIRouter()


@router.get("/health")
async def health():
    return PlainTextResponse("ok")


@router.get("/ready")
async def ready(state: State):
    if state.ready:
        return PlainTextResponse("ready")
    why = ("draining" if state.draining else f"load failed: {state.load_error}" if state.load_error
           else "loading")
    return PlainTextResponse(why, status_code=503)


@router.get("/metrics")
async def metrics(state: State):
    running, waiting = state.counts()
    state.metrics.refresh(state.llm.engine if state.llm else None, running, waiting)
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(llm: ReadyLLM, state: State):
    return {"object": "list", "data": [{"id": state.settings.model_name, "object": "model", "created": 0,
                                        "owned_by": "llamajet", "max_model_len": llm.max_model_len}]}


@router.get("/tokenizer_info")
async def tokenizer_info(llm: ReadyLLM):
    """vLLM's tokenizer description, which lm-evaluation-harness's remote
    tokenizer reads (it then tokenizes through /tokenize and /detokenize,
    so its ids are the server's own)."""
    tok = llm.tokenizer

    def name(i):
        t = tok.backend.id_to_token(i) if i is not None else None
        return t if t is not None and tok.backend.token_to_id(t) == i else None

    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name(tok.bos_id),
            "eos_token": name(tok.eos_id), "pad_token": None, "add_bos_token": tok.add_bos,
            "chat_template": tok.chat_template, "model_max_length": llm.max_model_len,
            "vocab_size": tok.vocab_size}


@router.post("/tokenize")
async def tokenize(req: Annotated[TokenizeRequest, Depends(served(TokenizeRequest))], llm: ReadyLLM):
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "give exactly one of prompt or messages", param="prompt")
    if req.messages is not None:
        ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
            [toolmod.history_message(m) for m in req.messages],
            add_generation_prompt=req.add_generation_prompt), add_special_tokens=False)
    else:
        ids = llm.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return {"tokens": ids, "count": len(ids), "max_model_len": llm.max_model_len}


@router.post("/detokenize")
async def detokenize(req: Annotated[DetokenizeRequest, Depends(served(DetokenizeRequest))], llm: ReadyLLM):
    try:
        return {"prompt": llm.tokenizer.decode(req.tokens, skip_special_tokens=False)}
    except LlamajetError as e:
        raise ApiError(400, str(e), param="tokens")
