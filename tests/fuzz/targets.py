"""Fuzz targets: one per parser that takes bytes from strangers.

Each target takes one input (bytes) and feeds it to the real code path a
user's file or request goes through. The contract it checks is the project's:
bad input gets a clear error and loses nothing. So a target returns normally
when the parser accepts the input or refuses it with one of llamajet's own
errors (``LlamajetError``: ``ModelFormatError``, ``TokenizerError``, ...), or,
for the server, an OpenAI-shaped error JSON with a 4xx status. Anything else
(an IndexError from deep in a parser, a 500, a crash or sanitizer report in
C++, an input that runs past the time limit) is a finding.

Used three ways: by tests/fuzz/fuzz.py under atheris (coverage-guided, ASan
build of the extension; tools/fuzz.py runs it), by tests/test_fuzz_corpus.py
over every seed and regression input in tests/fuzz/corpus/<target>/ in the
normal test suite, and by tests/fuzz/make_seeds.py, which writes the seeds.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from llamajet.errors import LlamajetError

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus"
FIXTURES = HERE / "fixtures"   # fixed files the targets put beside the fuzzed one (make_seeds.py writes them)

# Where the targets write their files: tmpfs when there is one (an input per
# run is written and read back; the disk would be the bottleneck).
_BASE = Path("/dev/shm") if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
_WORK = Path(tempfile.mkdtemp(prefix="llamajet-fuzz-", dir=_BASE))


def _fresh(name: str) -> Path:
    d = _WORK / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    return d


def _split(data: bytes, parts: int) -> list[bytes]:
    """`data` cut at its first `parts - 1` NUL bytes (missing parts are empty)."""
    out = data.split(b"\0", parts - 1)
    return out + [b""] * (parts - len(out))


def _text(b: bytes) -> str:
    return b.decode("utf-8", "replace")


def _exercise_tokenizer(tok, text: str) -> None:
    """Encode `text`, decode it back, and decode ids taken from the text's bytes."""
    ids = tok.encode(text)
    tok.decode(ids)
    tok.decode(ids, skip_special_tokens=False)
    raw = [b % (tok.vocab_size + 8) for b in text.encode("utf-8", "replace")[:64]]
    try:  # ids past the vocabulary must be refused with a clear error
        tok.decode(raw)
    except LlamajetError:
        pass
    for i in raw[:16]:
        if i < tok.vocab_size:
            tok.token_bytes(i)


# ---------------------------------------------------------------- model files

def gguf_file(data: bytes) -> None:
    """A whole GGUF file: header, metadata, tensor table, config, weights, vocabulary."""
    from llamajet.loaders import load_model
    from llamajet.tokenizer import load_tokenizer

    d = _fresh("gguf")
    path = d / "model.gguf"
    path.write_bytes(data)
    try:
        model = load_model(path)
    except LlamajetError:
        model = None
    if model is not None:
        del model
    try:
        tok = load_tokenizer(path)
    except LlamajetError:
        return
    _exercise_tokenizer(tok, "Hello world, once upon a time")


def gguf_vocab(data: bytes) -> None:
    """A vocabulary-only GGUF (tokenizer.ggml.*): tokenizer construction, then
    encode and decode of a fixed text with specials, accents and an emoji."""
    from llamajet.tokenizer import load_tokenizer

    d = _fresh("gguf_vocab")
    path = d / "vocab.gguf"
    path.write_bytes(data)
    try:
        tok = load_tokenizer(path)
    except LlamajetError:
        return
    _exercise_tokenizer(tok, "Once upon a time, <s> there was \u00e9t\u00e9 \U0001f600 12345!")


def safetensors_file(data: bytes) -> None:
    """model.safetensors (header and data) beside a valid config.json and tokenizer."""
    from llamajet.loaders import load_model

    d = _fresh("safetensors")
    for f in ("config.json", "tokenizer.json"):
        shutil.copy(FIXTURES / "hf" / f, d / f)
    (d / "model.safetensors").write_bytes(data)
    try:
        load_model(d)
    except LlamajetError:
        pass


def safetensors_index(data: bytes) -> None:
    """model.safetensors.index.json beside a valid shard (and a file outside the folder)."""
    from llamajet.loaders import load_model

    root = _fresh("st_index")
    (root / "outside.safetensors").write_bytes((FIXTURES / "hf" / "model.safetensors").read_bytes())
    d = root / "model"
    d.mkdir()
    for f in ("config.json", "tokenizer.json"):
        shutil.copy(FIXTURES / "hf" / f, d / f)
    shutil.copy(FIXTURES / "hf" / "model.safetensors", d / "model-00001-of-00001.safetensors")
    (d / "model.safetensors.index.json").write_bytes(data)
    try:
        load_model(d)
    except LlamajetError:
        pass


