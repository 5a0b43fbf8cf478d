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
    """(plain, speculative) engines of the default model, the same options otherwise; the
    speculative one verifies every proposal (no step-cost model: these tests are about
    verification, which the model would skip on a compute-bound CPU)."""
    opts = dict(max_model_len=512, n_threads=2)
    return LLM(smollm2_gguf, **opts), LLM(smollm2_gguf, speculative="ngram", speculative_cost_model=False, **opts)


@pytest.fixture(scope="module")
def draft(smollm2_gguf):
    """The default model's first 20 of 30 layers draft for it (speculative="layers:20"), every
    proposal verified."""
    return LLM(smollm2_gguf, speculative="layers:20", speculative_cost_model=False, max_model_len=512,
               n_threads=2)


@pytest.fixture(scope="module")
def suffix(smollm2_gguf):
    """A suffix-decoding engine of the default model, every proposal verified."""
    return LLM(smollm2_gguf, speculative="suffix", speculative_cost_model=False, max_model_len=512, n_threads=2)


def _ids(llm, conv):
    return llm.chat_ids(conv)


def _check_pool_empty(llm):
    b = llm.engine.blocks
    b.check([])  # ref counts, free list and cache agree, and no table holds a block
    assert b.num_free == b.num_blocks


@pytest.mark.parametrize("proposer", ["ngram", "suffix", "draft"])
@pytest.mark.parametrize("name", list(CONVS))
def test_greedy_output_is_bit_identical(pair, suffix, draft, name, proposer):
    plain, spec = pair
    spec = {"ngram": spec, "suffix": suffix, "draft": draft}[proposer]
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
    if name == "repeat" and proposer != "draft":  # the reply copies its input: most proposals hold
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


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_json_schema_n2_and_batches(pair, draft, proposer):
    plain, spec = pair
    spec = draft if proposer == "draft" else spec
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


@pytest.mark.parametrize("proposer", ["ngram", "layers:20"])
def test_preemption_with_proposals(smollm2_gguf, pair, proposer):
    plain, _ = pair
    # a pool of 6 blocks of 16 tokens: three sequences of ~60 tokens cannot all run
    small = LLM(smollm2_gguf, speculative=proposer, speculative_cost_model=False, max_model_len=96,
                kv_cache_tokens=96, n_threads=2)
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
    llm = LLM(stories_hf, speculative="ngram", speculative_cost_model=False, max_model_len=128, n_threads=1)
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
        # accepted per position (vLLM's _per_pos): they add up to the accepted tokens, and position j + 1
        # is reached only through position j
        text_m = httpx.get(srv.url + "/metrics").text
        per = {}
        for line in text_m.splitlines():
            if line.startswith("llamajet:spec_decode_num_accepted_tokens_per_pos_total{"):
                per[int(line.split('position="')[1].split('"')[0])] = float(line.rsplit(" ", 1)[1])
        assert sum(per.values()) == m1["accepted_tokens"] and per[0] > 0
        assert [per[j] for j in sorted(per)] == sorted(per.values(), reverse=True)
        # the Responses and Anthropic routes honour the opt-out too (and speculate without it)
        user = REPEAT[0]["content"]
        for path, body in (("/v1/responses", {"input": user, "max_output_tokens": 40}),
                           ("/v1/messages", {"messages": REPEAT, "max_tokens": 40})):
            for opt in (False, True):
                d0 = srv.metric("llamajet:spec_decode_num_drafts_total")
                r = httpx.post(srv.url + path, json={"model": "test-model", "temperature": 0, "speculative": opt,
                                                     **body}, timeout=120)
                assert r.status_code == 200, r.text
                d1 = srv.metric("llamajet:spec_decode_num_drafts_total")
                assert (d1 > d0) if opt else (d1 == d0), (path, opt)
        bad = httpx.post(srv.url + "/v1/chat/completions", json={"model": "test-model", "messages": REPEAT,
                                                                  "speculative": "sometimes"})
        assert bad.status_code == 400 and "speculative" in bad.json()["error"]["message"]
    finally:
        srv.close()


