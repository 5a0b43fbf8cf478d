"""LLM.embed: pooled final hidden states from the embedding program
(engine/embedder.py), against HF transformers' LlamaModel (whose
last_hidden_state is after the final norm), batched against alone, beside
generation, and its refusals.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import numpy as np
import pytest

from llamajet.api import LLM
from llamajet.engine.sampling import SamplingParams
from llamajet.errors import RequestError
from llamajet.ops import supported_isas

TEXTS = ["Once upon a time", "Lily was happy.", "x",
         "The little dog ran to the park and played with a red ball all day long. " * 3]
# small steps so that texts are packed several to a step and the long one runs in chunks
SMALL_STEPS = dict(max_model_len=256, max_tokens_per_step=32, max_num_seqs=3)
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_model(stories_hf):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(2)
    return transformers.AutoModel.from_pretrained(stories_hf, attn_implementation="eager").eval()


def _reference(hf, ids_list: list[list[int]], pooling: str, normalize: bool = True) -> np.ndarray:
    """HF's last_hidden_state pooled per text in float64, as the embedder pools."""
    import torch

    out = []
    for ids in ids_list:
        with torch.no_grad():
            h = hf(torch.tensor([ids])).last_hidden_state[0].double().numpy()
        v = h.mean(axis=0) if pooling == "mean" else h[-1]
        out.append(v / np.linalg.norm(v) if normalize else v)
    return np.stack(out)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.fixture(scope="module")
def stories(stories_hf):
    return LLM(stories_hf, **SMALL_STEPS)


# ------------------------------------------------------------------ against transformers


# Float weights (quantize="none"): fp32 weights and activations, K/V stored in f16 (the default
# kv_dtype), so the hidden states differ from HF's by f16 rounding of K/V carried through 5
# layers: measured 1 - cos <= 2.3e-7 (4e-14 with kv_dtype="f32"); bound 1e-4.
# Default options: int8_g32 weights (Q8_0's layout) and int8 activations in groups of 32 with
# outlier channels, on a 64-wide model where every group is two thirds of a head: measured
# 1 - cos <= 1.6e-4 (mean), 5.6e-4 (last: one token's state, nothing averages the rounding
# out); bound 1e-3.
@pytest.mark.parametrize("options, bound", [(dict(quantize="none"), 0.9999), ({}, 0.999)],
                         ids=["float", "default"])
@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_matches_transformers(stories_hf, hf_model, options, bound, pooling):
    llm = LLM(stories_hf, **SMALL_STEPS, **options)
    ids = [llm.tokenizer.encode(t) for t in TEXTS]
    assert len(ids[-1]) > 2 * llm.engine.runner.max_tokens  # the long text runs in 3+ chunks
    got = llm.embed(TEXTS, pooling=pooling)
    assert got.shape == (len(TEXTS), llm.config.hidden_size) and got.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-6)
    cos = _cosines(got, _reference(hf_model, ids, pooling))
    assert cos.min() >= bound, cos


def test_unnormalized_is_the_pooled_state(stories_hf, hf_model):
    llm = LLM(stories_hf, **SMALL_STEPS, quantize="none")
    ids = [llm.tokenizer.encode(t) for t in TEXTS]
    raw = llm.embed(ids, normalize=False)
    ref = _reference(hf_model, ids, "mean", normalize=False)
    # the magnitude is kept (not normalized); f16 K/V as above: measured rel. error <= 1e-5
    np.testing.assert_allclose(np.linalg.norm(raw, axis=1), np.linalg.norm(ref, axis=1), rtol=1e-3)
    assert _cosines(raw, ref).min() >= 0.9999
    # normalizing afterwards gives embed's normalized vectors (float32 rounding of the division)
    np.testing.assert_allclose(raw / np.linalg.norm(raw, axis=1, keepdims=True), llm.embed(ids), atol=1e-6)


def test_text_is_tokenized_with_special_tokens_like_hf(stories_hf, stories):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(stories_hf)
    hf_ids = [tok(t)["input_ids"] for t in TEXTS]  # HF's default: add_special_tokens=True (BOS)
    assert all(ids[0] == tok.bos_token_id for ids in hf_ids)
    out = stories.embed_with_counts(TEXTS)
    assert out.token_counts == tuple(len(ids) for ids in hf_ids)
    assert out.prompt_tokens == sum(len(ids) for ids in hf_ids)
    np.testing.assert_array_equal(out.vectors, stories.embed(hf_ids))


# ------------------------------------------------------------------ determinism


@pytest.mark.parametrize("isa", supported_isas())
def test_batch_equals_one_by_one_bit_for_bit(stories_hf, isa):
    # 32-token steps of at most 3 texts: short texts packed together (and split by either
    # budget), texts of 33+ tokens alone in chunks. The kernels make a row's bits independent
    # of the step's other rows on one ISA tier, and a text's chunks depend only on its length.
    llm = LLM(stories_hf, **SMALL_STEPS, isa=isa, n_threads=2)
    rng = np.random.default_rng(0)
    lengths = [1, 2, 5, 17, 31, 32, 33, 3, 70, 9, 150, 4, 4, 4, 4]
    texts = [rng.integers(3, llm.config.vocab_size, n).tolist() for n in lengths]
    for pooling in ("mean", "last"):
        for normalize in (True, False):
            batch = llm.embed(texts, pooling=pooling, normalize=normalize)
            alone = np.concatenate([llm.embed([t], pooling=pooling, normalize=normalize) for t in texts])
            assert np.array_equal(batch, alone), (pooling, normalize)
            reversed_ = llm.embed(texts[::-1], pooling=pooling, normalize=normalize)[::-1]
            assert np.array_equal(batch, reversed_), (pooling, normalize)


