"""Fusion passes: fused graphs compute what the unfused ones compute, and each
legality rule, when it fails, makes its pass leave the graph unchanged."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from llamajet import ops
from llamajet.config import RuntimeConfig
from llamajet.engine.runner import ModelRunner, StepBatch
from llamajet.graph.ir import Graph, _NodeList
from llamajet.graph.passes import FusionContext, fuse
from llamajet.loaders import load_model
from llamajet.model.llama import build_graph
from llamajet.formats.convert import prepare_weights

PASSES = ("qkv", "gate_up", "residual", "norm_head", "add_rmsnorm", "attn_quant", "ffn_quant")


def _step(r: ModelRunner, ids, start: int, all_rows: bool) -> np.ndarray:
    """One sequence in blocks 0, 1, ... (slot = position)."""
    n = len(ids)
    pos = np.arange(start, start + n, dtype=np.int32)
    bt = np.arange(r.max_blocks, dtype=np.int32)[None]
    rows = np.arange(n, dtype=np.int32) if all_rows else np.array([n - 1], np.int32)
    return r.execute(StepBatch(np.array(ids, np.int32), pos, pos.copy(), np.zeros(n, np.int32), bt, rows)).copy()


def _prefill_decode(model, ids, **options):
    # a step of 64 tokens, a pool of 8 blocks committed lazily, fp32 K/V unless
    # asked (the tolerances below are fp32's); the runner alone, no engine. No outlier channels
    # (act_outliers): they change the arithmetic by design, which is not what the passes may do
    # (tests/test_outliers.py holds them to numpy)
    options = {"kv_dtype": "f32", "act_outliers": 0, **options}
    r = ModelRunner(model, RuntimeConfig(max_model_len=128, max_tokens_per_step=64, kv_cache_tokens=128,
                                         kv_prefault=False, **options))
    out = [_step(r, ids[:-3], 0, True)]
    for i in range(len(ids) - 3, len(ids)):  # then decode steps
        out.append(_step(r, [ids[i]], i, False))
    return np.concatenate(out), r


def _only(monkeypatch, names):
    import llamajet.engine.runner as runner_mod
    from llamajet.graph import passes

    monkeypatch.setattr(runner_mod, "fuse_graph", lambda g, ctx: passes.fuse(g, ctx, only=names))


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return load_model(smollm2_gguf)


@pytest.mark.parametrize("names", [(p,) for p in PASSES] + [PASSES], ids=lambda n: "+".join(n))
def test_each_pass_is_exact_on_the_default_model(smollm2, names, monkeypatch):
    """SmolLM2's GGUF q/k rows are already in interleaved RoPE order and every
    fused kernel keeps the unfused order of operations (and the same vector
    exp; fp contraction is off in the build): bit-identical logits."""
    ids = list(np.random.default_rng(0).integers(0, smollm2.config.vocab_size, 24))
    ref, _ = _prefill_decode(smollm2, ids, fuse=False)
    _only(monkeypatch, names)
    got, r = _prefill_decode(smollm2, ids, fuse=True)
    assert r.fusion_log, "the pass must apply to this model"
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("scheme", ["none", "int8_g32"])  # "none": fp32 weights kept
def test_all_passes_on_stories260k(stories_hf, scheme):
    """stories260K as fp32 and int8_g32. Its q/k rows are in HF rotate-half
    order, so the QKV pass permutes them to interleaved order: q.k sums its
    terms in another order, a few fp32 ulps per score (the scale of the
    logits, ~10, times ~1e-6). Its FFN width 172 is no whole number of
    16-row tiles, so gate/up must refuse."""
    model = load_model(stories_hf)
    ids = list(np.random.default_rng(1).integers(0, 512, 30))
    ref, _ = _prefill_decode(model, ids, fuse=False, quantize=scheme)
    got, r = _prefill_decode(model, ids, fuse=True, quantize=scheme)
    assert not any(l.startswith("gate_up") for l in r.fusion_log)
    assert any(l.startswith("qkv") for l in r.fusion_log)
    tol = 1e-5 if scheme == "none" else 0.0
    if scheme != "none":  # int8 activations: a ulp that moves one activation across a
        # rounding boundary moves its int8 code by one: allow such flips, bounded
        # by the quantization step they cause (1/127 of a row's max, 1% of scale)
        tol = 1e-2
    assert np.abs(got - ref).max() <= tol * np.abs(ref).max()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.95


def test_random_llama3_fused_matches_transformers_tolerance(tmp_path):
    """A random Llama-3 (GQA 4:1, head_dim 64, llama3 rope scaling) from
    transformers: fused vs unfused within the fp32 reassociation bound of
    the q/k permutation (see above), here 1e-5 of the logits' scale."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=256,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32})
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    model = load_model(tmp_path)
    ids = list(np.random.default_rng(2).integers(0, 512, 40))
    for scheme in ("none", "int4_asym_g32"):
        ref, _ = _prefill_decode(model, ids, fuse=False, quantize=scheme)
        got, r = _prefill_decode(model, ids, fuse=True, quantize=scheme)
        # fp32 weights: the residual pass takes every add, and norms and attention
        # feeding fp32 matmuls have nothing to quantize on write
        want = set(PASSES) - ({"add_rmsnorm", "attn_quant", "ffn_quant"} if scheme == "none" else set())
        assert {l.split(":")[0] for l in r.fusion_log} == want
        bound = 1e-5 if scheme == "none" else 1e-2  # int8 activation flips, as above
        assert np.abs(got - ref).max() <= bound * np.abs(ref).max(), scheme


