"""`llamajet quantize` and the saved format (quant/quantize.py, formats/saved.py).

References nobody here wrote: the `safetensors` package reads the saved file,
the `gguf` package dequantizes the source blocks, HF `tokenizers` encodes,
and HF transformers' LlamaForCausalLM gives the float logits the quantized
models are measured against. Exact equalities are exact because the saved
model runs the same bytes through the same kernels as the in-memory path.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llamajet import LLM
from llamajet.errors import LlamajetError, ModelFormatError
from llamajet.engine import outliers, runner
from llamajet.formats import convert
from llamajet.formats.convert import prepare_weights
from llamajet.formats.gguf_blocks import repack_gguf
from llamajet.formats.packed import quantize_rtn
from llamajet.formats.saved import META_FILE, WEIGHTS_FILE
from llamajet.loaders import load_model
from llamajet.quant.quantize import quantize_model, write_outlier_plan
from llamajet.tokenizer import load_tokenizer, tokenizer_from_gguf

WIKITEXT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "corpora" / "wikitext-2-raw-test.txt"
SCHEMES = ("int8_g32", "int8_pc", "int4_asym_g32", "int4_sym_g64")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "llamajet.cli", *args], text=True, capture_output=True,
                          timeout=300)


def _file_bytes(model) -> np.ndarray:
    """The whole mapped model.safetensors as uint8 (keepalive holds the mmap)."""
    return np.frombuffer(model.keepalive[0], np.uint8)


# --- SmolLM2 Q4_1 GGUF, "keep": lossless -----------------------------------------------------


@pytest.fixture(scope="module")
def smol_saved(smollm2_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("q") / "smol"
    return out, quantize_model(smollm2_gguf, out, "keep")


def test_gguf_keep_repacks_every_block_without_loss(smollm2_gguf, smol_saved):
    out, summary = smol_saved
    # The file: 210 Q4_1 matrices, a Q8_0 embedding, 61 f32 norms; nothing re-quantized.
    assert summary.counts == {"repacked losslessly (q4_1->int4_asym_g32)": 210,
                              "repacked losslessly (q8_0->int8_g32)": 1, "norms (f32)": 61}
    assert summary.bytes_out == (out / WEIGHTS_FILE).stat().st_size
    # Q4_1 stores 20 bytes / 32 weights, the packed layout the same 20 (16 nibble + d + m);
    # Q8_0 34 vs 34: only the header and the 64-byte alignment padding differ.
    assert abs(summary.bytes_out - summary.bytes_in) / summary.bytes_in < 0.05

    safetensors = pytest.importorskip("safetensors")
    import gguf

    src = load_model(smollm2_gguf)
    reader = {t.name: t for t in src.gguf_reader.tensors}
    with safetensors.safe_open(str(out / WEIGHTS_FILE), framework="numpy") as f:  # the official reader
        saved_model = load_model(out)
        assert saved_model.config == src.config
        meta = json.loads((out / META_FILE).read_text())["tensors"]
        # q/k/v and gate/up are saved fused (formats/saved.py): [q; k; v] tiles, gate/up tiles alternating
        assert meta["blk.0.attn_qkv"]["layout"] == "rows" and meta["blk.0.ffn_gate_up"]["layout"] == "tiles"
        assert [p[0] for p in meta["blk.0.attn_qkv"]["parts"]] == ["blk.0.attn_q", "blk.0.attn_k", "blk.0.attn_v"]
        assert "blk.0.attn_q" not in meta and "blk.0.ffn_up" not in meta

        def stored_bytes(name):
            if name in meta:
                return f.get_tensor(name)
            whole, info = next((n, i) for n, i in meta.items() if name in [p[0] for p in i.get("parts", [])])
            a, t0 = f.get_tensor(whole), 0
            for i, (pname, rows) in enumerate(info["parts"]):
                if pname == name:
                    return a[t0: t0 + rows // 16] if info["layout"] == "rows" else a[i::2]
                t0 += rows // 16

        for name in ("token_embd", "blk.0.attn_q", "blk.0.attn_v", "blk.0.ffn_up", "blk.29.ffn_down"):
            w = src.weights[name]
            stored = stored_bytes(name)
            want = repack_gguf(w)
            assert stored.dtype == np.uint8 and np.array_equal(stored, want.data)
            # ...and the values are the gguf package's dequantization of the source, exactly:
            # both round d*q + m once to fp32 (f16 products are exact in fp32 and fp64).
            saved = saved_model.weights[name]
            t = reader[name + ".weight"]
            ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(w.shape)
            assert np.array_equal(saved.to_f32(), ref.astype(np.float32))


def test_gguf_keep_gives_bit_identical_logits_and_tokens(smollm2_gguf, smol_saved):
    out, _ = smol_saved
    a = LLM(smollm2_gguf, max_model_len=128, n_threads=2)
    b = LLM(out, max_model_len=128, n_threads=2)
    assert a.isa == b.isa
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    text = WIKITEXT.read_text(encoding="utf-8")[:400] if WIKITEXT.is_file() else "The capital of France is"
    # The tokenizer rebuilt from the GGUF vocabulary, saved as tokenizer.json: same ids, stops, template.
    assert b.tokenizer.stop_ids == a.tokenizer.stop_ids and b.tokenizer.bos_id == a.tokenizer.bos_id
    assert b.tokenizer.add_bos == a.tokenizer.add_bos and b.tokenizer.eos_id == a.tokenizer.eos_id
    assert b.chat_ids(msgs) == a.chat_ids(msgs)
    assert b.tokenizer.encode(text) == a.tokenizer.encode(text)
    ids = a.chat_ids(msgs)[:40]
    # Same packed bytes, same kernels, same ISA and threads: identical to the last bit.
    np.testing.assert_array_equal(b.logits(ids), a.logits(ids))


def test_a_saved_model_keeps_its_outlier_plan_and_loads_without_probing(smol_saved, tmp_path, monkeypatch):
    """quantize_model probes the saved model once and keeps the plan in the folder; a load maps it and
    runs no probe, with the same logits as a load that probes (the plan is what the probe finds)."""
    out, _ = smol_saved
    (plan,) = out.glob("outliers-k*-p*-v1.npz")
    assert outliers.saved_plan(plan) is not None
    probed_copy = tmp_path / "noplan"
    shutil.copytree(out, probed_copy)
    (probed_copy / plan.name).unlink()
    probed = LLM(probed_copy, max_model_len=256, n_threads=2)
    assert probed.outlier_plan_path is None  # a load does not write into a model folder
    assert not list(probed_copy.glob("outliers-*.npz"))

    def refuse(*a, **k):
        raise AssertionError("a saved model with a plan must not probe")
    monkeypatch.setattr(runner.find_outliers, "input_absmax", refuse)
    mapped = LLM(out, max_model_len=256, n_threads=2)
    assert mapped.outlier_plan_path == plan
    assert any(l.startswith("outliers:") for l in mapped.engine.runner.fusion_log)
    ids = [1, 504, 3300, 42, 7, 900, 12, 5]
    np.testing.assert_array_equal(mapped.logits(ids), probed.logits(ids))
    # a plan for another channel count, or found by a shorter probe (a context shorter than the
    # probe text), is not this one: those loads probe (and are refused here)
    for other in ({"act_outliers": 8}, {"max_model_len": 64}):
        with pytest.raises(AssertionError, match="must not probe"):
            LLM(out, **{"max_model_len": 256, "n_threads": 2, **other})
    # quantizing again into the folder removes the old plan before writing the new one
    stale = out / "outliers-k3-p7-v1.npz"
    stale.write_bytes(b"not a plan")
    monkeypatch.undo()
    assert write_outlier_plan(out) == plan and not stale.exists()


def test_saved_weights_are_views_of_the_mapped_file(smol_saved, monkeypatch):
    out, _ = smol_saved
    model = load_model(out)
    whole = _file_bytes(model)
    for name, w in model.weights.items():
        assert w.packed == w.kind.quantizable and w.kind == load_model(smol_saved[0]).weights[name].kind, name
        assert np.shares_memory(w.data, whole) and not w.data.flags.writeable, name
    # Loading never quantizes or repacks: make both impossible, LLM still runs on the very same arrays.
    def refuse(*a, **k):
        raise AssertionError("a saved model must not be re-quantized at load")
    monkeypatch.setattr(convert.ops, "quantize_packed", refuse)  # the quantizer prepare_weights calls
    monkeypatch.setattr(convert, "deferred_twin", refuse)  # and the GGUF repack it defers
    # q/k/v and gate/up are saved as the matrices the fusion passes run (formats/saved.py): the
    # graph's stacks are the file's bytes too, nothing is copied at load.
    llm = LLM(out, max_model_len=64, n_threads=2, act_outliers=0)
    graph_weights = llm.engine.runner.graph.weights
    assert {"blk.0.attn_qkv", "blk.0.ffn_gate_up"} <= set(graph_weights)
    for name, w in graph_weights.items():
        if name in ("rope_cos", "rope_sin"):
            continue  # computed at load from the config, not weights
        assert np.shares_memory(w.data, _file_bytes(llm.model)), name
    fused = llm.logits([1, 2, 3])
    assert np.isfinite(fused).all()
    # Unfused, the parts are views of the stacks (gate/up rows alternate by tile: those two are
    # copied to contiguous rows when lowered); same codes, same kernels' sums: the same logits.
    plain = LLM(out, max_model_len=64, n_threads=2, act_outliers=0, fuse=False)
    np.testing.assert_array_equal(plain.logits([1, 2, 3]), fused)


_RSS_SCRIPT = """
import sys
def rss():
    return {l.split(':')[0]: int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('Rss')}
