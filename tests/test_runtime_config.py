"""RuntimeConfig: every runtime option once, with its default; LLM(**options),
the runner, the engine and the CLI flags all come from it."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from llamajet import LLM, RequestError, RuntimeConfig
from llamajet.cli import build_parser
from llamajet.options import runtime_config


def test_defaults_are_stated_once():
    c = RuntimeConfig()
    assert (c.kernels, c.kv_dtype, c.block_size, c.fuse, c.kv_prefault, c.enable_prefix_caching) == \
        ("fast", "f16", 16, True, True, True)
    assert (c.max_num_seqs, c.max_tokens_per_step, c.max_model_len, c.n_threads, c.isa) == (64, 256, None, None, None)
    for f in dataclasses.fields(RuntimeConfig):  # every option documents itself (the CLI shows it)
        assert f.metadata.get("help"), f.name


@pytest.mark.parametrize("options, message", [
    ({"kv_type": "f16"}, "unknown option 'kv_type'; did you mean 'kv_dtype'"),
    ({"kv_dtype": "int4"}, "kv_dtype='int4': use one of f32, f16, bf16, int8"),
    ({"kernels": "turbo"}, "kernels='turbo'"),
    ({"block_size": 0}, "block_size=0"),
    ({"max_model_len": 1}, "max_model_len=1"),
    ({"n_threads": -2}, "n_threads=-2"),
    ({"fuse": "yes"}, "fuse='yes'"),
    ({"kernels": "reference", "quantize": "int8_g32"}, "packed kernels"),
    ({"kv_cache_tokens": 8}, "at least one block"),
    ({"kv_cache_memory": "4 parsecs"}, "not a size"),
    ({"kv_cache_memory": 0}, "must be positive"),
    ({"kv_cache_memory": "1GiB", "kv_cache_tokens": 4096}, "not both"),
])
def test_bad_options_are_refused_before_the_model_is_read(options, message, tmp_path):
    # the path does not exist: the option error must come first (nothing is read, nothing lost)
    with pytest.raises(RequestError, match=message):
        LLM(tmp_path / "missing.gguf", **options)


def test_every_field_is_a_cli_flag_and_parses_to_the_config():
    ap = build_parser()
    a = ap.parse_args(["generate", "--kv-dtype", "int8", "--no-fuse", "-t", "3", "--kernels", "a16",
                       "--block-size", "8", "--max-model-len", "300", "--no-kv-prefault", "hello"])
    assert runtime_config(a) == RuntimeConfig(kv_dtype="int8", fuse=False, n_threads=3, kernels="a16",
                                              block_size=8, max_model_len=300, kv_prefault=False)
    assert runtime_config(ap.parse_args(["chat"])) == RuntimeConfig()  # no flag: the config's defaults
    helps = ap._subparsers._group_actions[0].choices["generate"].format_help()
    for f in dataclasses.fields(RuntimeConfig):
        flag = (f.metadata.get("flags") or ("--" + f.name.replace("_", "-"),))[0]
        assert flag in helps, f.name
    with pytest.raises(SystemExit):  # choices come from the config too
        ap.parse_args(["generate", "--kv-dtype", "fp8", "x"])


def test_runner_and_engine_read_the_config(stories_hf):
    llm = LLM(stories_hf, max_model_len=96, kv_dtype="bf16", block_size=8, kv_cache_tokens=200, n_threads=1,
              max_num_seqs=3, max_tokens_per_step=40, fuse=False, enable_prefix_caching=False, kernels="a16")
    r, e = llm.engine.runner, llm.engine
    assert llm.runtime.max_model_len == 96 and r.max_model_len == 96
    assert r.kv.dtype == "bf16" and r.kv_dtype == "bf16"
    assert e.blocks.block_size == r.block_size == 8 and e.blocks.num_blocks == 25  # ceil(200 / 8)
    assert r.n_threads == 1 and r.max_tokens == 40 and r.max_seqs == 3
    assert r.fusion_log == [] and e.blocks.enable_caching is False
    # an fp32 checkpoint: its matrices become int8_g32 by default (RuntimeConfig.float_scheme) ...
    assert {w.dtype for w in r.weights.values() if w.kind.quantizable} == {"pk_i8"}
    kept = LLM(stories_hf, max_model_len=64, quantize="none", kernels="a16")  # ... or stay fp32
    assert not any(w.packed for w in kept.engine.runner.weights.values())
    q = LLM(stories_hf, max_model_len=64, quantize="int8_g32", kernels="a16")
    assert q.engine.runner.weights["blk.0.attn_qkv"].dtype == "pk_i8"
    with pytest.raises(RequestError, match="max_model_len=1000 must be in 2..512"):  # the model's own limit
        LLM(stories_hf, max_model_len=1000)


def test_kv_cache_memory_sizes_the_pool(stories_hf):
    from llamajet.config import parse_bytes

    assert parse_bytes("4GiB") == 4 << 30 and parse_bytes("2GB") == 2 * 10**9 and parse_bytes(" 1.5 m") == 3 << 19
    assert parse_bytes(12345) == 12345 and parse_bytes("512MiB") == 512 << 20
    # stories260K: 5 layers x K and V x 4 kv heads x 8 dims x 2 bytes (f16) = 640 bytes a token
    llm = LLM(stories_hf, max_model_len=64, kv_cache_memory="64KiB", block_size=16)
    r = llm.engine.runner
    per_block = 2 * 5 * 4 * 8 * 2 * 16
    assert r.kv_bytes_per_block == per_block and r.num_blocks == (64 << 10) // per_block  # 6 blocks
    assert r.kv_pool_bytes <= 64 << 10
    with pytest.raises(RequestError, match="less than one context of max_model_len=512"):
        LLM(stories_hf, max_model_len=512, kv_cache_memory="64KiB")  # 102 tokens < 512


def test_info_prints_where_the_memory_goes(stories_hf, capsys):
    from llamajet.cli import main

    assert main(["info", "--model", str(stories_hf), "--max-model-len", "128", "--kv-cache-tokens", "256"]) == 0
    out = capsys.readouterr().out
    lines = {ln.split(":")[0]: ln for ln in out.splitlines()}
    assert "f32" in lines["weights"] and "256 tokens" in lines["kv pool"] and "context 128" in lines["kv pool"]
    assert "arena" in lines and "resident set" in lines["other"]


_PREFAULT = r"""
import json, sys
from llamajet import LLM
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS"))
before = rss()
llm = LLM(sys.argv[1], kv_cache_tokens=65536, kv_prefault=sys.argv[2] == "1", max_model_len=256)
print(json.dumps({"grown": rss() - before, "pool": llm.engine.runner.kv_pool_bytes}))
"""


def test_kv_prefault_is_read(stories_hf):
    """kv_prefault commits the KV pool's pages at start; without it they are
    committed as blocks are first written (the engine used to validate the
    option and never read it). 65,536 tokens of stories260K's fp16 K/V: 40 MiB."""
    got = {}
    for on in ("1", "0"):
        p = subprocess.run([sys.executable, "-c", _PREFAULT, str(stories_hf), on], capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        got[on] = json.loads(p.stdout.strip().splitlines()[-1])
    pool = got["1"]["pool"]
    assert pool == 40 * 2**20
    assert got["1"]["grown"] >= pool and got["0"]["grown"] < pool / 2, got