# ------------------------------------------------------------------ legality


def _graph(model, scheme="int8_g32"):
    w = prepare_weights(model.weights, scheme=scheme)
    return build_graph(model.config, w, 64)


def _node(n):
    return (n.name, n.op, dict(n.inputs), dict(n.outputs), dict(n.attrs))


def _snapshot(g: Graph):
    return [_node(n) for n in g.nodes]


def _spy(g: Graph, tensor: str):
    """Adds a consumer of `tensor` (a node reading it), so the tensor may no longer disappear."""
    out = g.tensor(f"spy.{tensor}", g.tensors[tensor].shape)
    g.add(f"spy.{tensor}", "add", {"a": tensor, "b": tensor}, {"out": out})


@pytest.fixture(scope="module")
def tiny(stories_hf):
    return load_model(stories_hf)


@pytest.mark.parametrize("tensor,pass_name", [
    ("blk.0.attn_q.out", "qkv"), ("blk.0.attn_k.out", "qkv"),
    ("blk.0.attn_output.out", "residual"), ("output_norm.out", "norm_head"),
])
def test_intermediate_with_another_consumer_refuses(tiny, tensor, pass_name):
    """A tensor the fusion would remove is also read elsewhere: the nodes that
    produce and read it stay as they are (other blocks still fuse)."""
    g = _graph(tiny)
    _spy(g, tensor)
    prod = g.producers()[tensor]
    readers = [_node(n) for n in g.consumers(tensor)]
    before = _node(prod)
    log = fuse(g, only=(pass_name,))
    assert tensor in g.tensors
    p2 = g.producers()[tensor]
    assert _node(p2) == before
    assert [_node(n) for n in g.consumers(tensor)] == readers
    assert not any(prod.name in l for l in log)


def test_gate_up_refuses_partial_tiles_and_other_consumers(tiny, smollm2):
    g = _graph(tiny)  # F = 172: not whole 16-row tiles
    snap = _snapshot(g)
    assert fuse(g, only=("gate_up",)) == [] and _snapshot(g) == snap
    g = _graph(smollm2, scheme=None)
    _spy(g, "blk.3.ffn_gate.out")
    log = fuse(g, only=("gate_up",))
    assert len(log) == smollm2.config.num_layers - 1 and not any("blk.3." in l for l in log)


