"""`llamajet quantize`'s defaults (issue 45 item 3): re-quantization refused without
--allow-requantize, the embedding / head kept at 8 bits (or their source type) under a
4-bit scheme on the CLI and at load, GPTQ's act-order on by default, and calibration on
text the model writes itself when no --calib is given, the same for a seed.

The quality targets these defaults are for (PPL on WikiText-2) are measured by
benchmarks/quant_defaults.py, not here (minutes of GPTQ on the default model)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from llamajet import LLM
from llamajet.errors import LlamajetError
from llamajet.loaders import load_model
from llamajet.quant.quantize import quantize_model


def _cli(*args, check=True):
    r = subprocess.run([sys.executable, "-m", "llamajet", *map(str, args)], capture_output=True, text=True,
                       timeout=600)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def _weights_bytes(folder) -> bytes:
    return (folder / "model.safetensors").read_bytes()


# --- re-quantization ---------------------------------------------------------------------------


def test_requantizing_gguf_blocks_is_refused_and_allowed_with_the_flag(smollm2_gguf, tmp_path):
    out = tmp_path / "q"
    with pytest.raises(LlamajetError) as e:
        quantize_model(smollm2_gguf, out, "int4_sym_g128")
    msg = str(e.value)
    # what is lost, what to do instead, and the flag
    assert "210 of its 211 matrices are already quantized (q4_1" in msg
    assert "--scheme keep" in msg and "int4_asym_g32, their lossless twin" in msg and "--allow-requantize" in msg
    assert not out.exists()  # refused before anything was written (and before any calibration)
    # the same through the CLI: exit 2, the message, no traceback
    r = _cli("quantize", smollm2_gguf, out, "--scheme", "int4_sym_g128", check=False)
    assert r.returncode == 2 and "already quantized" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()
    s = quantize_model(smollm2_gguf, out, "int4_sym_g128", allow_requantize=True)
    # the Q8_0 embedding (the tied head) is not rounded again: repacked without loss
    assert s.counts == {"RTN q4_1->int4_sym_g128": 210, "repacked losslessly (q8_0->int8_g32)": 1,
                        "norms (f32)": 61}


def test_lossless_conversions_need_no_flag(smollm2_gguf, tmp_path):
    # the lossless twin of every block type in the file, and keep
    s = quantize_model(smollm2_gguf, tmp_path / "twin", "int4_asym_g32")
    assert s.counts == {"repacked losslessly (q4_1->int4_asym_g32)": 210,
                        "repacked losslessly (q8_0->int8_g32)": 1, "norms (f32)": 61}
    quantize_model(smollm2_gguf, tmp_path / "keep", "keep")
    assert _weights_bytes(tmp_path / "twin") == _weights_bytes(tmp_path / "keep")


def test_requantizing_a_saved_scheme_is_refused(stories_hf, tmp_path):
    quantize_model(stories_hf, tmp_path / "a", "int4_sym_g32")  # float -> int4: no flag needed
    with pytest.raises(LlamajetError, match=r"35 of its 36 matrices are already quantized \(pk_i4s"):
        quantize_model(tmp_path / "a", tmp_path / "b", "int4_asym_g64")
    # the embedding is int8_g32 there: an int8 scheme would round it again too
    with pytest.raises(LlamajetError, match=r"36 of its 36 matrices are already quantized \(pk_i4s, pk_i8"):
        quantize_model(tmp_path / "a", tmp_path / "b", "int8_pc")
    # its own scheme is a copy, not a re-quantization
    s = quantize_model(tmp_path / "a", tmp_path / "c", "int4_sym_g32")
    assert set(s.counts) == {"copied packed (int4_sym_g32)", "copied packed (int8_g32)", "norms (f32)"}, s.counts
    s = quantize_model(tmp_path / "a", tmp_path / "d", "int4_asym_g64", allow_requantize=True)
    assert s.counts["re-quantized int4_sym_g32->int4_asym_g64"] == 35


# --- embedding and head --------------------------------------------------------------------------


def _head_scheme(folder) -> str:
    return load_model(folder).weights["token_embd"].scheme.name


@pytest.mark.parametrize("scheme,embed,want", [("int4_sym_g32", None, "int8_g32"),     # float table -> int8
                                               ("int4_asym_g64", None, "int8_g32"),
                                               ("int8_pc", None, "int8_pc"),          # >= 8 bits: the scheme
                                               ("int4_sym_g32", "int4_sym_g32", "int4_sym_g32"),  # as asked
                                               ("int4_sym_g32", "int8_g64", "int8_g64")])
def test_embedding_default_on_the_cli(stories_hf, tmp_path, scheme, embed, want):
    args = ["quantize", stories_hf, tmp_path / "q", "--scheme", scheme] + (["--embed-scheme", embed] if embed else [])
    _cli(*args)
    assert _head_scheme(tmp_path / "q") == want
    assert load_model(tmp_path / "q").weights["blk.0.ffn_down"].scheme.name == scheme


def test_embedding_default_at_load_matches_the_cli(stories_hf, smollm2_gguf, tmp_path):
    # a float model: the table goes to int8_g32 at load as in the saved folder, so the two run the same bytes
    a = LLM(stories_hf, quantize="int4_sym_g32", max_model_len=64)
    assert a.engine.runner.weights["token_embd"].format.name == "int8_g32"
    assert a.engine.runner.weights["blk.0.ffn_down"].format.name == "int4_sym_g32"
    quantize_model(stories_hf, tmp_path / "s", "int4_sym_g32")
    b = LLM(tmp_path / "s", max_model_len=64)
    ids = a.tokenizer.encode("Once upon a time, there was a cat")
    np.testing.assert_array_equal(a.logits(ids), b.logits(ids))
    # the default model: its Q8_0 table stays Q8_0 (repacked without loss, not rounded to int4)
    g = LLM(smollm2_gguf, quantize="int4_sym_g128", max_model_len=64)
    w = g.engine.runner.weights
    assert w["token_embd"].format.name == "int8_g32"
    assert w["blk.3.ffn_down"].format.name == "int4_sym_g128"
    ref = LLM(smollm2_gguf, max_model_len=64)  # the default path: the same Q8_0 twin
    assert np.array_equal(w["token_embd"].data, ref.engine.runner.weights["token_embd"].data)


# --- GPTQ's act-order and the self-written calibration --------------------------------------------


def test_act_order_is_the_default(stories_hf, tmp_path):
    from llamajet.cli import build_parser

    a = build_parser().parse_args(["quantize", "x", "y", "-s", "int4_sym_g32", "--method", "gptq"])
    assert a.act_order is True
    assert build_parser().parse_args(["quantize", "x", "y", "-s", "int4_sym_g32", "--no-act-order"]).act_order is False
    calib = tmp_path / "c.txt"
    calib.write_text(LLM(stories_hf, max_model_len=128).generate(
        ["Once upon a time"] * 4, __import__("llamajet").SamplingParams(max_tokens=100, temperature=1.0, seed=3))[0].text * 4)
    kw = dict(method="gptq", calib=calib, calib_seqs=3, calib_len=64)
    quantize_model(stories_hf, tmp_path / "default", "int4_sym_g32", **kw)
    quantize_model(stories_hf, tmp_path / "on", "int4_sym_g32", act_order=True, **kw)
    quantize_model(stories_hf, tmp_path / "off", "int4_sym_g32", act_order=False, **kw)
    assert _weights_bytes(tmp_path / "default") == _weights_bytes(tmp_path / "on")
    assert _weights_bytes(tmp_path / "default") != _weights_bytes(tmp_path / "off")


def test_self_written_calibration_repeats_under_a_seed(stories_hf, tmp_path):
    from llamajet.quant.selfcalib import self_generated_windows
    from llamajet.tokenizer import load_tokenizer

    tok = load_tokenizer(stories_hf)
    w0 = self_generated_windows(stories_hf, tok, 5, 96, seed=0)
    assert len(w0) == 5 and all(len(w) == 96 for w in w0)
    assert all(w[0] == tok.bos_id for w in w0) and all(tok.bos_id not in w[1:] for w in w0)
    assert w0 == self_generated_windows(stories_hf, tok, 5, 96, seed=0)
    w1 = self_generated_windows(stories_hf, tok, 5, 96, seed=1)
    assert w1 != w0
    # text the model wrote: varied, not one token repeated
    assert all(len(set(w)) > 20 for w in w0)
    # no --calib: GPTQ calibrates on it; the folder repeats for the seed and changes with it
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        quantize_model(stories_hf, tmp_path / name, "int4_sym_g32", method="gptq", calib_seqs=4, calib_len=64,
                       calib_seed=seed)
    assert _weights_bytes(tmp_path / "a") == _weights_bytes(tmp_path / "b")
    assert _weights_bytes(tmp_path / "a") != _weights_bytes(tmp_path / "c")


def test_cli_without_calib_says_what_it_calibrates_on(stories_hf, tmp_path):
    r = _cli("quantize", stories_hf, tmp_path / "q", "--scheme", "int4_sym_g32", "--method", "awq",
             "--calib-seqs", "2", "--calib-len", "64")
    assert "no --calib: calibrating on 2 windows of 64 tokens the model writes itself (seed 0)" in r.stderr
    assert "awq: calibration window 2/2" in r.stderr
    r = _cli("quantize", stories_hf, tmp_path / "q2", "--scheme", "int4_sym_g32", "--method", "gptq",
             "--calib", tmp_path / "nope.txt", check=False)
    assert r.returncode == 2 and "--calib" in r.stderr and "no such file" in r.stderr


def test_help_shows_the_new_defaults():
    r = _cli("quantize", "--help")
    h = " ".join(r.stdout.split())
    assert "--allow-requantize" in h and "--no-act-order" in h and "--calib-seed" in h
    assert "int8_g32" in h  # the embedding's default named
