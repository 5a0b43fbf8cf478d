"""Memory ownership: nothing is allocated inside a step, weights stay where
the loader (or the one packing pass) put them, and RSS does not grow with
the tokens generated beyond the KV cache they fill.

"Nothing allocated in a step" is counted two ways: the executor's own
buffers (arena, KV pool, scratch: `allocations`, grown only when ops are
added), and every heap allocation (operator new) made by the extension's code
while a step runs (`ops.step_allocations()`, counted by csrc/runtime/
alloc_count.cpp on every thread of the step), which a kernel that allocates
would increase.

RSS is measured in a fresh subprocess (other tests in this process load
models and leave allocator state behind, which would blur the numbers).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from llamajet.engine.sampling import SamplingParams

MiB = 2**20

# -- (a) no allocation inside a step


def _allocations(llm) -> tuple[int, int]:
    from llamajet import ops

    return llm.engine.runner.exe.allocations, ops.step_allocations()


def test_no_allocation_in_decode_or_prefill_steps(stories_hf):
    from llamajet.api import LLM

    llm = LLM(stories_hf, max_model_len=512)
    at_init = _allocations(llm)
    # The runner allocates its buffers once (arena, KV pool, ...): a handful, not one per op.
    assert 1 <= at_init[0] <= len(llm.engine.runner.graph.nodes) // 4
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate("Once upon a time", greedy)  # warm-up
    assert _allocations(llm) == at_init

    out = llm.generate("Once upon a time", SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 32  # 32 decode steps really ran
    assert _allocations(llm) == at_init

    # prefill: 300 prompt tokens are two chunks of the 256-token step budget
    ids = [int(t) % 500 + 3 for t in range(300)]
    llm.generate(ids, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    # mixed steps: three sequences decoding while another prefills
    llm.generate([ids[:40], ids[:7], ids[100:230]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert _allocations(llm) == at_init


# -- (b) zero-copy weights and RSS, on the default model (SmolLM2-135M Q4_1 GGUF)

_PROBE = r"""
import json, os, sys
import numpy as np

def rss():
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, v in (l.split(":", 1) for l in f)
                if k in ("VmRSS", "RssAnon", "RssFile")}

from llamajet.api import LLM
from llamajet.engine.sampling import SamplingParams
r = {"imports": rss()}
path = sys.argv[1]
llm = LLM(path)
r["loaded"] = rss()
run = llm.engine.runner
from llamajet import ops
r["allocs_init"] = (run.exe.allocations, ops.step_allocations())
greedy = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
prompt = "Once upon a time"
llm.generate(prompt, greedy(8))  # warm-up: first touch of the arena, code pages, caches
r["warm"] = rss()
out = llm.generate(prompt, greedy(64))
r["after"] = rss()
r["generated"] = len(out[0].token_ids)
r["prompt_tokens"] = len(out[0].prompt_token_ids)
r["allocs_after"] = (run.exe.allocations, ops.step_allocations())
llm.generate(list(range(10, 310)), greedy(2))  # a 300-token prefill (two chunks)
r["allocs_prefill"] = (run.exe.allocations, ops.step_allocations())

cfg = run.config
r["kv_bytes_per_token"] = 2 * cfg.num_layers * run.kv.row_bytes  # K and V rows, every layer
r["kv_pool_bytes"] = run.kv_pool_bytes  # committed at start (RuntimeConfig.kv_prefault)
r["file_bytes"] = os.path.getsize(path)
mm = llm.model.gguf_reader.data  # the reader's np.memmap of the whole file
g = run.graph
used = sorted({t for n in g.nodes for t in n.reads() if g.tensors[t].kind == "weight"})
norms = [t for t in used if t.endswith("_norm")]
r["norms"] = len(norms)
r["norms_mapped"] = sum(bool(np.shares_memory(g.weights[t].data, mm)) for t in norms)
r["not_contiguous"] = [t for t in used if not g.weights[t].data.flags.c_contiguous]

def owned(ws):  # bytes of weight storage outside the file mapping, each buffer once
    seen = {}
    for w in ws:
        d = w.data
        while isinstance(d.base, np.ndarray):
            d = d.base
        if not np.may_share_memory(d, mm):
            seen[id(d)] = d.nbytes
    return sum(seen.values())