def test_qkv_keeps_k_rot_and_v_for_their_readers(tiny):
    """The fused matmul produces k_rot and v (the kv_write, and any other
    reader, keep reading them): the pass does not depend on the KV cache type
    (test_fused_equals_unfused_on_every_isa runs it with each)."""
    g = _graph(tiny)
    _spy(g, "blk.0.rope_k.out")
    assert len(fuse(g, only=("qkv",))) == tiny.config.num_layers
    fused = g.producers()["blk.0.rope_k.out"]
    assert fused.name == "blk.0.attn_qkv"
    assert (fused.outputs["k_out"], fused.outputs["v_out"]) == ("blk.0.rope_k.out", "blk.0.attn_v.out")
    assert [n.op for n in g.consumers("blk.0.attn_v.out")] == ["kv_write"]
    assert sorted(n.op for n in g.consumers("blk.0.rope_k.out")) == ["add", "kv_write"]


def test_qkv_refuses_partial_tiles(tiny):
    g = _graph(tiny)
    w = g.weights["blk.0.attn_k"]
    g.weights["blk.0.attn_k"] = copy.copy(w)
    object.__setattr__(g.weights["blk.0.attn_k"], "shape", (24, w.shape[1]))  # 24 rows: not whole tiles
    log = fuse(g, only=("qkv",))
    assert not any("blk.0." in l for l in log) and len(log) == tiny.config.num_layers - 1


def test_residual_refuses_a_residual_produced_after_the_matmul():
    """matmul(a) -> o; x = a + a computed after the matmul; r = x + o. Moving the
    add into the matmul would read x before it exists: refused."""
    from llamajet.formats import Kind, float_weight

    g = Graph()
    w = float_weight("w", Kind.MATRIX, np.eye(16, dtype=np.float32))
    a = g.tensor("a", ("T", 16))
    g.add("src", "embed", {"table": g.weight("tab", float_weight("tab", Kind.EMBEDDING, np.ones((4, 16), np.float32))),
                           "tokens": g.tensor("tokens", ("T",), "i32", kind="input")}, {"out": a})
    o = g.tensor("o", ("T", 16))
    g.add("proj", "matmul", {"x": a, "w": g.weight("w", w)}, {"out": o})
    x = g.tensor("x", ("T", 16))
    g.add("late", "add", {"a": a, "b": a}, {"out": x})
    r = g.tensor("r", ("T", 16))
    g.add("res", "add", {"a": x, "b": o}, {"out": r})
    g.outputs.append(r)
    snap = _snapshot(g)
    assert fuse(g, only=("residual",)) == [] and _snapshot(g) == snap
    # the same graph with x produced before the matmul fuses
    g.nodes.insert(1, g.nodes.pop(2))
    assert fuse(g, only=("residual",)) == ["residual: proj + res -> proj (+x)"]


def test_quantize_on_write_needs_int8_packed_readers(tiny):
    g = _graph(tiny, scheme=None)  # fp32 weights: the norm only fuses its add
    log = fuse(g, only=("add_rmsnorm",))
    assert log and not any("int8" in l for l in log)
    g = _graph(tiny)  # int8_g32: now it also writes int8 rows
    assert any("int8 g32" in l for l in fuse(g, only=("add_rmsnorm",)))
    g = _graph(tiny)  # float activations (W8A16): no int8 on write
    assert not any("int8" in l for l in fuse(g, FusionContext(act_int8=False), only=("add_rmsnorm",)))


