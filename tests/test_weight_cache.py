"""The repacked-weights cache (RuntimeConfig.weight_cache, loaders/cache.py):
a GGUF's packed twins written once as a saved model, mapped afterwards."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from llamajet import LLM
from llamajet.errors import RequestError
from llamajet.formats import convert, saved
from llamajet.engine import outliers, runner
from llamajet.loaders import cache

IDS = [1, 504, 3300, 42, 7, 900, 12, 5]


@pytest.fixture(scope="module")
def gguf_copy(smollm2_gguf, tmp_path_factory):
    """The default model's GGUF (Q4_1 matrices, a Q8_0 embedding), copied so its mtime can be changed."""
    p = tmp_path_factory.mktemp("wc") / "model.gguf"
    shutil.copyfile(smollm2_gguf, p)
    return p


@pytest.fixture(scope="module")
def plain_logits(gguf_copy):
    return LLM(gguf_copy, max_model_len=64, n_threads=2, kv_dtype="f32").logits(IDS)


def test_first_load_writes_the_entry_and_later_loads_map_it(gguf_copy, plain_logits, tmp_path, monkeypatch):
    root = tmp_path / "cache"
    first = LLM(gguf_copy, max_model_len=64, n_threads=2, kv_dtype="f32", weight_cache=str(root))
    entry = cache.entry_path(root, gguf_copy)
    assert first.cache_entry == entry and (entry / saved.META_FILE).is_file()
    assert [p.name for p in root.iterdir()] == [entry.name]  # the temporary folder is gone
    # the entry holds the twins the GGUF load makes: the same logits, bit for bit
    np.testing.assert_array_equal(first.logits(IDS), plain_logits)

    # a second load repacks nothing: the deferred GGUF repack and the quantizer are made impossible
    def refuse(*a, **k):
        raise AssertionError("a cached load must not repack or quantize")
    monkeypatch.setattr(convert, "deferred_twin", refuse)
    monkeypatch.setattr(convert.ops, "quantize_packed", refuse)
    # nor runs the outlier probe: the first load kept the channels and columns it found in the entry
    plans = list(entry.glob("outliers-*.npz"))
    assert len(plans) == 1 and outliers.saved_plan(plans[0]) is not None
    monkeypatch.setattr(runner.find_outliers, "input_absmax", refuse)
    second = LLM(gguf_copy, max_model_len=64, n_threads=2, kv_dtype="f32", weight_cache=str(root))
    assert second.cache_entry == entry and second.model.gguf_reader is None
    assert any(l.startswith("outliers:") for l in second.engine.runner.fusion_log)
    np.testing.assert_array_equal(second.logits(IDS), plain_logits)
    # the tokenizer came from the entry's files and behaves as the GGUF's
    text = "Hello world! It's 2024: ünïcödé"
    assert second.tokenizer.encode(text) == first.tokenizer.encode(text)
    assert second.tokenizer.chat_template == first.tokenizer.chat_template
    assert second.tokenizer.stop_ids == first.tokenizer.stop_ids


def test_a_changed_file_gets_a_new_entry(gguf_copy, tmp_path):
    root = tmp_path / "cache"
    a = cache.entry_path(root, gguf_copy)
    st = gguf_copy.stat()
    try:
        os.utime(gguf_copy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        b = cache.entry_path(root, gguf_copy)
    finally:
        os.utime(gguf_copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert a != b and a.parent == b.parent == root
    assert cache.entry_path(root, gguf_copy) == a


def test_an_interrupted_write_leaves_no_entry(gguf_copy, tmp_path, monkeypatch):
    root = tmp_path / "cache"

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(saved, "write_meta", full_disk)  # fails after the weights file is written
    with pytest.warns(UserWarning, match="cannot write"):
        llm = LLM(gguf_copy, max_model_len=64, n_threads=2, weight_cache=str(root))
    assert llm.cache_entry is None and llm.model.gguf_reader is not None  # loaded from the GGUF
    assert cache.lookup(root, gguf_copy) is None and list(root.iterdir()) == []  # nothing half-written left


def test_files_the_cache_does_not_take_load_as_always(stories_gguf, tmp_path):
    # stories260K's GGUF has float matrices, which the loader converts at load: no entry
    root = tmp_path / "cache"
    llm = LLM(stories_gguf, max_model_len=64, n_threads=2, weight_cache=str(root))
    assert llm.cache_entry is None and not root.exists()
    assert cache.cacheable(llm.model) is not None


def test_options_that_change_the_weights_bypass_the_cache(gguf_copy, tmp_path):
    root = tmp_path / "cache"
    for opts in ({"kernels": "reference"}, {"quantize": "int8_g32"}):
        llm = LLM(gguf_copy, max_model_len=64, n_threads=2, weight_cache=str(root), **opts)
        assert llm.cache_entry is None
    assert not root.exists()


def test_weight_cache_option_is_checked():
    with pytest.raises(RequestError, match="weight_cache"):
        LLM(None, weight_cache="")


def test_an_unreadable_outlier_plan_is_probed_again(gguf_copy, plain_logits, tmp_path):
    root = tmp_path / "cache"
    LLM(gguf_copy, max_model_len=64, n_threads=2, kv_dtype="f32", weight_cache=str(root))
    (plan,) = cache.entry_path(root, gguf_copy).glob("outliers-*.npz")
    plan.write_bytes(b"not an npz")
    assert outliers.saved_plan(plan) is None
    llm = LLM(gguf_copy, max_model_len=64, n_threads=2, kv_dtype="f32", weight_cache=str(root))
    np.testing.assert_array_equal(llm.logits(IDS), plain_logits)
    assert outliers.saved_plan(plan) is not None  # written again by that load
