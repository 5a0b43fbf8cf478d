"""Every fuzz seed and regression input (tests/fuzz/corpus/<target>/) through its
target, in the normal suite: an input a fuzz campaign once crashed on stays fixed.

The targets (tests/fuzz/targets.py) raise on anything but acceptance or one of
llamajet's own errors; the last test shows that check can fail.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "fuzz"))
import targets  # noqa: E402

CASES = sorted((t, f) for t in targets.TARGETS for f in (targets.CORPUS / t).iterdir()) if targets.CORPUS.is_dir() else []


def test_every_target_has_seeds():
    assert {t for t, _ in CASES} == set(targets.TARGETS)


@pytest.mark.parametrize("target,path", CASES, ids=[f"{t}/{f.name}" for t, f in CASES])
def test_corpus_input(target, path):
    targets.TARGETS[target](path.read_bytes())


def test_seeds_reach_the_parsers_deep_end():
    """The seeds are valid inputs, not only refusals: the model seeds load, the
    templates render, the server answers 200 (so mutations start from the deep end)."""
    from llamajet.loaders import load_model
    from llamajet.tokenizer import load_tokenizer
    from llamajet.tokenizer.chat import render

    for f in (targets.CORPUS / "gguf").iterdir():
        assert load_model(f).config.num_layers == 1
    for f in (targets.CORPUS / "gguf_vocab").iterdir():
        assert load_tokenizer(f).vocab_size in (510, 512)  # the trained BPE, stories260K's
    assert load_model(targets.FIXTURES / "hf").config.num_layers == 1
    assert load_model(targets.FIXTURES / "saved").config.num_layers == 1
    text = render((targets.CORPUS / "chat_template" / "tools.jinja").read_bytes().split(b"\0")[0].decode(),
                  targets._MESSAGES, tools=targets._TOOLS, add_generation_prompt=True)
    assert "get_weather" not in text and '"add"' in text and text.endswith("assistant:")
    r = targets._client().post("/v1/chat/completions", content=(targets.CORPUS / "server" / "chat.bin").read_bytes()[1:])
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    for name in ("responses.bin", "messages.bin", "count-tokens.bin", "embeddings.bin"):  # each family's route
        data = (targets.CORPUS / "server" / name).read_bytes()
        path = targets._ENDPOINTS[data[0] % len(targets._ENDPOINTS)]
        r = targets._client().post(path, content=targets._cap(data[1:], path))
        assert r.status_code == 200, (name, r.text)


def test_an_unexpected_exception_is_a_finding(monkeypatch):
    """A parser failing with anything but a LlamajetError escapes the target (a crash to the fuzzer)."""
    import llamajet.loaders

    def broken(path):
        raise IndexError("deep in the parser")

    monkeypatch.setattr(llamajet.loaders, "load_model", broken)
    with pytest.raises(IndexError):
        targets.gguf_file((targets.CORPUS / "gguf" / "tiny-q8_0.gguf").read_bytes())


def test_a_server_error_is_a_finding(monkeypatch):
    """A handler failing inside the server (a 500 with its error JSON) fails the target."""
    llm = targets._client().app.state.llamajet.llm

    def boom(*a, **k):
        raise RuntimeError("a bug")

    monkeypatch.setattr(llm.tokenizer, "encode", boom)
    with pytest.raises(AssertionError, match="500"):
        targets.server_request(bytes([2]) + b'{"prompt": "Hello"}')
