"""Speculative decoding (engine/speculative.py, issue 43): the output is the
tokens plain decoding gives — greedy and seeded sampling alike — whatever was
proposed and accepted; rejected tokens leave no block held and nothing in the
prefix cache; the sampled distribution is the target's."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from llamajet import LLM, SamplingParams

# Prompts that accept much (the reply repeats its input), little, and nothing.
REPEAT = [{"role": "user", "content": "Repeat this text exactly, word for word: The committee met on Tuesday "
           "to discuss the new budget. The committee agreed that the new budget would fund three schools, "
           "two libraries and one hospital. The committee will meet again next Tuesday."}]
CODE = [{"role": "user", "content": "Rename the variable total to result in this function and show the whole "
         "function:\n\ndef mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
         "    return total / len(values)\n"}]
FREE = [{"role": "user", "content": "Write a short story about a dragon who learns to bake bread."}]
CONVS = {"repeat": REPEAT, "code": CODE, "free": FREE}


@pytest.fixture(scope="module")
def pair(smollm2_gguf):
    """(plain, speculative) engines of the default model, the same options otherwise."""
    opts = dict(max_model_len=512, n_threads=2)
    return LLM(smollm2_gguf, **opts), LLM(smollm2_gguf, speculative="ngram", **opts)


def _ids(llm, conv):
    return llm.chat_ids(conv)


def _check_pool_empty(llm):
    b = llm.engine.blocks
    b.check([])  # ref counts, free list and cache agree, and no table holds a block
    assert b.num_free == b.num_blocks


@pytest.mark.parametrize("name", list(CONVS))
def test_greedy_output_is_bit_identical(pair, name):
    plain, spec = pair
    ids = _ids(plain, CONVS[name])
    p = SamplingParams(max_tokens=160, temperature=0, logprobs=2)
    st = spec.engine.stats
    before = (st.spec_draft_tokens, st.spec_accepted_tokens, st.steps)
    a, b = plain.generate(ids, p)[0], spec.generate(ids, p)[0]
    assert b.token_ids == a.token_ids and b.text == a.text and b.finish_reason == a.finish_reason
    # logprobs are the target's, bit for bit (the same rows)
    for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
        assert {k: v.logprob for k, v in x.items()} == {k: v.logprob for k, v in y.items()}
    drafted, accepted = st.spec_draft_tokens - before[0], st.spec_accepted_tokens - before[1]
    if name == "repeat":  # the reply copies its input: most proposals hold, in fewer steps than tokens
        assert accepted >= 0.5 * len(a.token_ids), (accepted, drafted, len(a.token_ids))
        assert st.steps - before[2] < 0.6 * len(a.token_ids)
    _check_pool_empty(spec)


def test_seeded_sampling_is_bit_identical(pair):
    plain, spec = pair
    d0 = spec.engine.stats.spec_drafts
    ids = _ids(plain, REPEAT)
    off = SamplingParams(max_tokens=40, temperature=0, speculative=False)  # a request that opts out
    assert spec.generate(ids, off)[0].token_ids == plain.generate(ids, off)[0].token_ids
    assert spec.engine.stats.spec_drafts == d0
    for conv in CONVS.values():
        ids = _ids(plain, conv)
        for seed in (1, 2, 3):
            p = SamplingParams(max_tokens=96, temperature=0.7, top_p=0.9, seed=seed, repetition_penalty=1.05)
            assert spec.generate(ids, p)[0].token_ids == plain.generate(ids, p)[0].token_ids
    _check_pool_empty(spec)


def test_stop_strings_and_max_tokens_inside_accepted_runs(pair):
    plain, spec = pair
    ids = _ids(plain, REPEAT)
    full = plain.generate(ids, SamplingParams(max_tokens=120, temperature=0))[0].text
    # stop strings that end inside the copied text (inside an accepted run), and one spanning two words
    for stop in ("budget", "three schools, two", "libraries, and"):
        assert stop in full
        p = SamplingParams(max_tokens=120, temperature=0, stop=[stop])
        a, b = plain.generate(ids, p)[0], spec.generate(ids, p)[0]
        assert b.text == a.text and b.token_ids == a.token_ids and b.finish_reason == a.finish_reason == "stop"
    for n in (1, 7, 23, 33):  # max_tokens reached in the middle of an accepted run (the reply has ~39)
        p = SamplingParams(max_tokens=n, temperature=0)
        a, b = plain.generate(ids, p)[0], spec.generate(ids, p)[0]
        assert b.token_ids == a.token_ids and len(b.token_ids) == n and b.finish_reason == "length"
    # streamed: the same text, several tokens per step arriving in order
    streamed = "".join(ev.text for ev in spec.stream(ids, SamplingParams(max_tokens=80, temperature=0)))
    assert streamed == plain.generate(ids, SamplingParams(max_tokens=80, temperature=0))[0].text
    _check_pool_empty(spec)


def test_json_schema_n2_and_batches(pair):
    plain, spec = pair
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "items": {"type": "array", "items":
              {"type": "string"}}}, "required": ["name", "items"]}
    conv = [{"role": "user", "content": "Give a JSON object with a name and a list of three fruits, repeated: "
             "apple, apple, apple."}]
    ids = _ids(plain, conv)
    from llamajet.server.grammar import Grammars

    def constrained(llm):  # the server's structured output: a grammar constraint on the sequence
        g = Grammars(llm.tokenizer, llm.engine.runner.config.vocab_size)
        seq = llm.engine.new_sequence(ids, SamplingParams(max_tokens=80, temperature=0),
                                      constraint=g.constraint(g.from_json_schema(schema)))
        llm.engine.run_all([seq])
        return seq.token_ids[seq.num_prompt:]

    got = constrained(spec)
    assert got == constrained(plain)
    import json
    json.loads(spec.tokenizer.decode(got))  # a whole object
    p = SamplingParams(max_tokens=60, temperature=0.8, seed=4, n=2)
    a, b = plain.generate(ids, p)[0], spec.generate(ids, p)[0]
    assert [c.token_ids for c in b.outputs] == [c.token_ids for c in a.outputs]
    # several sequences in one step, each verifying its own proposals
    batch = [_ids(plain, c) for c in CONVS.values()] * 2
    p = SamplingParams(max_tokens=64, temperature=0)
    assert [o.token_ids for o in spec.generate(batch, p)] == [o.token_ids for o in plain.generate(batch, p)]
    _check_pool_empty(spec)


def test_preemption_with_proposals(smollm2_gguf, pair):
    plain, _ = pair
    # a pool of 6 blocks of 16 tokens: three sequences of ~60 tokens cannot all run
    small = LLM(smollm2_gguf, speculative="ngram", max_model_len=96, kv_cache_tokens=96, n_threads=2)
    ids = [_ids(plain, [{"role": "user", "content": f"Say {w} five times."}]) for w in ("yes", "no", "maybe")]
    ids = [i[-40:] for i in ids]
    p = SamplingParams(max_tokens=50, temperature=0)
    got = [o.token_ids for o in small.generate(ids, p)]
    assert small.engine.scheduler.num_preemptions > 0
    ref = LLM(smollm2_gguf, max_model_len=96, n_threads=2)
    assert got == [o.token_ids for o in ref.generate(ids, p)]
    _check_pool_empty(small)


def test_prefix_cache_holds_only_accepted_tokens(pair):
    """After a speculative run, the cached blocks of its sequence give a new request the K/V plain
    decoding computes: its logprobs equal the plain engine's bit for bit (a block holding a rejected
    proposal's K/V would change them)."""
    plain, spec = pair
    ids = _ids(plain, CODE)
    out = spec.generate(ids, SamplingParams(max_tokens=100, temperature=0))[0]
    assert spec.engine.stats.spec_draft_tokens > spec.engine.stats.spec_accepted_tokens  # some were rejected
    again = ids + list(out.token_ids[:-8])  # (its last token ended the reply: the next would be a stop)
    p = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    b = spec.generate(again, p)[0]
    assert b.metrics.cached_tokens >= len(again) - 2 * spec.engine.blocks.block_size
    a = plain.generate(again, p)[0]
    assert {k: v.logprob for k, v in b.outputs[0].logprobs[0].items()} == \
        {k: v.logprob for k, v in a.outputs[0].logprobs[0].items()}


