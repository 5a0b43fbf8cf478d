"""The Python <-> C++ contract: every code and size rule Python uses comes
from the extension (llamajet._core); where Python must name a C++ thing
itself (an option's vocabulary in config.py, which may not import the core;
the formats' names), these tests tie the two together.

References outside llamajet: the `gguf` package's block sizes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from llamajet.errors import LlamajetError

from llamajet import _core, ops
from llamajet.config import KV_CACHE_DTYPES, RuntimeConfig
from llamajet.formats.layout import BLOCKS, FLOATS
from llamajet.formats.schemes import schemes
from llamajet.graph.ir import TensorSpec
from llamajet.graph.lower import KVLayout


def test_kv_option_names_are_the_cores():
    assert KV_CACHE_DTYPES == tuple(ops.KV_DTYPES)
    assert ops.KV_DTYPES["int8"] == ops.DType.KV_I8 and ops.KV_DTYPES["f16"] == ops.DType.F16
    for name in KV_CACHE_DTYPES:  # and every name the config accepts, the runner can lay out
        RuntimeConfig(kv_dtype=name)
        for kvh, hd in ((1, 8), (3, 64)):
            assert KVLayout.row_bytes_of(name, kvh, hd) == _core.kv_row_bytes(ops.KV_DTYPES[name], kvh, hd)


def test_storage_type_names_resolve_to_their_codes():
    for t in ops.DType:
        assert ops.dtype(t.name.lower()) == t and ops.dtype_name(t) == t.name.lower()
    with pytest.raises(ValueError, match="unknown storage type"):
        ops.dtype("q4_k")
    for name, fmt in {**FLOATS, **BLOCKS}.items():
        if getattr(fmt, "native", True):
            assert fmt.code == ops.dtype(name)
        else:  # a GGUF block type the core only reads as its packed twin
            with pytest.raises(LlamajetError, match="repacked at load"):
                fmt.code
    kinds = {(4, True): ops.DType.PK_I4S, (4, False): ops.DType.PK_I4A, (8, True): ops.DType.PK_I8}
    for s in schemes():
        want = kinds[(s.bits, s.symmetric)] if s.rtn else ops.dtype(s.storage)
        assert s.code == want and s.kind == s.code.name.lower()
        assert ops.packed_code_bits(s.code) == s.bits


def test_ggml_block_sizes_equal_the_gguf_packages():
    for name, fmt in BLOCKS.items():  # the core's sizes (the others' come from gguf itself)
        if fmt.native:
            elements, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name.upper()]]
            assert (elements, nbytes) == (ops.QK, fmt.block_bytes), name
    assert ops.GGML_BLOCK_TYPES == {fmt.code for fmt in BLOCKS.values() if fmt.native}


def test_size_rules_are_the_cores():
    # packed storage: the scheme's shape holds exactly the bytes the executor checks
    for s in schemes():
        for n, k in ((16, 64), (37, 172), (5, 1000)):
            if s.group and s.group_for(k) > 1024:
                continue
            shape = s.storage_shape((n, k))
            assert int(np.prod(shape)) == ops.tensor_bytes(s.code, n, k, s.group_for(k)), (s.name, n, k)
            assert shape[2] == _core.packed_block_bytes(s.code, s.group_for(k))
    # the planner sizes q8_act activations with the core's rule
    spec = TensorSpec("q", ("T", 576), "q8_act", group=32)
    # codes [7, 576] padded to 64 bytes, then an fp32 scale and an int32 sum per row and group of 32
    assert spec.nbytes({"T": 7}) == _core.tensor_bytes(ops.DType.Q8_ACT, 7, 576, 32) == -(-7 * 576 // 64) * 64 \
        + 8 * 7 * 18
    assert _core.tensor_bytes(ops.DType.Q8_ACT, 3, 100, 32) == -(-3 * 128 // 64) * 64 + 8 * 3 * 4  # a partial group
    assert ops.tensor_bytes("q4_0", 3, 64) == 3 * 2 * 18 and ops.tensor_bytes("f16", 2, 5) == 20
    assert _core.tensor_bytes(ops.DType.Q4_0, 1, 48, 0) == -1  # no whole blocks
    assert _core.tensor_bytes(ops.DType.F32, 2**40, 2**40, 0) == -1  # does not fit: refused, not wrapped
    assert ops.TILE == 16 and ops.ROWS_TOKENS < 0 and ops.ROWS_OUT < 0 and ops.ROWS_TOKENS != ops.ROWS_OUT


def test_every_op_kind_has_a_params_class_and_the_graph_uses_only_those():
    assert set(ops.OPS) == {k.name for k in ops.OpKind}
    for name, cls in ops.OPS.items():
        p = cls()
        assert cls.fields and all(hasattr(p, f) for f in cls.fields), name
        with pytest.raises(AttributeError):
            p.no_such_field = 1
    # and every op a real graph holds, fused or not, lowers to one of them
    from llamajet.formats.convert import prepare_weights
    from llamajet.graph.passes import fuse
    from llamajet.loaders import load_model
    from llamajet.model import registry
    from conftest import SMOLLM2_GGUF

    if SMOLLM2_GGUF is None:
        pytest.skip("default model not installed")
    m = load_model(SMOLLM2_GGUF)
    g = registry.get(m.config.architecture).build(m.config, prepare_weights(m.weights), 64)
    unfused = {n.op for n in g.nodes}
    fuse(g)
    assert unfused | {n.op for n in g.nodes} == set(ops.OPS)  # every kernel is used by some graph


def test_enums_are_exported_with_their_values():
    assert [e.name for e in ops.Epilogue] == ["STORE", "RESIDUAL", "SWIGLU", "QKV"]
    assert [p.name for p in ops.Prologue] == ["NONE", "PREQUANT", "RMSNORM"]
    p = ops.OPS["matmul"]()
    assert p.epilogue == ops.Epilogue.STORE and p.prologue == ops.Prologue.NONE  # the C++ defaults
    assert ops.OPS["rmsnorm"]().eps == pytest.approx(1e-5)
