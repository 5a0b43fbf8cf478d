"""The public API and CLI: behaviour, every ISA, and clear errors on bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from llamajet import (LLM, LlamajetError, ModelFormatError, RequestError, SamplingParams,
                      UnsupportedModelError)
from llamajet.ops import supported_isas

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def stories(stories_hf):
    return LLM(stories_hf, max_model_len=128)


@pytest.mark.parametrize("isa", supported_isas())
@pytest.mark.parametrize("threads", [1, 2])
def test_every_isa_and_thread_count_gives_the_same_greedy_text(stories_hf, stories, isa, threads):
    ref = stories.generate("Once upon a time", GREEDY)[0]
    out = LLM(stories_hf, max_model_len=128, isa=isa, n_threads=threads).generate("Once upon a time", GREEDY)[0]
    assert out.token_ids == ref.token_ids


def test_isa_override_from_environment(stories_hf, monkeypatch):
    monkeypatch.setenv("LLAMAJET_ISA", "scalar")
    assert LLM(stories_hf, max_model_len=64).isa == "ref"
    monkeypatch.setenv("LLAMAJET_ISA", "sse9")
    with pytest.raises(LlamajetError, match="unknown ISA"):
        LLM(stories_hf, max_model_len=64)


def test_logits_agree_with_generation(stories):
    ids = stories.tokenizer.encode("Once upon a time, there was a")
    logits = stories.logits(ids)
    assert logits.shape == (len(ids), stories.config.vocab_size) and logits.dtype == np.float32
    first = stories.generate([ids], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))[0]
    assert first.token_ids == [int(logits[-1].argmax())]
    # Scoring a prefix gives the same rows (causality, and the KV cache is not
    # reused across requests by accident). Same kernels, same order: exact.
    np.testing.assert_array_equal(stories.logits(ids[:4]), logits[:4])


def test_greedy_ids_are_numpys_argmax_of_the_step_logits(stories):
    """The step's argmax op (what greedy decoding reads) against numpy's
    argmax of the same step's logits rows, for a batch of three prompts."""
    eng = stories.engine
    seqs = [eng.add_request(stories.tokenizer.encode(p), GREEDY) for p in ("Once", "The dog ran to the", "A")]
    try:
        out = eng.scheduler.schedule()
        logits = eng.runner.run(out.scheduled, out.copies)
        n = sum(1 for s in out.scheduled if s.logits)
        assert n == 3
        np.testing.assert_array_equal(eng.runner.greedy_ids(n), logits[:n].argmax(axis=1))
    finally:
        for s in seqs:
            eng.abort(s)


def test_stream_text_equals_generate_text_and_stop_strings(stories):
    ids = stories.tokenizer.encode("Once upon a time")
    full = stories.generate([ids], GREEDY)[0]
    streamed = "".join(ev.text for ev in stories.stream(ids, GREEDY))
    assert streamed == full.text
    cut = stories.generate([ids], SamplingParams(max_tokens=24, temperature=0, stop=("Lily",)))[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index("Lily")]


def test_seeded_sampling_is_reproducible(stories):
    p = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=7)
    a = stories.generate("Once upon a time", p)[0]
    b = stories.generate("Once upon a time", p)[0]
    assert a.token_ids == b.token_ids


def test_chat_on_default_model_stops_at_end_of_turn(smollm2_gguf):
    llm = LLM(smollm2_gguf, max_model_len=256)
    # (The fast path's int8 activations flip the first token of "What is the
    # capital of France?" to a near-tie runner-up, " L" 24.62 vs "The" 24.55;
    # this prompt has a clear winner on both paths.)
    out, = llm.chat([{"role": "user", "content": "Name the capital of France."}],
                    SamplingParams(max_tokens=40, temperature=0))
    assert out.finish_reason == "stop"
    assert "Paris" in out.text and "<|im_end|>" not in out.text


# ------------------------------------------------------------------ bad input


def test_empty_prompt_and_bad_ids(stories):
    with pytest.raises(RequestError, match="empty"):
        stories.generate("")
    with pytest.raises(RequestError, match="empty"):
        stories.generate([[]])
    with pytest.raises(RequestError, match="vocabulary"):
        stories.generate([[1, 99999]])
    with pytest.raises(RequestError):
        stories.logits([])