from llamajet import LLM
r0 = rss()
# q/k/v and gate/up are saved as the fused matrices the passes run (formats/saved.py): with the
# passes on, as LLM runs by default, every weight stays the mapped file (no stack copied at load)
llm = LLM(sys.argv[1], max_model_len=128, n_threads=2)  # held: freeing it would unmap the file
llm.logits([1, 2, 3, 4])
r1 = rss()
# the KV pool is committed at start (kv_prefault): its configured size is not weights
print(r1['RssAnon'] - r0['RssAnon'] - llm.engine.runner.kv_pool_bytes, r1['RssFile'] - r0['RssFile'])
"""


@pytest.mark.rss
def test_rss_of_a_saved_model_is_the_mapped_file_not_a_copy(smol_saved):
    out, summary = smol_saved
    r = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(out)], text=True, capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr
    anon, file = (int(v) for v in r.stdout.split()[-2:])
    # Weights are file-backed pages; anonymous memory grows only by the tokenizer and the arena
    # (logits rows: 64 x 49152 x 4 B = 12.6 MB) besides the KV pool (taken off): measured ~30 MB,
    # against ~105 MB for the GGUF, whose blocks are repacked into new memory at load.
    assert anon < 0.5 * summary.bytes_out, f"anonymous RSS grew by {anon / 1e6:.1f} MB"
    # One step reads every matrix (the tied LM head all of token_embd) through the mapping:
    # measured +98 MB of file-backed RSS for the 96.6 MB file.
    assert file > 0.5 * summary.bytes_out, f"file-backed RSS grew by {file / 1e6:.1f} MB only"


# --- stories260K (f32 HF folder): each scheme ------------------------------------------------


@pytest.fixture(scope="module")
def stories_saved(stories_hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("q")
    return {s: (root / s, quantize_model(stories_hf, root / s, s)) for s in SCHEMES}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_saved_scheme_equals_quantizing_at_load(stories_hf, stories_saved, scheme):
    out, summary = stories_saved[scheme]
    if scheme.startswith("int4"):  # the (tied) embedding keeps 8 bits under a 4-bit scheme: formats/convert.head_scheme
        assert summary.counts == {f"RTN f32->{scheme}": 35, "RTN f32->int8_g32": 1, "norms (f32)": 11}
    else:
        assert summary.counts == {f"RTN f32->{scheme}": 36, "norms (f32)": 11}
    saved = load_model(out)
    src = load_model(stories_hf)
    assert saved.config == src.config
    w = src.weights["blk.1.ffn_down"]
    assert np.array_equal(saved.weights["blk.1.ffn_down"].data, quantize_rtn("x", w.to_f32(), scheme).data)
    a = LLM(stories_hf, max_model_len=128, quantize=scheme, n_threads=2)
    b = LLM(out, max_model_len=128, n_threads=2)
    ids = a.tokenizer.encode("Once upon a time, there was a little dog named Max.")
    assert b.tokenizer.encode("Once upon a time") == a.tokenizer.encode("Once upon a time")
    np.testing.assert_array_equal(b.logits(ids), a.logits(ids))


@pytest.fixture(scope="module")
def float_reference(stories_hf):
    """(token ids, HF transformers fp32 logits) for a WikiText-2 slice."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if not WIKITEXT.is_file():
        pytest.skip(f"shared test data missing: {WIKITEXT}")
    ids = load_tokenizer(stories_hf).encode(WIKITEXT.read_text(encoding="utf-8")[:2000])[:256]
    model = transformers.LlamaForCausalLM.from_pretrained(stories_hf, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double().numpy()
    return ids, logits


def _kl_top1(ref: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    """Mean KL(P_ref || P_got) in nats over positions, and top-1 agreement."""
    lp = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
    got = got.astype(np.float64)
    lq = got - np.logaddexp.reduce(got, axis=-1, keepdims=True)
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean()), float((ref.argmax(-1) == got.argmax(-1)).mean())


# Bounds on stories260K (hidden 64: no redundancy to hide errors in), 256 WikiText-2
# tokens, fast path (int8 activations). Measured: int8_g32 KL 0.0024 / top-1 0.957,
# int8_pc 0.0040 / 0.961, int4_asym_g32 0.29 / 0.62, int4_sym_g64 0.39 / 0.51.
# A model that knows nothing (uniform) has KL 3.9 / top-1 0: the int4 bounds sit
# 2.5x above the measurement and 4x below that, so a broken layout cannot pass.
QUALITY = {"int8_g32": (0.02, 0.90), "int8_pc": (0.02, 0.90),
           "int4_asym_g32": (1.0, 0.40), "int4_sym_g64": (1.0, 0.40)}


def test_quality_against_the_float_model(float_reference, stories_hf, stories_saved):
    ids, ref = float_reference
    # The float path agrees with transformers to fp32 rounding: the KL floor is ~0.
    # fp32 KV throughout: this measures what the weight schemes cost, nothing else.
    floor, top1 = _kl_top1(ref, LLM(stories_hf, max_model_len=512, kv_dtype="f32", quantize="none").logits(ids))
    assert floor < 1e-8 and top1 == 1.0
    kl = {}
    for scheme, (max_kl, min_top1) in QUALITY.items():
        kl[scheme], top1 = _kl_top1(ref, LLM(stories_saved[scheme][0], max_model_len=512, kv_dtype="f32").logits(ids))
        print(f"{scheme}: KL {kl[scheme]:.4f} nats, top-1 {top1:.3f}, "  # shown with pytest -s
              f"{stories_saved[scheme][1].bytes_out} bytes")
        assert kl[scheme] < max_kl and top1 > min_top1, (scheme, kl[scheme], top1)
    # int8's step is 127/7.5 ~ 17x finer than int4's, so its weight-error variance ~280x
    # smaller and KL (second order in the logit error) likewise; the int8 activation
    # quantization both share puts a floor under int8 (measured ratios 75x-165x): ask 20x.
    for i8 in ("int8_g32", "int8_pc"):
        for i4 in ("int4_asym_g32", "int4_sym_g64"):
            assert 20 * kl[i8] < kl[i4], (i8, i4, kl)


# --- other sources and round trips -----------------------------------------------------------


def test_keep_on_a_float_folder_stays_float_and_exact(stories_hf, tmp_path):
    summary = quantize_model(stories_hf, tmp_path / "f", "keep")
    assert summary.counts == {"kept float (f32)": 36, "norms (f32)": 11}
    ids = [1, 403, 407, 261, 378, 30, 1500 % 512]
    np.testing.assert_array_equal(LLM(tmp_path / "f", max_model_len=64).logits(ids),
                                  LLM(stories_hf, max_model_len=64).logits(ids))


def test_bf16_folder(stories_hf, tmp_path):
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    import shutil

    src = tmp_path / "bf16"
    src.mkdir()
    for f in stories_hf.glob("*.json"):
        shutil.copy(f, src)
    st.save_file({k: v.to(torch.bfloat16) for k, v in st.load_file(stories_hf / "model.safetensors").items()},
                 src / "model.safetensors")
    quantize_model(src, tmp_path / "keep", "keep")
    quantize_model(src, tmp_path / "i8", "int8_g32")
    orig, kept, i8 = load_model(src), load_model(tmp_path / "keep"), load_model(tmp_path / "i8")
    w = orig.weights["blk.0.attn_q"]
    assert kept.weights["blk.0.attn_q"].dtype == "bf16" and np.array_equal(kept.weights["blk.0.attn_q"].data, w.data)
    assert kept.weights["blk.0.attn_norm"].dtype == "f32"  # norms widen (exactly) to what rmsnorm reads
    # saved inside the fused [q; k; v], its rows in interleaved RoPE order (formats/saved.py): the same
    # rows as quantizing the HF matrix, permuted as the QKV pass permutes them
    from llamajet.formats.stack import rope_interleave_rows
    q8 = i8.weights["blk.0.attn_q"]
    assert q8.rope_interleaved and not w.rope_interleaved and q8.stacked is not None
    cfg = orig.config
    want = rope_interleave_rows(quantize_rtn("q", w.to_f32(), "int8_g32"), cfg.num_heads, cfg.head_dim)
    assert np.array_equal(q8.data, want.data)
    # bf16 keeps 8 mantissa bits: the model still picks the float model's tokens on a short text.
    ids = load_tokenizer(stories_hf).encode("Once upon a time, there was a little girl")
    f32 = LLM(stories_hf, max_model_len=64).logits(ids).argmax(-1)
    assert (LLM(tmp_path / "keep", max_model_len=64).logits(ids).argmax(-1) == f32).mean() >= 0.9


def test_float_gguf_keeps_interleaved_rope(stories_gguf, tmp_path):
    # attn_q / attn_k of a GGUF are in interleaved-RoPE row order; the flag must survive saving.
    quantize_model(stories_gguf, tmp_path / "g", "int8_g32")
    saved = load_model(tmp_path / "g")
    assert saved.weights["blk.0.attn_q"].rope_interleaved and not saved.weights["blk.0.attn_v"].rope_interleaved
    a = LLM(stories_gguf, max_model_len=64, quantize="int8_g32")
    b = LLM(tmp_path / "g", max_model_len=64)
    ids = a.tokenizer.encode("Once upon a time")
    assert b.tokenizer.encode("Once upon a time") == ids
    np.testing.assert_array_equal(b.logits(ids), a.logits(ids))


def test_saved_model_as_input_and_prepare_weights_pass_through(stories_saved, tmp_path):
    out, _ = stories_saved["int8_g32"]
    again = quantize_model(out, tmp_path / "again", "int8_g32")
    assert again.counts == {"copied packed (int8_g32)": 36, "norms (f32)": 11}
    assert (tmp_path / "again" / WEIGHTS_FILE).read_bytes() == (out / WEIGHTS_FILE).read_bytes()
    model = load_model(out)
    for scheme in (None, "int8_g32"):  # same scheme or none: the very same objects
        prepared = prepare_weights(model.weights, scheme=scheme)
        assert all(prepared[n] is w for n, w in model.weights.items())
    # Another scheme re-quantizes from the dequantized values (double rounding, documented).
    assert prepare_weights(model.weights, scheme="int4_sym_g32")["blk.0.attn_q"].scheme.name == "int4_sym_g32"


def test_config_round_trips_through_json(stories_hf):
    import dataclasses

    from llamajet.config import RopeScaling
    from llamajet.formats.saved import config_from_json, config_to_json

    base = load_model(stories_hf).config
    llama3 = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                         original_max_position_embeddings=8192)
    for cfg in (base, dataclasses.replace(base, rope_scaling=llama3, eos_token_ids=(2, 0), bos_token_id=None),
                dataclasses.replace(base, rope_freq_factors=(1.0, 2.5, 8.0, 1 / 3), rms_norm_eps=1e-5 / 3)):
        # through text, as on disk: floats are written as repr and read back exactly
        assert config_from_json(json.loads(json.dumps(config_to_json(cfg))), "x") == cfg


