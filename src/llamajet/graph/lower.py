"""Lowering: a planned Graph -> ops appended to a C++ Executor (its Program).

Each node becomes one executor op whose operands are arena offsets (from the
MemoryPlan), KV-pool offsets, or weight arrays. The executor checks every
operand's extent again at this boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

from llamajet import ops
from llamajet.graph.ir import Graph
from llamajet.graph.planner import MemoryPlan


# KV storage types -> csrc/common.h DType codes (kv_write / attention wtype).
# f32/f16/bf16 are the weight codes; int8 is KV_I8 (per token-head fp32 scale).
KV_DTYPES = {"f32": 0, "f16": 1, "bf16": 2, "int8": 16}


@dataclass(frozen=True)
class KVLayout:
    """Where each layer's K and V pools live in the executor's KV buffer.

    Layout: [layer][K|V][slot][row]; a slot is block * block_size + offset
    within the block, a row is kv_heads heads of head_dim values in `dtype`
    (int8: per head an fp32 scale, then head_dim int8 codes; see
    csrc/kernels/attention.inc). K pools of fp32, fp16 and int8 hold each
    block transposed (per kv head a [head_dim][block_size] tile; int8: then
    the tile's scales), in the same bytes per block. Each pool starts 64-byte
    aligned."""

    buffer: int
    num_slots: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "f32"

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def row_bytes(self) -> int:
        return self.row_bytes_of(self.dtype, self.kv_heads, self.head_dim)

    @property
    def pool_bytes(self) -> int:
        """Bytes of one layer's K (or V) pool, padded to 64."""
        return -(-self.num_slots * self.row_bytes // 64) * 64

    def offset(self, layer: int, which: int) -> int:
        return (2 * layer + which) * self.pool_bytes

    @staticmethod
    def row_bytes_of(dtype: str, kv_heads: int, head_dim: int) -> int:
        if dtype not in KV_DTYPES:
            raise ValueError(f"KV cache dtype {dtype!r}: use one of {', '.join(KV_DTYPES)}")
        if dtype == "int8":
            return kv_heads * (head_dim + 4)
        return kv_heads * head_dim * (4 if dtype == "f32" else 2)

    @staticmethod
    def nbytes(num_layers: int, num_slots: int, kv_heads: int, head_dim: int, dtype: str = "f32") -> int:
        return 2 * num_layers * KVLayout(-1, num_slots, kv_heads, head_dim, 1, dtype).pool_bytes


# matmul epilogue / prologue codes (csrc/kernels/matmul.inc)
_EPI = {"store": 0, "residual": 1, "swiglu": 2, "qkv": 3}
_PRO = {"none": 0, "prequant": 1, "rmsnorm": 2}


def _rows(graph: Graph, tensor: str) -> int:
    lead = graph.tensors[tensor].shape[0]
    return {"T": ops.ROWS_TOKENS, "O": ops.ROWS_OUT}.get(lead, lead)


def lower(graph: Graph, plan: MemoryPlan, exe, arena: int, kv: KVLayout, act_int8: bool = True) -> None:
    """Appends one op per node of `graph` to executor `exe`. Packed weights run
    with int8 activations (W*A8) when `act_int8`, else float ones (W*A16)."""

    def a(t: str):  # an activation operand
        return (arena, plan.offsets[t])

    def wt(t: str):  # a weight operand: the raw storage array
        return graph.weights[t].data

    for n in graph.nodes:
        at = n.attrs
        x = n.inputs[0]
        out = n.outputs[0]
        if n.op == "embed":
            table = graph.weights[n.inputs[0]]
            ints = [table.shape[1], table.shape[0], getattr(table, "group", 0)]
            ops_args = dict(wtype=table.dtype, rows=ops.ROWS_TOKENS, ints=ints, floats=[],
                            opnd=[None, None, table.data, None, a(out), None])
        elif n.op == "rmsnorm":
            dim = graph.tensors[out].shape[-1]
            ops_args = dict(wtype="f32", rows=_rows(graph, out), ints=[dim], floats=[at["eps"]],
                            opnd=[a(x), None, wt(n.inputs[1]), None, a(out), None])
        elif n.op == "matmul":
            w = graph.weights[n.inputs[1]]
            N, K = w.shape
            epi, pro = at.get("epilogue", "store"), at.get("prologue", "none")
            packed = hasattr(w, "group")
            ints = [N, K, w.group if packed else 0, int(packed and not act_int8), _EPI[epi], _PRO[pro],
                    at.get("nq", 0), at.get("nk", 0), at.get("head_dim", 0)]
            opnd = [None if pro == "prequant" else a(x), None, w.data, None, a(out), None, None, None]
            floats = []
            if pro == "prequant":
                opnd[6] = a(at["qin"])
            elif pro == "rmsnorm":
                opnd[6], floats = wt(at["norm_w"]), [at["eps"]]
            if epi == "residual":
                opnd[7] = a(at["res"])
            elif epi == "qkv":  # outputs q_rot, k_rot, v
                opnd[1], opnd[3] = wt(at["sin"]), wt(at["cos"])
                opnd[5], opnd[7] = a(n.outputs[1]), a(n.outputs[2])
            ops_args = dict(wtype=w.dtype, rows=_rows(graph, out), ints=ints, floats=floats, opnd=opnd)
        elif n.op == "add_rmsnorm":
            outs = at["outs"]
            n_cols = graph.tensors[x].shape[-1]
            opnd = [a(x), a(n.inputs[1]) if at["has_add"] else None, wt(n.inputs[-1]), None,
                    a(outs["h"]) if "h" in outs else None, a(outs["r"]) if "r" in outs else None,
                    a(outs["q"]) if "q" in outs else None, None]
            ops_args = dict(wtype="f32", rows=_rows(graph, x), ints=[n_cols, at["group"]],
                            floats=[at["eps"]], opnd=opnd)
        elif n.op == "quantize":
            ops_args = dict(wtype="f32", rows=_rows(graph, x), ints=[graph.tensors[x].shape[-1], at["group"]],
                            floats=[], opnd=[a(x), None, None, None, None, None, a(out), None])
        elif n.op == "rope":
            H, hd = at["heads"], at["head_dim"]
            ops_args = dict(wtype="f32", rows=ops.ROWS_TOKENS, ints=[H, hd, int(at["interleaved"]), H * hd],
                            floats=[], opnd=[a(x), None, wt(n.inputs[1]), wt(n.inputs[2]), a(out), None])
        elif n.op == "kv_write":
            L = at["layer"]
            kpool, vpool = (kv.buffer, kv.offset(L, 0)), (kv.buffer, kv.offset(L, 1))
            ops_args = dict(wtype=KV_DTYPES[kv.dtype], rows=ops.ROWS_TOKENS, ints=[kv.kv_dim, kv.kv_heads],
                            floats=[], opnd=[a(x), a(n.inputs[1]), None, None, kpool, vpool])
        elif n.op == "attention":
            L = at["layer"]
            kpool, vpool = (kv.buffer, kv.offset(L, 0)), (kv.buffer, kv.offset(L, 1))
            ops_args = dict(wtype=KV_DTYPES[kv.dtype], rows=ops.ROWS_TOKENS,
                            ints=[at["heads"], at["kv_heads"], at["head_dim"], kv.block_size, at.get("q_group", 0)],
                            floats=[at["scale"]],
                            opnd=[a(x), None, kpool, vpool, a(out), None, a(at["qout"]) if "qout" in at else None, None])
        elif n.op in ("swiglu", "add"):
            dim = graph.tensors[out].shape[-1]
            ops_args = dict(wtype="f32", rows=_rows(graph, out), ints=[dim], floats=[],
                            opnd=[a(x), a(n.inputs[1]), None, None, a(out), None])
        elif n.op == "argmax":
            ops_args = dict(wtype="f32", rows=_rows(graph, x), ints=[graph.tensors[x].shape[-1]], floats=[],
                            opnd=[a(x), None, None, None, a(out), None])
        elif n.op == "gather":
            dim = graph.tensors[out].shape[-1]
            ops_args = dict(wtype="f32", rows=ops.ROWS_OUT, ints=[dim], floats=[],
                            opnd=[a(x), None, None, None, a(out), None])
        else:
            raise ValueError(f"{n.name}: no kernel for op {n.op!r}")
        try:
            wtype = ops_args["wtype"]  # a storage-type name, or already a code (KV ops)
            exe.add_op(ops.OPS[n.op], wtype if isinstance(wtype, int) else ops.DTYPES[wtype], ops_args["rows"],
                       ops_args["ints"], ops_args["floats"], ops_args["opnd"])
        except ValueError as e:  # re-raise with the node's name
            raise ValueError(f"{n.name}: {e}") from e