# ------------------------------------------------------------ when a proposal is worth its step


def _best_by_enumeration(base, cands, cost):
    """The reference for plan(): every combination of per-sequence counts, the one with the most
    expected tokens per second (expected tokens of k proposed at acceptance a: a + a^2 + ... + a^k)."""
    import itertools

    best, best_ks = base / cost(base), [0] * len(cands)
    for ks in itertools.product(*[range(k + 1) for _, k in cands]):
        tokens = base + sum(sum(a ** j for j in range(1, k + 1)) for (a, _), k in zip(cands, ks))
        rate = tokens / cost(base + sum(ks))
        if rate > best * (1 + 1e-12):
            best, best_ks = rate, list(ks)
    return best, best_ks


# step times (ms) measured on a quiet 2-core AVX2 Zen 1 (compute-bound decode: 1+1 tokens cost 1.66x) and
# a memory-bound shape (an AVX-512 VNNI core, where 1+8 tokens cost about 1.3x)
ZEN1 = {1: 8.16, 2: 13.5, 3: 19.0, 5: 30.6, 9: 54.8, 17: 105.0}
MEMBOUND = {1: 10.0, 2: 10.3, 3: 10.6, 5: 11.2, 9: 13.0, 17: 17.0}


@pytest.mark.parametrize("points", [ZEN1, MEMBOUND], ids=["compute-bound", "memory-bound"])
@pytest.mark.parametrize("cands,base", [
    ([(0.95, 8)], 1), ([(0.75, 8)], 1), ([(0.4, 8)], 1), ([(1.0, 8)], 1),
    ([(0.9, 4), (0.5, 4), (0.2, 3)], 3), ([(0.8, 3), (0.8, 3)], 16), ([(0.0, 5)], 1)])
def test_plan_is_the_best_combination(points, cands, base):
    from llamajet.engine.speculative import StepCost, plan

    cost = StepCost(points)
    ks = plan(base, cands, cost)
    best, _ = _best_by_enumeration(base, cands, cost)
    tokens = base + sum(sum(a ** j for j in range(1, k + 1)) for (a, _), k in zip(cands, ks))
    assert tokens / cost(base + sum(ks)) == pytest.approx(best, rel=1e-12)
    assert all(0 <= k <= n for k, (_, n) in zip(ks, cands))


def test_plan_follows_the_machine():
    """Where decode is memory-bound a 75%-accepted proposal is verified at length; on the compute-bound
    core only its first token pays, and a rejected-everything sequence or a batch of 16 verifies none."""
    from llamajet.engine.speculative import StepCost, plan

    assert plan(1, [(0.75, 8)], StepCost(MEMBOUND))[0] >= 6  # (the 8th, worth 0.75^8 = 0.1, does not pay)
    assert plan(1, [(0.75, 8)], StepCost(ZEN1)) == [1]
    assert plan(1, [(0.5, 8)], StepCost(ZEN1)) == [0]
    assert plan(1, [(0.0, 8)], StepCost(MEMBOUND)) == [0]
    # batch 16 on the compute-bound core: t(T) grows with T, so proposals must be nearly certain
    assert plan(16, [(0.75, 8)] * 16, StepCost(ZEN1)) == [0] * 16


