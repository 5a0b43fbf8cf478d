"""Sampling against HF transformers' logits processors (the reference)."""

from __future__ import annotations

import numpy as np
import pytest

from llamajet import RequestError, SamplingParams
from llamajet.engine.sampling import Sampler

torch = pytest.importorskip("torch")
gen_utils = pytest.importorskip("transformers.generation.logits_process")


def _hf_probs(logits: np.ndarray, history: list[int], p: SamplingParams) -> np.ndarray:
    """The distribution HF `generate` samples from, with the same processors in
    the same order: repetition penalty, temperature, top-k, top-p, min-p."""
    procs = []
    if p.repetition_penalty != 1.0:
        procs.append(gen_utils.RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    procs.append(gen_utils.TemperatureLogitsWarper(p.temperature))
    if p.top_k:
        procs.append(gen_utils.TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        procs.append(gen_utils.TopPLogitsWarper(p.top_p))
    if p.min_p > 0.0:
        procs.append(gen_utils.MinPLogitsWarper(p.min_p))
    ids = torch.tensor([history], dtype=torch.long)
    scores = torch.tensor(logits[None], dtype=torch.float64)
    for proc in procs:
        scores = proc(ids, scores)
    return torch.softmax(scores, dim=-1)[0].numpy()


CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=20),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.05),
    SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.02, repetition_penalty=1.3),
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}-r{p.repetition_penalty}")
def test_distribution_equals_transformers(params):
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, size=500)
    history = rng.integers(0, 500, size=40).tolist()
    ours = Sampler(params).probs(logits, history)
    ref = _hf_probs(logits, history, params)
    # float64 on both sides, same operations: agreement to rounding (1e-12).
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-12)


def test_greedy_is_argmax_after_penalty():
    logits = np.array([1.0, 5.0, 4.9, -2.0])
    assert Sampler(SamplingParams(temperature=0))(logits, []) == 1
    # token 1 seen: 5.0 / 1.1 = 4.55 < 4.9
    assert Sampler(SamplingParams(temperature=0, repetition_penalty=1.1))(logits, [1]) == 2


def test_seed_reproducible_and_draws_follow_the_distribution():
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 1, size=8)
    p = SamplingParams(temperature=1.0, seed=1234)
    a = [Sampler(p)(logits, []) for _ in range(3)]
    s1, s2 = Sampler(p), Sampler(p)
    draws1 = [s1(logits, []) for _ in range(4000)]
    draws2 = [s2(logits, []) for _ in range(4000)]
    assert draws1 == draws2 and len(set(a)) == 1
    freq = np.bincount(draws1, minlength=8) / 4000
    probs = Sampler(p).probs(logits, [])
    # binomial standard error sqrt(p(1-p)/n) <= 0.008; 5 sigma keeps this
    # deterministic test far from a false alarm while catching a wrong law.
    assert np.all(np.abs(freq - probs) < 5 * np.sqrt(probs * (1 - probs) / 4000) + 1e-9)


@pytest.mark.parametrize("kwargs", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0.0),
                                    dict(top_p=1.5), dict(min_p=2.0), dict(top_k=-1),
                                    dict(repetition_penalty=0.0), dict(stop=("",))])
def test_bad_params_are_clear_errors(kwargs):
    with pytest.raises(RequestError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)