def test_one_token_text_mean_is_its_last_state(stories):
    # the mean of one row, summed in float64 and divided by 1, is that row exactly
    for normalize in (True, False):
        np.testing.assert_array_equal(stories.embed([[1]], pooling="last", normalize=normalize),
                                      stories.embed([[1]], normalize=normalize))


# ------------------------------------------------------------------ beside generation


def test_generation_untouched_by_the_embedding_program(stories_hf):
    llm = LLM(stories_hf, **SMALL_STEPS)
    before = llm.generate("Once upon a time", GREEDY)[0].token_ids
    assert llm._embedder is None  # built lazily, by the first embed call
    first = llm.embed(TEXTS)
    assert llm._embedder is not None
    after = llm.generate("Once upon a time", GREEDY)[0].token_ids
    assert after == before and len(after) == GREEDY.max_tokens
    # embedding between the steps of a stream changes neither the stream nor the embeddings
    streamed = []
    for ev in llm.stream("Once upon a time", GREEDY):
        if ev.token_id is not None:
            streamed.append(ev.token_id)
        assert np.array_equal(llm.embed(TEXTS), first)
    assert streamed == before


def test_embed_and_generate_from_two_threads(stories_hf):
    llm = LLM(stories_hf, **SMALL_STEPS)
    ref_tokens = llm.generate("Once upon a time", GREEDY)[0].token_ids
    ref_vectors = llm.embed(TEXTS)
    got_tokens, got_vectors, errors = [], [], []

    def embedder():
        try:
            for _ in range(10):
                got_vectors.append(llm.embed(TEXTS))
        except Exception as e:  # reported below, not lost in the thread
            errors.append(e)

    t = threading.Thread(target=embedder)
    t.start()
    for _ in range(5):
        got_tokens.append(llm.generate("Once upon a time", GREEDY)[0].token_ids)
    t.join()
    assert not errors, errors
    assert all(toks == ref_tokens for toks in got_tokens)
    assert len(got_vectors) == 10 and all(np.array_equal(v, ref_vectors) for v in got_vectors)


def test_weights_are_shared_with_the_generation_program(stories):
    stories.embed("x")
    emb, run = stories._embedder, stories.engine.runner
    # every weight the embedding program reads is the generation graph's own object (so its
    # array: Ref.from_array keeps a pointer), and no LM head is in it
    assert emb.graph.weights and all(w is run.graph.weights[name] for name, w in emb.graph.weights.items())
    assert {n.op for n in emb.graph.nodes}.isdisjoint({"gather", "argmax"})
    assert emb.graph.outputs == ["output_norm.out"]
    # its own buffers: an arena, a KV pool and scratch grown as ops were added; a handful, not
    # one per weight (test_memory.py's rule for the generation program)
    assert 2 <= emb.exe.allocations <= len(emb.graph.nodes) // 4


_RSS_PROBE = r"""
import json, sys
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
from llamajet.api import LLM
from llamajet.engine.sampling import SamplingParams
llm = LLM(sys.argv[1])
llm.generate("Once upon a time", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm
r = {"warm": rss()}
llm.embed("The quick brown fox jumps over the lazy dog.")
r["embedded"] = rss()
import numpy as np
mm = llm.model.gguf_reader.data  # the file's map: weights read in place are not the load's
seen = {}
for w in llm.engine.runner.graph.weights.values():  # weight buffers the load made, each once
    d = w.data
    while isinstance(d.base, np.ndarray):
        d = d.base
    if not np.may_share_memory(d, mm):
        seen[id(d)] = d.nbytes
r["owned_weights"] = sum(seen.values())
r["arena"] = llm._embedder.arena_bytes
print(json.dumps(r))
"""


@pytest.mark.rss
def test_default_model_embedding_program_adds_no_weight_copy(smollm2_gguf):
    # The first embed builds the program and runs a 10-token text. Measured on SmolLM2-135M
    # Q4_1 (~97 MiB of packed weights): +5.5 MiB VmRSS (executor scratch, arena pages touched,
    # thread stacks, graph objects). Bound: 16 MiB, far below one more copy of the weights.
    p = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(smollm2_gguf)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    grown = r["embedded"] - r["warm"]
    assert r["owned_weights"] > 64 * 2**20
    assert grown <= 16 * 2**20, f"RSS grew {grown / 2**20:.1f} MiB building the embedding program"


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize("inputs, match", [
    ("", "empty"),
    ([], "no inputs"),
    (["ok", ""], "input 1 is an empty string"),
    ([[]], "input 0 is empty"),
    ([[1, 2], []], "input 1 is empty"),
    ([1, 2, 100_000], "outside the vocabulary"),
    ([[1, -1]], "outside the vocabulary"),
    ([[1, 2.5]], "integers"),
    ([["a", "b"]], "integers"),
    ([1, [2, 3]], "expected a str or a list of token ids"),
    ([None], "expected a str"),
    (None, "must be a str"),
    (42, "must be a str"),
    ({"input": "x"}, "must be a str"),
    ([True, False], "expected a str"),
    ([[5] * 257], "257 tokens but the context holds 256"),
    ("word " * 300, "tokens but the context holds 256"),
])
def test_bad_inputs_are_request_errors(stories, inputs, match):
    with pytest.raises(RequestError, match=match):
        stories.embed(inputs)


def test_bad_options_are_request_errors(stories):
    with pytest.raises(RequestError, match="pooling='max'"):
        stories.embed("x", pooling="max")
    with pytest.raises(RequestError, match="normalize"):
        stories.embed("x", normalize="yes")
    # a whole context is accepted (nothing is generated after it)
    assert stories.embed([[5] * 256]).shape == (1, stories.config.hidden_size)