r["owned_needed"] = owned(g.weights[t] for t in used)
r["owned_reachable"] = owned([*g.weights.values(), *run.weights.values()])
print(json.dumps(r))
"""


@pytest.fixture(scope="module")
def probe(smollm2_gguf) -> dict:
    p = subprocess.run([sys.executable, "-c", _PROBE, str(smollm2_gguf)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_default_model_no_allocation_in_steps(probe):
    assert probe["generated"] == 64
    assert probe["allocs_after"] == probe["allocs_init"]
    assert probe["allocs_prefill"] == probe["allocs_init"]


def test_unpacked_weights_are_views_of_the_file(probe):
    # RMSNorm weights are f32 in this GGUF: the kernels read them in the mapped file.
    assert probe["norms"] == 2 * 30 + 1  # attn_norm, ffn_norm per layer; output_norm
    assert probe["norms_mapped"] == probe["norms"]
    # nanobind's ndarray cast (csrc/bindings.cpp to_operand) would make a
    # contiguous *temporary* copy of a strided array and hand its pointer to
    # the executor: every weight must already be C-contiguous.
    assert probe["not_contiguous"] == []


def test_packed_weights_exist_once(probe):
    # The fusion passes drop the unstacked parts once Q/K/V and gate/up are
    # stacked (graph.passes.fuse): only what the Program reads stays reachable.
    assert probe["owned_reachable"] <= probe["owned_needed"]


def test_rss_flat_while_generating(probe):
    # After warm-up a step touches nothing new: the KV pool was committed at
    # start (kv_prefault); the bound still allows every row of this request
    # in fresh pages (46,080 B per token here), as with kv_prefault=False. 4 MiB more is
    # for Python objects (token lists, text, per-step arrays) and allocator
    # slack. Measured: +2.4 MiB VmRSS for 64 tokens after a 4-token prompt (bound: 7.0 MiB).
    grown = probe["after"]["VmRSS"] - probe["warm"]["VmRSS"]
    kv = (probe["prompt_tokens"] + probe["generated"]) * probe["kv_bytes_per_token"]
    assert grown <= kv + 4 * MiB, f"RSS grew {grown / MiB:.1f} MiB over 64 tokens"


@pytest.mark.rss
def test_rss_after_load_near_the_file_size(probe):
    # Weights cost at most 1.6x the file: the packed copy (1.0x; same bits per
    # weight as Q4_1) plus slack for file pages the kernels still read (norms,
    # f32) or the OS keeps mapped. 40 MiB is the fixed rest, measured: tokenizer
    # (~19 MiB), RoPE tables, arena and executor scratch, graph objects.
    # Measured: VmRSS 44 MiB after imports, 214 MiB after LLM() for a 94 MiB
    # file (was 449 MiB before loaders.gguf.release_file_pages dropped the
    # reader's metadata and the repacked file's pages, and fusion dropped the
    # unstacked parts). The KV pool, committed at start (kv_prefault, its size
    # configured: 8192 tokens x 46,080 B by default), is not weights: taken off.
    loaded = probe["loaded"]["VmRSS"] - probe["imports"]["VmRSS"] - probe["kv_pool_bytes"]
    assert loaded <= 1.6 * probe["file_bytes"] + 40 * MiB, (
        f"RSS after load {loaded / MiB:.0f} MiB above imports, file {probe['file_bytes'] / MiB:.0f} MiB")


# -- (c) the load's own buffers: mappings of their own, and the probe memo's digest


def test_weight_storage_is_a_mapping_of_its_own_from_2_mib():
    """formats/pages.empty (repacked and stacked weights): from 2 MiB a mapping of its own (page
    aligned), below it the heap; writable, sized as asked, and freed with the array (a thousand
    8 MiB buffers made and dropped would be 8 GiB if none were unmapped)."""
    from llamajet.formats import pages

    big = pages.empty((3 * MiB + 100,))
    assert big.shape == (3 * MiB + 100,) and big.dtype == np.uint8
    assert big.ctypes.data % 4096 == 0
    big[:] = 7
    assert int(big[-1]) == 7 and int(big.sum(dtype=np.int64)) == 7 * big.size
    small = pages.empty((5, 1000))
    small[:] = 1
    assert small.shape == (5, 1000) and int(small.sum()) == 5000
    assert pages.empty((0,)).size == 0
    before = _vm_size()
    for _ in range(1000):
        b = pages.empty((8 * MiB,))
        b[::4096] = 1
        del b
    assert _vm_size() - before < 64 * MiB


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def test_prefault_commits_a_buffer_as_zeros():
    """Executor.prefault_buffer (the KV pool at start): the buffer reads zeros after it, a
    mapped (>= 2 MiB) buffer and a heap one alike, whatever was written before."""
    from llamajet import ops

    ex = ops.Executor(isa="ref", n_threads=2, max_tokens=1, max_out=1, max_seqs=1, max_blocks=1,
                      kv_slots=16, block_size=16, max_pos=1, scratch_floats=0)
    for nbytes in (70 * MiB + 12, 4000):
        b = ex.alloc_buffer(nbytes)
        view = ex.buffer(b)
        view[::4096] = 9
        ex.prefault_buffer(b)
        assert view.size >= nbytes and not view[:nbytes].any()


def test_content_digest_depends_on_the_bytes_only():
    """_core.content_digest, the outlier probe memo's key for weights: the same for any thread
    count (fixed 1 MiB chunks), different for a flipped bit in any chunk, a byte more or less,
    and the same bytes moved."""
    from llamajet import _core

    a = np.random.default_rng(0).integers(0, 256, 5 * MiB + 77, dtype=np.uint8)
    d = _core.content_digest(a, 1)
    assert len(d) == 16
    assert all(_core.content_digest(a, n) == d for n in (2, 3, 7))
    seen = {d}
    for i in (0, MiB - 1, MiB, 3 * MiB + 5, a.size - 1):
        b = a.copy()
        b[i] ^= 1
        seen.add(_core.content_digest(b, 2))
    seen.add(_core.content_digest(a[:-1], 2))
    seen.add(_core.content_digest(np.concatenate([a, a[:1]]), 2))
    seen.add(_core.content_digest(np.roll(a, 1), 2))
    assert len(seen) == 9
    assert _core.content_digest(np.zeros(0, np.uint8)) != _core.content_digest(np.zeros(1, np.uint8))
