"""lm-evaluation-harness (its own request code) against `llamajet serve`.

`local-completions` scores a multiple-choice task by sending token-id
prompts with echo, logprobs 1 and max_tokens 1, summing the continuation's
prompt logprobs and reading top_logprobs for is_greedy. Its tokenizer is the
server's own (`tokenizer_backend=remote`: /tokenizer_info, /tokenize,
/detokenize), so nothing is fetched from a hub. The reference is
`LLM.logits` on the same ids, a separate code path (Engine.logits: its own
blocks, no prefix cache, every row computed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")

DATA = Path(__file__).resolve().parent / "data" / "lm_eval"
M = "test-model"
N_CLOZE = 16  # items in cloze.jsonl: 64 scoring requests, every label position among the answers

CLOZE = """task: llamajet_cloze
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
"""

SAY = """task: llamajet_say
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def srv(default_server):
    """The session's shared default-model server (conftest.py: context 1024, 8 sequences)."""
    return default_server


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm_eval_tasks")
    (d / "cloze.yaml").write_text(CLOZE.format(path=DATA / "cloze.jsonl"))
    (d / "say.yaml").write_text(SAY.format(path=DATA / "say.jsonl"))
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # the json builder reads the local file; nothing is fetched
    os.environ["HF_HUB_OFFLINE"] = "1"
    return d


def _manager(tasks: Path):
    from lm_eval.tasks import TaskManager

    # only our two tasks: indexing lm-eval's thousands of built-in ones takes ~8 s per manager
    return TaskManager(include_path=str(tasks), include_defaults=False)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def test_local_completions_scores_equal_llm_logits(srv, tasks):
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model

    lm = get_model("local-completions")(base_url=srv.url + "/v1/completions", model=M,
                                         tokenizer_backend="remote", num_concurrent=1, max_retries=1,
                                         tokenized_requests=True)
    eng = srv.llm.engine
    tokens0, generated0 = eng.stats.tokens, eng.stats.generated
    out = simple_evaluate(model=lm, tasks=["llamajet_cloze"], task_manager=_manager(tasks),
                          log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                          fewshot_random_seed=0)
    samples = out["samples"]["llamajet_cloze"]
    assert len(samples) == N_CLOZE
    n_prompt = 0
    correct = 0
    worst = 0.0
    for s in samples:
        refs = []
        for (ctx, cont), resp in zip(s["arguments"], s["resps"]):
            ll, greedy = resp[0]  # what lm-eval parsed from our answer
            c_ids, k_ids = lm._encode_pair(ctx, cont)  # lm-eval's own split, through our /tokenize
            ids = c_ids + k_ids
            n_prompt += len(ids)
            ls = _log_softmax(srv.llm.logits(ids))
            rows = [ls[len(c_ids) + j - 1] for j in range(len(k_ids))]
            ref = sum(float(r[t]) for r, t in zip(rows, k_ids))
            worst = max(worst, abs(ref - float(ll)))
            assert bool(greedy) == all(int(np.argmax(r)) == t for r, t in zip(rows, k_ids))
            refs.append(ref)
        correct += int(np.argmax(refs)) == s["doc"]["label"]
    assert worst <= 1e-4, worst  # the same rows: bit-equal in fact (the kernels' invariant), 1e-4 as asked
    assert out["results"]["llamajet_cloze"]["acc,none"] == pytest.approx(correct / N_CLOZE)
    # every prompt token computed exactly once per request (no second pass, no prefix-cache gap):
    # each request is a prompt of len(ids) tokens and one sampled (never computed) token
    assert eng.stats.tokens - tokens0 == n_prompt
    assert eng.stats.generated - generated0 == sum(len(s["arguments"]) for s in samples)


def test_local_chat_completions_generates_what_the_server_generates(srv, tasks):
    from lm_eval import simple_evaluate

    out = simple_evaluate(model="local-chat-completions",
                          model_args=f"base_url={srv.url}/v1/chat/completions,model={M},num_concurrent=1,"
                                     "max_retries=1",
                          tasks=["llamajet_say"], task_manager=_manager(tasks),
                          apply_chat_template=True, log_samples=True)
    samples = out["samples"]["llamajet_say"]
    assert len(samples) == 6
    from llamajet import SamplingParams

    for s in samples:
        got = s["resps"][0][0]
        msgs = json.loads(s["arguments"][0][0][0])  # (chat history as JSON,), gen_kwargs
        ref = srv.llm.chat(msgs, SamplingParams(max_tokens=12, temperature=0, stop=("\n",)))[0]
        assert got == ref.text, (got, ref.text)
    assert 0.0 <= out["results"]["llamajet_say"]["exact_match,none"] <= 1.0