# --- CLI -------------------------------------------------------------------------------------


def test_cli_quantize(stories_hf, tmp_path):
    r = _cli("quantize", str(stories_hf), str(tmp_path / "o"), "--scheme", "int8_g32")
    assert r.returncode == 0, r.stderr
    assert "47 (36 RTN f32->int8_g32, 11 norms (f32))" in r.stdout and "MB out" in r.stdout
    assert LLM(tmp_path / "o", max_model_len=64).tokenizer.encode("Hi") == load_tokenizer(stories_hf).encode("Hi")


def test_cli_quantize_errors(stories_hf, tmp_path, capsys):
    from llamajet.cli import main

    out = str(tmp_path / "o")
    assert main(["quantize", str(stories_hf), out, "--scheme", "int5_g32"]) == 2
    err = capsys.readouterr().err
    assert "unknown quantization scheme 'int5_g32'" in err and "keep" in err and "int4_asym_g32" in err
    assert not Path(out).exists()  # nothing written
    assert main(["quantize", str(tmp_path / "missing"), out, "--scheme", "int8_g32"]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    assert main(["quantize", str(stories_hf), str(tmp_path / "full"), "--scheme", "int8_g32"]) == 2
    assert "not empty; pass --force" in capsys.readouterr().err
    assert main(["quantize", str(stories_hf), str(tmp_path / "full"), "--scheme", "int8_g32", "--force"]) == 0
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine"  # --force overwrites only its own files
    assert main(["quantize", str(tmp_path / "full"), str(tmp_path / "full"), "--scheme", "keep", "--force"]) == 2
    assert "where the source lives" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # --scheme is required (argparse exits 2)
        main(["quantize", str(stories_hf), out])
    assert e.value.code == 2


# --- corrupted saved models ------------------------------------------------------------------


@pytest.fixture
def saved_copy(stories_saved, tmp_path):
    import shutil

    out = tmp_path / "m"
    shutil.copytree(stories_saved["int8_g32"][0], out)
    return out


def _edit_meta(folder: Path, edit) -> None:
    meta = json.loads((folder / META_FILE).read_text())
    edit(meta)
    (folder / META_FILE).write_text(json.dumps(meta))


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(magic="llamajot"), "not a llamajet saved model"),
    (lambda m: m.update(format_version=0), "format_version 0, but this llamajet reads versions 1, 2 only"),
    (lambda m: m.update(format_version=3), "format_version 3, .* written by a newer llamajet"),
    (lambda m: m.pop("format_version"), "format_version None"),
    (lambda m: m["tensors"]["blk.0.attn_qkv"].update(scheme="int4_sym_g32"), "int4_sym_g32 of shape"),
    (lambda m: m["tensors"]["blk.0.ffn_up"].update(shape=[172, 32]), "needs U8"),
    (lambda m: m["tensors"]["blk.0.attn_qkv"].update(scheme="int3_g7"), "unknown scheme 'int3_g7'; known: "),
    (lambda m: m["tensors"]["blk.0.attn_norm"].update(dtype="f16"), "but f16 of shape \\[64\\] needs F16"),
    (lambda m: m["tensors"].pop("blk.0.attn_qkv"), "not listed in llamajet.json"),
    # a fused tensor's parts (formats/saved.py): rows that do not add up, an unknown layout, a name
    # outside the architecture, a part saved twice
    (lambda m: m["tensors"]["blk.0.attn_qkv"]["parts"][2].__setitem__(1, 16), "cannot hold parts"),
    (lambda m: m["tensors"]["blk.0.attn_qkv"].update(layout="cols"), "malformed parts"),
    (lambda m: m["tensors"]["blk.0.attn_qkv"].update(parts=[["blk.0.attn_q", 64], "k"]), "malformed parts"),
    (lambda m: m["tensors"]["blk.0.attn_qkv"]["parts"][0].__setitem__(0, "blk.0.attn_z"), "not part of a llama"),
    (lambda m: m["tensors"]["blk.1.attn_qkv"]["parts"][0].__setitem__(0, "blk.0.attn_q"), "saved twice"),
    (lambda m: m["config"].update(num_layers=6), "blk.5"),
    (lambda m: m["config"].pop("vocab_size"), "config is incomplete"),
])
def test_corrupt_metadata_is_a_clear_error(saved_copy, edit, message):
    _edit_meta(saved_copy, edit)
    with pytest.raises(ModelFormatError, match=message):
        load_model(saved_copy)