def test_step_cost_interpolates_and_follows_observed_steps():
    from llamajet.engine.speculative import StepCost, plan

    c = StepCost({1: 10.0, 3: 14.0, 5: 30.0})
    assert c(1) == 10.0 and c(2) == 12.0 and c(4) == 22.0 and c(7) == 46.0  # between points; past the last two
    assert StepCost({2: 10.0})(4) == 20.0  # one point: proportional
    c.observe(2, 22.0)  # a T never seen starts at its prediction, then moves by EMA of the difference
    assert c(2) == pytest.approx(12.0 + c.EMA * 10.0)
    # the machine gets busy (another program on the core): 2-token steps now cost 1.9x a 1-token step;
    # after enough observed steps the plan stops verifying the proposal it verified before
    c = StepCost(MEMBOUND)
    assert plan(1, [(0.8, 1)], c) == [1]
    for _ in range(60):
        c.observe(1, 10.0)
        c.observe(2, 19.0)
    assert c.ratio(1, 1) == pytest.approx(1.9, rel=0.01)
    assert plan(1, [(0.8, 1)], c) == [0]
    # batches: 4 sequences' 4-token steps cost twice one sequence's 4-token step (4 contexts' attention);
    # the cells never observed at batch 4 (4 + k tokens) are predicted with that batch's factor, so the
    # cost of k proposed tokens at batch 4 keeps the measured shape instead of looking half as dear
    c = StepCost(ZEN1)
    for _ in range(80):
        c.observe(4, 2 * c.shape(4), batch=4)
    assert c.factor[4] == pytest.approx(2.0, rel=1e-3) and 1 not in c.factor
    assert c.ratio(4, 2, batch=4) == pytest.approx(c.shape(6) / c.shape(4), rel=1e-3)
    assert c(4, 1) == c.shape(4)  # batch 1 untouched


def test_probes_back_off_while_they_fail():
    """A sequence whose proposals the plan drops is verified at PROBE_ACCEPTANCE every probe_gap
    decisions; a failed probe doubles the gap (up to PROBE_GAP_MAX), a good one resets it."""
    import types

    from llamajet.engine.engine import Engine
    from llamajet.engine.speculative import SpecState, StepCost

    eng = types.SimpleNamespace(step_cost=StepCost(ZEN1), _spec_acc=0.0, _spec_rej=50.0)  # others reject
    seq = types.SimpleNamespace(spec=SpecState(8), draft=[])
    seq.spec.acc, seq.spec.rej = 0.0, 10.0  # this one too
    verified, gaps = [], []
    for step in range(200):
        seq.draft = [1] * 8
        Engine._plan_drafts(eng, 1, [seq])
        if seq.draft:
            verified.append(step)
            gaps.append(seq.spec.probe_gap)
            seq.spec.update(len(seq.draft), 0)  # the probe fails
    assert verified[:3] == [3, 3 + 8, 3 + 8 + 16]  # gaps 4, 8, 16, ...
    assert max(gaps) <= SpecState.PROBE_GAP_MAX and len(verified) < 12
    seq.spec.probe_gap, seq.spec.skipped = 8, 7
    seq.draft = [1] * 8
    Engine._plan_drafts(eng, 1, [seq])
    n = len(seq.draft)
    assert n == _best_by_enumeration(1, [(0.9, 8)], StepCost(ZEN1))[1][0] > 0  # what pays at 0.9 here
    seq.spec.update(n, n)  # accepted: probe again soon
    assert seq.spec.probe_gap == SpecState.PROBE_GAP
    # where even PROBE_ACCEPTANCE cannot pay (every extra token costs a whole step), no probe at all
    eng.step_cost = StepCost({1: 1.0, 2: 2.0, 3: 3.0})
    for _ in range(100):
        seq.draft = [1] * 8
        Engine._plan_drafts(eng, 1, [seq])
        assert seq.draft == []


def test_cost_model_in_the_engine(smollm2_gguf, pair):
    """The step-cost model is measured at start (steps of 1, 2, 3, ... tokens in blocks given back:
    nothing held or cached after); with a compute-bound cost nothing is verified on free-form text,
    with a memory-bound one the copying prompt verifies and accepts; the output is the same tokens."""
    from llamajet.engine.speculative import StepCost

    plain, _ = pair
    llm = LLM(smollm2_gguf, speculative="ngram", max_model_len=512, n_threads=2)
    eng = llm.engine
    assert sorted(eng.step_cost.t)[:3] == [1, 2, 3] and all(v > 0 for v in eng.step_cost.t.values())
    assert eng.step_cost.cells == {}  # the measurement is the shape; observed steps come after
    assert eng.stats.steps == 0 and eng.blocks.num_cached == 0
    _check_pool_empty(llm)
    p = SamplingParams(max_tokens=96, temperature=0)
    for name, points, verifies in (("free", {n: float(n) for n in (1, 2, 9)}, False), ("repeat", MEMBOUND, True)):
        eng.step_cost = StepCost(points)
        eng.step_cost.EMA = 0.0  # this test's machine, not the one running it
        st = eng.stats
        before = (st.spec_draft_tokens, st.spec_accepted_tokens)
        ids = _ids(plain, CONVS[name])
        assert llm.generate(ids, p)[0].token_ids == plain.generate(ids, p)[0].token_ids
        if verifies:
            assert st.spec_accepted_tokens - before[1] >= 20
        else:
            assert st.spec_draft_tokens == before[0]
        _check_pool_empty(llm)