def test_prompt_longer_than_context_is_refused_and_loses_nothing(stories):
    long_ids = [1] + [403] * 200
    with pytest.raises(RequestError, match="context holds 128"):
        stories.generate([long_ids])
    with pytest.raises(RequestError, match="exceed the context"):
        stories.logits(long_ids)
    # One bad prompt in a batch fails the call before anything runs...
    with pytest.raises(RequestError):
        stories.generate(["Once upon a time", long_ids])
    # ...and the engine is intact: every KV block is back in the pool.
    assert stories.engine.blocks.num_free == stories.engine.blocks.num_blocks
    assert stories.generate("Once upon a time", GREEDY)[0].token_ids


def test_generation_stops_at_the_context_limit(stories_hf):
    llm = LLM(stories_hf, max_model_len=16)
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.prompt_token_ids) + len(out.token_ids) == 16


def test_missing_and_malformed_models(tmp_path, stories_gguf, stories_hf):
    with pytest.raises(ModelFormatError):
        LLM(tmp_path / "nope")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(stories_gguf.read_bytes()[:300_000])
    with pytest.raises(ModelFormatError):
        LLM(cut)
    bad = tmp_path / "mistral"
    shutil.copytree(stories_hf, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral")
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="(?i)mistral"):
        LLM(bad)


def test_max_model_len_beyond_the_model_is_refused(stories_hf):
    with pytest.raises(RequestError, match="max_model_len"):
        LLM(stories_hf, max_model_len=100_000)


# ------------------------------------------------------------------ CLI


def _cli(*args, stdin: str | None = None, env=None):
    return subprocess.run([sys.executable, "-m", "llamajet.cli", *args], input=stdin, text=True,
                          capture_output=True, timeout=300, env=env)


def test_cli_generate_and_info(stories_hf):
    r = _cli("generate", "--model", str(stories_hf), "-n", "12", "--temperature", "0", "Once upon a time")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(", there was a little girl named Lily.")
    r = _cli("info", env={k: v for k, v in os.environ.items() if k != "LLAMAJET_ISA"})  # the default choice
    assert r.returncode == 0, r.stderr
    # the chosen tier is one this CPU supports (ref on any x86-64), and listed among them
    chosen = next(line.split(":", 1)[1].strip() for line in r.stdout.splitlines() if line.startswith("isa chosen:"))
    listed = next(line.split(":", 1)[1].strip() for line in r.stdout.splitlines() if line.startswith("isas:"))
    assert chosen in ("ref", "avx2", "avx512", "amx") and chosen == listed.split(", ")[-1], r.stdout


def test_cli_errors_are_clear(tmp_path):
    r = _cli("generate", "--model", str(tmp_path / "missing.gguf"), "hi")
    assert r.returncode == 2 and "llamajet: error:" in r.stderr and "Traceback" not in r.stderr
    r = _cli("generate", "--max-tokens", "0", "hi")
    assert r.returncode == 2 and "max_tokens" in r.stderr


def test_cli_chat_default_model_multi_turn(smollm2_gguf):
    env = dict(os.environ)
    r = _cli("chat", "--temperature", "0", "-n", "30", stdin="Name the capital of France.\nWhat is the capital of Italy?\n\n",
             env=env)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout and "Rome" in r.stdout


def test_bench_reports_a_worker_that_dies_instead_of_hanging():
    """`llamajet bench --vs-llama-cpp` talks to each engine in its own process;
    one that crashes (as a yardstick built for the wrong CPU does) must end the
    bench with its name and exit code, not leave it waiting on the pipe."""
    import multiprocessing as mp

    from llamajet.eval.bench_latency import _Checked

    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    pr = ctx.Process(target=os._exit, args=(3,), daemon=True)  # dies without a word
    pr.start()
    b.close()
    with pytest.raises(SystemExit, match=r"the yardstick worker died \(exit code 3\)"):
        _Checked(a, "yardstick", pr).recv()


def test_logprob_tokens_read_as_the_text_reads_on_a_sentencepiece_model(stories):
    """Logprob.decoded_token is the token's text in the stream (engine/output.token_piece, as the
    server's logprobs): a SentencePiece decode([id]) drops a piece's leading space, so the chosen
    tokens' texts would not add up to the completion."""
    out = stories.generate("Once upon a time", SamplingParams(max_tokens=12, temperature=0, logprobs=2))[0].outputs[0]
    chosen = [d[t].decoded_token for d, t in zip(out.logprobs, out.token_ids)]
    assert "".join(chosen) == out.text
    assert any(c.startswith(" ") for c in chosen)  # the case decode([id]) got wrong