def saved_folder(data: bytes) -> None:
    """A folder written by `llamajet quantize`: byte 0 chooses which file the
    rest replaces (even: llamajet.json, odd: the weights file)."""
    from llamajet.loaders import load_model

    d = _fresh("saved")
    src = FIXTURES / "saved"
    for f in src.iterdir():
        shutil.copy(f, d / f.name)
    if data:
        target = "llamajet.json" if data[0] % 2 == 0 else "model.safetensors"
        (d / target).write_bytes(data[1:])
    try:
        load_model(d)
    except LlamajetError:
        pass


# ---------------------------------------------------------------- text formats

def tokenizer_json(data: bytes) -> None:
    """tokenizer.json (and tokenizer_config.json) text, NUL, text to encode."""
    from llamajet.tokenizer import load_tokenizer

    tj, cfg, text = _split(data, 3)
    d = _fresh("tokenizer_json")
    (d / "tokenizer.json").write_bytes(tj)
    if cfg:
        (d / "tokenizer_config.json").write_bytes(cfg)
    try:
        tok = load_tokenizer(d)
    except LlamajetError:
        return
    _exercise_tokenizer(tok, _text(text))


_MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "4"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": [{"type": "text", "text": "Thanks!"}]},
]
_TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b",
                                            "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}]


def chat_template(data: bytes) -> None:
    """A chat template (jinja2) rendered for a conversation with tool calls."""
    from llamajet.tokenizer.chat import render

    source, variant = _split(data, 2)
    variables = {"bos_token": "<s>", "eos_token": "</s>", "add_generation_prompt": bool(len(variant) % 2),
                 "tools": _TOOLS if len(variant) % 3 == 0 else None, "documents": None}
    try:
        out = render(_text(source), _MESSAGES, **variables)
    except LlamajetError:
        return
    assert isinstance(out, str)


# ---------------------------------------------------------------- the server

# byte 0 of an input picks the route (modulo the count: append only, so the seeds keep their routes)
_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/v1/chat/completions",
              "/v1/responses", "/v1/messages", "/v1/messages/count_tokens", "/v1/embeddings")
_NO_MAX = ("/v1/messages/count_tokens", "/v1/embeddings")  # routes without a generation length
_SERVER: dict = {}
_MAX_NEW = 4  # generation lengths are capped so a valid request stays far below the time limit


def _client():
    if "client" not in _SERVER:
        from fastapi.testclient import TestClient

        from llamajet import LLM
        from llamajet.server.app import ServerSettings, create_app

        llm = LLM(str(CORPUS / "gguf" / "tiny-q8_0.gguf"), max_model_len=128)
        app = create_app(ServerSettings(model_name="fuzz", max_body_bytes=1 << 16), llm)
        client = TestClient(app, raise_server_exceptions=False)
        client.__enter__()  # runs the lifespan (install); closed at exit
        import atexit

        atexit.register(client.__exit__, None, None, None)
        _SERVER["client"] = client
    return _SERVER["client"]


def _cap(body: bytes, path: str) -> bytes:
    """The body with generation lengths above _MAX_NEW lowered to it (and n to
    at most 2), when it is a JSON object; anything else is sent as is."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return body
    if not isinstance(obj, dict):
        return body
    for k in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        v = obj.get(k)
        if type(v) is int and _MAX_NEW < v <= 1 << 20:
            obj[k] = _MAX_NEW
    if type(obj.get("n")) is int and 2 < obj["n"] <= 1 << 20:
        obj["n"] = 2
    if path == "/v1/responses":
        obj.setdefault("max_output_tokens", _MAX_NEW)
    elif path not in _NO_MAX and "max_tokens" not in obj and "max_completion_tokens" not in obj:
        obj["max_tokens"] = _MAX_NEW
    return json.dumps(obj).encode()


def server_request(data: bytes) -> None:
    """An HTTP request body; byte 0 picks the endpoint. 2xx, or a 4xx with an
    error in the shape of the route's API (Anthropic's under /v1/messages,
    OpenAI's elsewhere): anything else (5xx, a non-JSON error) is a finding."""
    if not data:
        return
    path = _ENDPOINTS[data[0] % len(_ENDPOINTS)]
    body = _cap(data[1:], path) if path.startswith("/v1/") else data[1:]
    r = _client().post(path, content=body, headers={"content-type": "application/json"})
    if r.status_code < 300:
        return
    assert 400 <= r.status_code < 500 and r.status_code != 408, (r.status_code, r.text[:500])
    if path.startswith("/v1/messages"):
        out = r.json()
        assert out["type"] == "error", out
        err = out["error"]
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), err
        return
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and "code" in err and "param" in err, err


TARGETS: dict[str, Callable[[bytes], None]] = {
    "gguf": gguf_file,
    "gguf_vocab": gguf_vocab,
    "safetensors": safetensors_file,
    "safetensors_index": safetensors_index,
    "saved": saved_folder,
    "tokenizer_json": tokenizer_json,
    "chat_template": chat_template,
    "server": server_request,
}