# ------------------------------------------------------------ suffix decoding


def test_suffix_index_counts_what_followed_each_context():
    """SuffixIndex against counting by scan; adding with sign -1 takes a list back out."""
    import random

    from llamajet.engine.speculative import SuffixIndex

    rng = random.Random(0)
    lists = [[rng.randrange(6) for _ in range(rng.randrange(1, 40))] for _ in range(8)]
    ix = SuffixIndex(depth=3)
    for ids in lists:
        ix.add(ids, 0)
    ref = {}
    for ids in lists:
        for p in range(1, len(ids)):
            for n in range(1, min(3, p) + 1):
                d = ref.setdefault(tuple(ids[p - n:p]), {})
                d[ids[p]] = d.get(ids[p], 0) + 1
    assert ix.next == ref
    n, d = ix.longest([9, 9] + lists[0][:2])
    assert n == 2 and d == ref[tuple(lists[0][:2])]
    for ids in lists:
        ix.add(ids, 0, sign=-1)
    assert ix.next == {}


def _seq(ids, max_tokens=64, num_prompt=None):
    from llamajet.engine.sequence import Sequence

    s = Sequence(list(ids), SamplingParams(max_tokens=max_tokens))
    if num_prompt is not None:  # the tokens after num_prompt as output
        s.num_prompt = num_prompt
    return s


def test_suffix_proposals_follow_the_most_frequent_continuation():
    from llamajet.engine.speculative import SuffixProposer

    sp = SuffixProposer(k=8)
    # in its own tokens: after (1, 2) came 3 three times and 4 once; after (2, 3), 5
    seq = _seq([1, 2, 3, 5, 1, 2, 3, 5, 1, 2, 4, 6, 1, 2, 3, 5, 7, 1, 2])
    got = sp.propose(seq)
    assert got[:2] == [3, 5]  # (1, 2) -> 3 (3 of 4), then (2, 3) -> 5 (3 of 3)
    # the confidence is the product of the continuations' frequencies: it stops below 0.1
    sp2 = SuffixProposer(k=8, min_prob=0.7)
    assert sp2.propose(_seq(seq.token_ids)) == [3, 5]  # 0.75, 0.75 x 1; then (3, 5) -> 1 or 7: 0.75 x 2/3 < 0.7
    # recent requests' outputs: a finished sequence's output is proposed to a new one with the same context
    sp3 = SuffixProposer(k=4)
    done = _seq([10, 11, 12, 20, 21, 22, 23, 24], num_prompt=3)
    sp3.finished(done)
    assert sp3.propose(_seq([30, 11, 12])) == [20, 21, 22, 23]
    # the cache is bounded: older outputs are taken back out
    sp4 = SuffixProposer(k=4, max_cached_tokens=6)
    sp4.finished(done)  # 5 output tokens
    sp4.finished(_seq([40, 41, 42, 43], num_prompt=2))  # 2 more: the first is evicted
    assert sp4.propose(_seq([30, 11, 12])) == [] and sp4.recent.longest([41])[1] == {42: 1}


