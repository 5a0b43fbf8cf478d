"""`llamajet eval`: the float configuration's perplexity against transformers' on the same windows,
and the other configurations ordered as their precision."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from llamajet.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_eval_scores_configs_on_the_same_windows(stories_hf, tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from llamajet.eval.perplexity import corpus_windows
    from llamajet.tokenizer import load_tokenizer

    text = tmp_path / "text.txt"
    text.write_text(("Once upon a time there was a little girl named Lily. She liked to play in the park "
                     "with her dog, and one day she found a shiny red ball under a tree. ") * 40)
    out = tmp_path / "r.json"
    assert main(["eval", "--model", str(stories_hf), "--text", str(text), "--scheme", "int8_g32,int4_sym_g32",
                 "--ctx", "128", "--windows", "3", "--json", str(out)]) == 0
    r = {x["config"]: x for x in json.loads(out.read_text())["results"]}
    assert list(r) == ["float", "default", "int8_g32", "int4_sym_g32"]
    # the float configuration's perplexity is transformers' on the same windows (fp32 both)
    tok = load_tokenizer(stories_hf)
    windows = corpus_windows(tok, text.read_text(), 128, 3)
    hf = AutoModelForCausalLM.from_pretrained(stories_hf, torch_dtype=torch.float32).eval()
    nll, n = 0.0, 0
    with torch.no_grad():
        for w in windows:
            lp = torch.log_softmax(hf(torch.tensor([w])).logits[0, :-1].double(), -1)
            nll -= float(lp[torch.arange(len(w) - 1), torch.tensor(w[1:])].sum())
            n += len(w) - 1
    assert r["float"]["tokens"] == n
    assert r["float"]["ppl"] == pytest.approx(np.exp(nll / n), rel=1e-4)
    assert r["float"]["kl"] == 0 and r["float"]["top1"] == 1
    assert 0 < r["int8_g32"]["kl"] < r["int4_sym_g32"]["kl"]
    # int4 g32: 4 bits + an fp16 scale per 32 = 4.5, plus the 16-row tiles' padding
    assert 4.5 <= r["int4_sym_g32"]["bits_per_weight"] < r["int8_g32"]["bits_per_weight"] < 32
    assert r["float"]["bits_per_weight"] == 32
    # single-stream speed of every configuration, the float reference included, timed on other text
    for name in ("float", "default", "int8_g32", "int4_sym_g32"):
        assert r[name]["prefill_tok_s"] > 0 and r[name]["decode_tok_s"] > 0


def test_eval_needs_a_text(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--text", str(tmp_path / "missing.txt")])