def test_sampled_distribution_is_the_targets(stories_hf):
    """stories260K (512 tokens): the prompt ends with a repeated phrase, so the proposer offers
    what followed it before. The second token is drawn from the proposal's row when the first
    equals the proposal (~9% here); its distribution given that first token must be softmax(logits / T) at
    prompt + first token (chi-square over the bins with expected count >= 5; a rule that keeps the
    proposal, or reads the wrong row, fails it)."""
    llm = LLM(stories_hf, speculative="ngram", max_model_len=128, n_threads=1)
    ids = llm.tokenizer.encode("Tom saw a big red ball. Tom saw a big red ball. Tom saw a big")
    T = 1.0
    first = {}
    seconds = []
    p = [SamplingParams(max_tokens=2, temperature=T, seed=s) for s in range(10000)]
    for o in llm.generate([ids] * len(p), p):
        first[o.token_ids[0]] = first.get(o.token_ids[0], 0) + 1
        seconds.append(tuple(o.token_ids[:2]))
    from llamajet.engine.sequence import Sequence
    from llamajet.engine.speculative import NgramProposer

    d = NgramProposer(4).propose(Sequence(ids, SamplingParams(max_tokens=2)))[0]  # what followed "a big" before
    assert llm.engine.stats.spec_accepted_tokens > 0
    cond = [s for f, s in seconds if f == d]
    lg = llm.logits(ids + [d])[-1].astype(np.float64) / T
    q = np.exp(lg - lg.max())
    q /= q.sum()
    counts = np.bincount(cond, minlength=q.size)
    exp = q * len(cond)
    keep = exp >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    ex = np.append(exp[keep], exp[~keep].sum())
    assert len(cond) > 500 and keep.sum() >= 2  # (the model gives the proposal ~9%: ~860 of the 10000)
    stat, df = float(((obs - ex) ** 2 / ex).sum()), len(obs) - 1
    # the chi-square critical value at p = 1e-3 (z = 3.09) by Wilson-Hilferty's cube-root approximation
    # (within 1% of the exact quantile for df >= 3; scipy is not a dependency)
    crit = df * (1 - 2 / (9 * df) + 3.09 * np.sqrt(2 / (9 * df))) ** 3
    assert stat < crit, (stat, crit, obs, ex)
    # the same test rejects a rule that always keeps the proposal: it would put every second token on
    # what followed "big" before (the proposal), far from q
    wrong = np.zeros_like(obs)
    j = int(np.flatnonzero(keep)[np.argmax(q[keep])])  # a bin (the most likely one)
    wrong[list(np.flatnonzero(keep)).index(j)] = len(cond)
    assert float(((wrong - ex) ** 2 / ex).sum()) > crit


