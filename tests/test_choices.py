"""Engine features the OpenAI API needs: n > 1 choices sharing one prompt's
KV blocks, logprobs, presence/frequency penalties, logit bias, constraints.

References: transformers' logits (for logprobs), the OpenAI formula for the
penalties, and the block pool's own reference counts."""

from __future__ import annotations

import numpy as np
import pytest

from llamajet import LLM, RequestError, SamplingParams
from llamajet.engine.sampling import Sampler, log_softmax

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def llm(stories_hf):
    # fp32 weights (quantize="none") so the logits follow transformers' closely
    return LLM(stories_hf, quantize="none", max_num_seqs=8, enable_prefix_caching=False)


def _prompt(llm) -> list[int]:
    return llm.tokenizer.encode("Once upon a time there was a little girl named Lily. She")


def test_n_choices_compute_the_prompt_once_and_share_its_blocks(llm):
    eng = llm.engine
    ids = _prompt(llm)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=3)
    seq = eng.new_sequence(ids, params)
    group = [seq, *seq.forks]
    assert len(group) == 3 and [s.index for s in group] == [0, 1, 2]
    tokens_before = eng.stats.tokens
    eng.add_request(seq)
    eng.step()  # the prompt, computed once; the children fork at the first draw
    assert eng.stats.tokens - tokens_before == len(ids)
    assert all(s.status.name == "RUNNING" for s in group)
    bs = eng.blocks.block_size
    full = len(ids) // bs
    heads = [s.block_table[:full] for s in group]
    assert heads[0] == heads[1] == heads[2]  # the prompt's full blocks are shared ...
    for bid in heads[0]:
        assert eng.blocks.blocks[bid].ref_count == 3  # ... held once by each choice
    eng.blocks.check([s.block_table for s in group])
    eng.step()  # each choice writes its own next token: copy-on-write of the shared partial block
    assert eng.stats.tokens - tokens_before == len(ids) + 3
    if len(ids) % bs:
        tails = {s.block_table[full] for s in group}
        assert len(tails) == 3  # the partial block was copied for the writers
    eng.blocks.check([s.block_table for s in group])
    eng.run_all(group)
    assert eng.blocks.num_used == 0
    outs = [s.token_ids[len(ids):] for s in group]
    assert all(1 <= len(o) <= 6 for o in outs)
    assert len({tuple(o) for o in outs}) > 1  # independent draws (seeded (3, i))


def test_n_choices_are_reproducible_with_a_seed(llm):
    async def run(seed):
        out = {}
        async for ev in llm.async_engine.stream(_prompt(llm), SamplingParams(max_tokens=8, seed=seed, n=3)):
            if ev.token_id is not None:
                out.setdefault(ev.index, []).append(ev.token_id)
        return out

    import asyncio

    a, b, c = asyncio.run(run(11)), asyncio.run(run(11)), asyncio.run(run(12))
    assert a == b and sorted(a) == [0, 1, 2]
    assert a != c
    # choice 0 of n = 3 draws what n = 1 with the same seed draws
    one = llm.generate([_prompt(llm)], SamplingParams(max_tokens=8, seed=11))[0].token_ids
    assert a[0] == one


def test_n_is_bounded_by_the_batch(llm):
    with pytest.raises(RequestError, match="max_num_seqs"):
        llm.engine.new_sequence(_prompt(llm), SamplingParams(n=9))
    with pytest.raises(RequestError, match="n="):
        SamplingParams(n=17)


def test_logprobs_are_the_models_log_softmax_vs_transformers(llm, stories_hf):
    from transformers import AutoModelForCausalLM

    ids = _prompt(llm)
    seq = llm.engine.new_sequence(ids, SamplingParams(max_tokens=5, temperature=0, logprobs=4))
    llm.engine.run_all([seq])
    evs = [e for e in seq.events if e.token_id is not None]
    out = [e.token_id for e in evs]
    hf = AutoModelForCausalLM.from_pretrained(stories_hf, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids + out])).logits[0].double(), -1).numpy()
    for k, e in enumerate(evs):
        row = ref[len(ids) - 1 + k]
        # fp32 engine vs fp32 transformers: logits agree to ~1e-5 relative
        assert e.logprob == pytest.approx(row[e.token_id], abs=1e-3)
        assert len(e.top_logprobs) == 4
        top_ref = np.argsort(-row, kind="stable")[:4]
        assert [i for i, _ in e.top_logprobs][0] == top_ref[0] == e.token_id  # greedy takes the best
        assert {i for i, _ in e.top_logprobs} == set(top_ref.tolist())
        lps = [lp for _, lp in e.top_logprobs]
        assert lps == sorted(lps, reverse=True)


def test_presence_and_frequency_penalties_follow_openais_formula():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=50).astype(np.float32)
    prompt, output = [1, 2, 3], [5, 5, 7, 5, 9]
    p = SamplingParams(temperature=1.0, presence_penalty=0.7, frequency_penalty=0.4)
    got = Sampler(p).penalized(logits, prompt + output, num_prompt=len(prompt))
    # https://platform.openai.com/docs/advanced-usage: mu[j] -= c[j] * a_freq + (c[j] > 0) * a_pres,
    # c[j] = times token j was sampled so far (the prompt does not count)
    want = logits.astype(np.float64).copy()
    for j in set(output):
        c = output.count(j)
        want[j] -= c * 0.4 + 0.7
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_logit_bias_moves_the_greedy_choice(llm):
    ids = _prompt(llm)
    plain = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0))[0].token_ids[0]
    target = (plain + 17) % llm.config.vocab_size
    biased = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, logit_bias={target: 100}))
    assert biased[0].token_ids == [target]
    banned = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, logit_bias={plain: -100}))
    assert banned[0].token_ids[0] != plain
    with pytest.raises(RequestError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101})


class _OnlyEven:
    """A toy Constraint: only even token ids, done after 4 tokens."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def allowed(self, vocab_size):
        m = np.zeros(vocab_size, bool)
        m[::2] = True
        return m

    def consume(self, t):
        self.seen.append(t)

    def is_done(self):
        return len(self.seen) >= 4

    def copy(self):
        c = _OnlyEven()
        c.seen = list(self.seen)
        return c


def test_a_constraint_masks_every_draw_and_ends_the_sequence(llm):
    c = _OnlyEven()
    seq = llm.engine.new_sequence(_prompt(llm), SamplingParams(max_tokens=50, temperature=1.0, seed=1,
                                                               ignore_eos=True), c)
    llm.engine.run_all([seq])
    out = seq.token_ids[seq.num_prompt:]
    assert out == c.seen and len(out) == 4 and all(t % 2 == 0 for t in out)
    assert seq.finish_reason == "stop"


def test_log_softmax_matches_torch():
    x = np.random.default_rng(1).normal(size=1000) * 30
    np.testing.assert_allclose(log_softmax(x), torch.log_softmax(torch.tensor(x), -1).numpy(), atol=1e-12)
