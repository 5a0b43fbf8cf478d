"""`/v1/embeddings` through the official `openai` client and LangChain's
OpenAIEmbeddings, against transformers' last_hidden_state (after the final
norm), mean-pooled and normalized, on the same float model (stories260K)."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from llamajet import LLM

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from serverlib import LiveServer  # noqa: E402

M = "test-model"
TEXTS = ["Once upon a time there was a little dog.", "The cat sat.",
         "Lily and Tom went to the park to play on the swings and slide all day long.", "Hi"]


@pytest.fixture(scope="module")
def hf(stories_hf):
    torch.set_num_threads(2)
    return transformers.AutoModel.from_pretrained(stories_hf, attn_implementation="eager").eval()


@pytest.fixture(scope="module", params=["none", "default"])
def srv(request, stories_hf):
    opts = {"quantize": "none"} if request.param == "none" else {}
    s = LiveServer(LLM(stories_hf, max_model_len=256, **opts))
    s.kind = request.param
    yield s
    s.close()


def _reference(hf, llm, texts: list[str], pooling: str = "mean") -> np.ndarray:
    out = []
    for t in texts:
        ids = llm.tokenizer.encode(t)  # as the server tokenizes an embedding input (BOS added)
        with torch.no_grad():
            h = hf(torch.tensor([ids])).last_hidden_state[0].double().numpy()
        v = h.mean(axis=0) if pooling == "mean" else h[-1]
        out.append(v / np.linalg.norm(v))
    return np.stack(out)


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_openai_client_embeddings_match_transformers(srv, hf):
    client = srv.client()
    # the client asks for base64 by default and decodes it; float is asked for explicitly
    r = client.embeddings.create(model=M, input=TEXTS)
    vecs = np.array([d.embedding for d in r.data], dtype=np.float32)
    floats = client.embeddings.create(model=M, input=TEXTS, encoding_format="float")
    assert np.array_equal(vecs, np.array([d.embedding for d in floats.data], dtype=np.float32))
    assert [d.index for d in r.data] == list(range(len(TEXTS)))
    assert r.usage.prompt_tokens == sum(len(srv.llm.tokenizer.encode(t)) for t in TEXTS)
    ref = _reference(hf, srv.llm, TEXTS)
    # float weights: only summation order differs (f16 KV is the default); quantized: the int8 path
    bound = 1e-4 if srv.kind == "none" else 1e-3
    assert (1 - _cos(vecs, ref)).max() <= bound
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    one_by_one = np.array([client.embeddings.create(model=M, input=t).data[0].embedding for t in TEXTS],
                          dtype=np.float32)
    assert np.array_equal(vecs, one_by_one)  # a batch equals its texts one by one, bit for bit
    last = httpx.post(srv.url + "/v1/embeddings", json={"model": M, "input": TEXTS, "pooling": "last"}).json()
    lv = np.array([d["embedding"] for d in last["data"]], dtype=np.float32)
    assert (1 - _cos(lv, _reference(hf, srv.llm, TEXTS, "last"))).max() <= 10 * bound


def test_token_ids_and_base64_on_the_wire(srv):
    ids = srv.llm.tokenizer.encode(TEXTS[0])
    raw = httpx.post(srv.url + "/v1/embeddings", json={"model": M, "input": ids, "encoding_format": "base64"}).json()
    v = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    by_text = httpx.post(srv.url + "/v1/embeddings", json={"model": M, "input": [TEXTS[0]]}).json()
    assert np.array_equal(v, np.array(by_text["data"][0]["embedding"], dtype=np.float32))
    assert raw["usage"]["prompt_tokens"] == len(ids)


def test_langchain_openai_embeddings(srv):
    lc = pytest.importorskip("langchain_openai")
    emb = lc.OpenAIEmbeddings(model=M, base_url=srv.url + "/v1", api_key="none",
                              check_embedding_ctx_length=False, max_retries=0)  # text, not tiktoken ids
    docs = np.array(emb.embed_documents(TEXTS[:3]), dtype=np.float32)
    q = np.array(emb.embed_query(TEXTS[1]), dtype=np.float32)
    direct = srv.llm.embed(TEXTS[:3])
    assert np.array_equal(docs, direct)
    assert np.array_equal(q, direct[1])


def test_embedding_errors_name_the_field(srv):
    u = srv.url + "/v1/embeddings"

    def err(body, status, param):
        r = httpx.post(u, json=body)
        assert r.status_code == status, r.text
        e = r.json()["error"]
        assert e["param"] == param and e["message"], e
        return e

    err({"model": M, "input": []}, 400, "input")
    err({"model": M, "input": ""}, 400, "input")
    err({"model": M, "input": [10 ** 9]}, 400, "input")
    err({"model": M, "input": "x " * 400}, 400, "input")  # longer than the context
    err({"model": M, "input": "x", "dimensions": 3}, 400, "dimensions")
    err({"model": M, "input": "x", "encoding_format": "int8"}, 400, "encoding_format")
    err({"model": M, "input": "x", "pooling": "cls"}, 400, "pooling")
    err({"model": "other", "input": "x"}, 404, "model")