def test_ffn_quant_feeds_the_down_projection_only_for_int8_packed_readers(tiny, smollm2):
    g = _graph(smollm2, scheme=None)  # Q4_1 (g32): after gate/up, a quantize op for ffn_down
    log = fuse(g, only=("gate_up", "ffn_quant"))
    assert sum(l.startswith("ffn_quant") for l in log) == smollm2.config.num_layers
    q = next(n for n in g.nodes if n.name == "blk.0.ffn_gate_up.quantize")
    down = next(n for n in g.nodes if n.name == "blk.0.ffn_down")
    names = [n.name for n in g.nodes]
    assert names.index("blk.0.ffn_gate_up") + 1 == names.index(q.name) < names.index(down.name)
    assert down.inputs["qin"] == q.outputs["out"] and "x" not in down.inputs
    assert down.attrs["prologue"] == ops.Prologue.PREQUANT
    assert g.tensors[q.outputs["out"]].group == 32
    assert g.producers()[q.inputs["x"]].name == "blk.0.ffn_gate_up"
    g = _graph(smollm2, scheme=None)  # another reader of the SwiGLU output: nothing there
    _spy(g, "blk.2.ffn_swiglu.out")
    log = fuse(g, only=("ffn_quant",))
    assert len(log) == smollm2.config.num_layers - 1 and not any("blk.2." in l for l in log)
    for graph, ctx in ((_graph(tiny, scheme=None), None), (_graph(smollm2, scheme=None), FusionContext(act_int8=False))):
        snap = _snapshot(graph)  # fp32 weights, or float activations: nothing to quantize
        assert fuse(graph, ctx, only=("ffn_quant",)) == [] and _snapshot(graph) == snap


def test_attention_quantizes_on_write_only_for_whole_groups_of_int8_readers(tiny, smollm2):
    g = _graph(smollm2, scheme=None)  # Q4_1 (g32), head_dim 64: the o-proj takes int8 rows
    log = fuse(g, only=("attn_quant",))
    assert len(log) == smollm2.config.num_layers and all("int8 g32" in l for l in log)
    att = next(n for n in g.nodes if n.name == "blk.0.attn")
    o = next(n for n in g.nodes if n.name == "blk.0.attn_output")
    assert g.tensors[att.outputs["qout"]].group == 32 and o.inputs["qin"] == att.outputs["qout"]
    assert o.attrs["prologue"] == ops.Prologue.PREQUANT
    g = _graph(smollm2, scheme=None)  # another reader of the attention output: no fusion there
    _spy(g, "blk.2.attn.out")
    log = fuse(g, only=("attn_quant",))
    assert len(log) == smollm2.config.num_layers - 1 and not any("blk.2." in l for l in log)
    g = _graph(smollm2, scheme=None)  # float activations (W4A16): nothing to quantize
    assert fuse(g, FusionContext(act_int8=False), only=("attn_quant",)) == []
    g = _graph(tiny)  # stories260K: head_dim 8 holds no whole group of 32
    snap = _snapshot(g)
    assert fuse(g, only=("attn_quant",)) == [] and _snapshot(g) == snap


@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "bf16", "int8"])
@pytest.mark.parametrize("isa", __import__("llamajet.ops", fromlist=["x"]).supported_isas())
def test_fused_equals_unfused_on_every_isa(smollm2, isa, kv_dtype):
    """Each tier compiles the fused epilogues from the same source as the
    unfused kernels (same vector exp, no fp contraction; the QKV epilogue's
    RoPE is rope's arithmetic): bit-identical, for every KV cache type."""
    ids = list(np.random.default_rng(5).integers(0, smollm2.config.vocab_size, 10))
    ref, _ = _prefill_decode(smollm2, ids, fuse=False, isa=isa, kv_dtype=kv_dtype)
    got, r = _prefill_decode(smollm2, ids, fuse=True, isa=isa, kv_dtype=kv_dtype)
    assert any(l.startswith("qkv:") for l in r.fusion_log)
    np.testing.assert_array_equal(got, ref)


# ---------------------------------------------------------------- the graph's reader / producer index

def _scan_consumers(g: Graph, t: str):
    return [n for n in g.nodes if t in n.inputs.values()]


def _scan_index(g: Graph, node) -> int:
    return next(i for i, n in enumerate(g.nodes) if n is node)


def _index_off(monkeypatch):
    """Graph queries as they were before the index: a scan of every node each."""
    monkeypatch.setattr(_NodeList, "readers", lambda self, t: None)
    monkeypatch.setattr(_NodeList, "writers", lambda self, t: None)
    monkeypatch.setattr(Graph, "index", _scan_index)