def test_corrupt_or_missing_files_are_clear_errors(saved_copy):
    data = (saved_copy / WEIGHTS_FILE).read_bytes()
    for cut, message in ((len(data) - 1, "outside the"), (len(data) // 2, "outside the"),
                         (100, "exceeds the file"), (5, "too short"), (0, "cannot be memory-mapped")):
        (saved_copy / WEIGHTS_FILE).write_bytes(data[:cut])
        with pytest.raises(ModelFormatError, match=message):
            load_model(saved_copy)
        with pytest.raises(ModelFormatError, match=message):
            LLM(saved_copy)
    # The header itself inconsistent: a tensor's shape no longer fits the bytes it spans.
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header["blk.0.attn_qkv"]["shape"][-1] -= 32
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(text) == n
    (saved_copy / WEIGHTS_FILE).write_bytes(data[:8] + text + data[8 + n:])
    with pytest.raises(ModelFormatError, match="'blk.0.attn_qkv' spans 8704 bytes, but U8"):
        load_model(saved_copy)
    (saved_copy / WEIGHTS_FILE).unlink()
    with pytest.raises(ModelFormatError, match="model.safetensors: no such file"):
        load_model(saved_copy)
    (saved_copy / META_FILE).write_text("{not json")
    with pytest.raises(ModelFormatError, match="not valid JSON"):
        load_model(saved_copy)


def test_unknown_scheme_errors_list_the_known_ones(stories_hf, tmp_path):
    with pytest.raises(LlamajetError, match=r"known: keep, int4_asym_g128, .*int8_pc"):
        quantize_model(stories_hf, tmp_path / "x", "int2")
    assert not (tmp_path / "x").exists()


def test_tokenizer_from_gguf_survives_saving(stories_gguf, tmp_path):
    # A SentencePiece vocabulary rebuilt from GGUF keys, saved as tokenizer.json.
    quantize_model(stories_gguf, tmp_path / "t", "int8_pc")
    import gguf

    src = tokenizer_from_gguf(gguf.GGUFReader(stories_gguf))
    tok = load_tokenizer(tmp_path / "t")
    text = "Once upon a time, Lily said: \"Hi!\"  123 ünï\n</s>"
    assert tok.encode(text) == src.encode(text) and tok.stop_ids == src.stop_ids
    assert tok.decode(tok.encode(text)) == src.decode(src.encode(text))