def test_server_streams_the_same_text_and_counts_acceptance(pair):
    """`serve --speculative ngram`: the openai client's streamed chat is the plain engine's reply,
    and /metrics counts drafts, proposed and accepted tokens under vLLM's names."""
    from serverlib import LiveServer

    plain, spec = pair
    srv = LiveServer(spec)
    try:
        m0 = {k: srv.metric(f"llamajet:spec_decode_num_{k}_total") for k in ("drafts", "draft_tokens",
                                                                            "accepted_tokens")}
        stream = srv.client().chat.completions.create(model="test-model", messages=REPEAT, max_tokens=80,
                                                      temperature=0, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == plain.chat(REPEAT, SamplingParams(max_tokens=80, temperature=0))[0].text
        m1 = {k: srv.metric(f"llamajet:spec_decode_num_{k}_total") for k in m0}
        assert m1["drafts"] > m0["drafts"] and m1["accepted_tokens"] > m0["accepted_tokens"]
        assert m1["draft_tokens"] - m0["draft_tokens"] >= m1["accepted_tokens"] - m0["accepted_tokens"]
        st = spec.engine.stats
        assert m1["accepted_tokens"] == st.spec_accepted_tokens and m1["draft_tokens"] == st.spec_draft_tokens
        # a request can opt out: the same text, nothing proposed for it
        r = srv.client().chat.completions.create(model="test-model", messages=REPEAT, max_tokens=80,
                                                 temperature=0, extra_body={"speculative": False})
        assert r.choices[0].message.content == text
        assert srv.metric("llamajet:spec_decode_num_drafts_total") == m1["drafts"]
        bad = httpx.post(srv.url + "/v1/chat/completions", json={"model": "test-model", "messages": REPEAT,
                                                                  "speculative": "sometimes"})
        assert bad.status_code == 400 and "speculative" in bad.json()["error"]["message"]
    finally:
        srv.close()