def _whole(g: Graph):
    """Everything the passes decide: nodes (operands, attributes, order), tensors, weights' names."""
    return _snapshot(g), list(g.tensors.items()), list(g.weights), list(g.outputs)


@pytest.mark.parametrize("act_int8", [True, False])
def test_the_index_fuses_as_the_scans_did(smollm2, monkeypatch, act_int8):
    """Graph's index of readers and producers (graph/ir.py) answers what a scan of every node
    answered: the passes build the same graph, node for node, and outliers.py finds the same inputs."""
    from llamajet.graph.passes.outliers import quantized_inputs

    ctx = FusionContext(act_int8=act_int8, prequant_head=act_int8)
    runs = []
    for indexed in (True, False):
        if not indexed:
            _index_off(monkeypatch)
        g = _graph(smollm2, scheme=None)
        log = fuse(g, ctx)
        q = [(p.name, t, [r.name for r in rs]) for p, t, rs in quantized_inputs(g)]
        runs.append((log, _whole(g), q))
    assert runs[0] == runs[1]
    assert len(runs[0][0]) > 100 and (len(runs[0][2]) > 0) == act_int8


def test_fusion_scans_the_nodes_once(smollm2, monkeypatch):
    """The passes' queries (consumers, producer, index) read the index, which their rewrites keep up
    to date: one pass over the nodes builds it for the whole fusion. Before it, fusing SmolLM2-135M
    scanned every node 543 times for consumers and 181 times for producers."""
    from llamajet.graph import ir

    monkeypatch.setattr(ir, "_LOG_MAX", 1 << 30)  # no cut of the change log (that costs one rebuild)
    g = _graph(smollm2, scheme=None)
    before = _NodeList.rebuilds
    log = fuse(g, FusionContext(act_int8=True, prequant_head=True))
    assert len(log) > 100
    assert _NodeList.rebuilds - before == 1


def test_the_index_follows_every_kind_of_change(tiny):
    """Random rewrites through each way a node list or an operand dict can change, on a graph and on
    a copy.copy of it given a shorter list (engine/outliers.py's probe): after each, every query
    equals a scan's answer."""
    rng = np.random.default_rng(0)
    g = _graph(tiny)
    probe = copy.copy(g)
    probe.nodes = list(g.nodes)[: len(g.nodes) // 2]
    tensors = sorted({t for n in g.nodes for t in n.reads() + n.writes()})

    def check(graph):
        for t in rng.choice(tensors, 40):
            assert graph.consumers(t) == _scan_consumers(graph, t)
            assert graph.producer(t) is graph.producers().get(t)
        for n in rng.choice(np.array(list(graph.nodes), dtype=object), 10):
            assert graph.index(n) == _scan_index(graph, n)

    def some_node(graph):
        return graph.nodes[int(rng.integers(len(graph.nodes)))]

    changes = [
        lambda gr: some_node(gr).inputs.__setitem__("x", str(rng.choice(tensors))),
        lambda gr: some_node(gr).inputs.pop(next(iter(some_node(gr).inputs), None), None),
        lambda gr: some_node(gr).inputs.update(extra=str(rng.choice(tensors))),
        lambda gr: setattr(some_node(gr), "outputs", {"out": str(rng.choice(tensors))}),
        lambda gr: gr.insert(int(rng.integers(len(gr.nodes))), some_node(gr)),
        lambda gr: gr.nodes.insert(0, gr.nodes.pop()),
        lambda gr: gr.nodes.__setitem__(slice(0, 2), gr.nodes[1::-1]),
        lambda gr: gr.nodes.reverse(),
        lambda gr: gr.nodes.append(some_node(gr)),  # a node twice: the index turns off
        lambda gr: gr.nodes.remove(gr.nodes[-1]),  # ... and on again
    ]
    for step in range(60):
        graph = (g, probe)[step % 2]
        changes[step % len(changes)](graph)
        check(g)
        check(probe)