def test_suffix_decoding_learns_from_recent_requests(suffix, pair):
    """An agent-like loop: the same request again. The second time the proposals come from the first
    reply (the recent-outputs cache) and are accepted nearly whole; the output is the same tokens."""
    plain, _ = pair
    ids = _ids(plain, FREE)
    p = SamplingParams(max_tokens=64, temperature=0)
    st = suffix.engine.stats
    a = suffix.generate(ids, p)[0]
    acc1 = st.spec_accepted_tokens
    b = suffix.generate(ids, p)[0]
    acc2 = st.spec_accepted_tokens - acc1
    assert a.token_ids == b.token_ids == plain.generate(ids, p)[0].token_ids
    assert acc2 >= 0.8 * (len(b.token_ids) - 1), (acc1, acc2, len(b.token_ids))
    _check_pool_empty(suffix)


# ------------------------------------------------------------ draft models


def test_the_model_drafting_for_itself_is_always_right(smollm2_gguf, pair):
    """draft:PATH with the model's own file: the draft computes the rows the target does (same
    kernels, same bits), so every proposal is accepted, and the draft computes each prompt token
    once (afterwards only the tokens accepted since its last proposal and its own proposals)."""
    plain, _ = pair
    llm = LLM(smollm2_gguf, speculative=f"draft:{smollm2_gguf}", speculative_cost_model=False,
              max_model_len=512, n_threads=2)
    ids = _ids(plain, FREE)
    p = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    out = llm.generate(ids, p)[0]
    assert out.token_ids == plain.generate(ids, p)[0].token_ids
    st, pr = llm.engine.stats, llm.engine.proposer
    assert st.spec_draft_tokens > 50 and st.spec_accepted_tokens == st.spec_draft_tokens
    assert st.steps <= 1 + 100 // 4  # prefill, then up to 1 + 8 tokens a step
    # the draft's tokens: the prompt and the first sampled token once, then per verification of k
    # tokens the k - 1 proposals before the last (whose K/V the next proposal's row needs), and at each
    # later proposal the 2 known tokens after them (the last proposal, accepted, and the target's own)
    D, R = st.spec_draft_tokens, st.spec_drafts
    assert pr.tokens == (len(ids) + 1) + (D - R) + 2 * (R - 1) and pr.proposed == D
    _check_pool_empty(llm)


def test_draft_refusals(smollm2_gguf, stories_hf):
    from llamajet.errors import RequestError

    with pytest.raises(RequestError, match="vocabulary has 512 ids"):
        LLM(smollm2_gguf, speculative=f"draft:{stories_hf}", max_model_len=128)
    with pytest.raises(RequestError, match="1..29 of the model's 30 layers"):
        LLM(smollm2_gguf, speculative="layers:30", max_model_len=128)
    for bad in ("draft:", "layers:x", "medusa"):
        with pytest.raises(RequestError, match="speculative"):
            LLM(smollm2_gguf, speculative=bad, max_model_len=128)


def test_draft_computes_only_what_the_plan_verifies(smollm2_gguf, pair):
    """With the cost model a draft model's tokens are planned before it runs (their own cost added:
    draft_cost, measured at start): where nothing pays the draft computes nothing at all; where
    steps are nearly free and the draft cheap, it proposes and the target verifies all it computed."""
    from llamajet.engine.speculative import StepCost

    plain, _ = pair
    llm = LLM(smollm2_gguf, speculative="layers:10", max_model_len=512, n_threads=2)
    eng, pr = llm.engine, llm.engine.proposer
    assert eng.draft_cost is not None and eng.draft_cost > 0
    ids = _ids(plain, CODE)
    p = SamplingParams(max_tokens=48, temperature=0)
    eng.step_cost = StepCost({n: float(n) for n in (1, 2, 9)})  # every token a whole step: nothing pays
    eng.step_cost.EMA = 0.0
    assert llm.generate(ids, p)[0].token_ids == plain.generate(ids, p)[0].token_ids
    assert pr.tokens == 0 and pr.steps == 0 and eng.stats.spec_draft_tokens == 0
    eng.step_cost = StepCost(MEMBOUND)
    eng.step_cost.EMA = 0.0
    eng.draft_cost = 1e-6  # and a draft that costs nothing
    assert llm.generate(ids, p)[0].token_ids == plain.generate(ids, p)[0].token_ids
    assert pr.proposed > 0 and eng.stats.spec_draft_tokens == pr.proposed
    _check_pool_empty(llm)
