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


@dataclass(frozen=True)
class KVLayout:
    """Where each layer's K and V pools live in the executor's KV buffer.

    Layout: [layer][K|V][slot][kv_heads * head_dim] fp32; a slot is
    block * block_size + offset within the block."""

    buffer: int
    num_slots: int
    kv_dim: int
    block_size: int

    def offset(self, layer: int, which: int) -> int:
        return ((2 * layer + which) * self.num_slots * self.kv_dim) * 4

    @staticmethod
    def nbytes(num_layers: int, num_slots: int, kv_dim: int) -> int:
        return 2 * num_layers * num_slots * kv_dim * 4


def _rows(graph: Graph, tensor: str) -> int:
    lead = graph.tensors[tensor].shape[0]
    return {"T": ops.ROWS_TOKENS, "O": ops.ROWS_OUT}.get(lead, lead)


def lower(graph: Graph, plan: MemoryPlan, exe, arena: int, kv: KVLayout) -> None:
    """Appends one op per node of `graph` to executor `exe`."""

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
            ops_args = dict(wtype=table.dtype, rows=ops.ROWS_TOKENS, ints=[table.shape[1]], floats=[],
                            opnd=[None, None, table.data, None, a(out), None])
        elif n.op == "rmsnorm":
            dim = graph.tensors[out].shape[-1]
            ops_args = dict(wtype="f32", rows=_rows(graph, out), ints=[dim], floats=[at["eps"]],
                            opnd=[a(x), None, wt(n.inputs[1]), None, a(out), None])
        elif n.op == "matmul":
            w = graph.weights[n.inputs[1]]
            N, K = w.shape
            ops_args = dict(wtype=w.dtype, rows=_rows(graph, out), ints=[N, K], floats=[],
                            opnd=[a(x), None, w.data, None, a(out), None])
        elif n.op == "rope":
            H, hd = at["heads"], at["head_dim"]
            ops_args = dict(wtype="f32", rows=ops.ROWS_TOKENS, ints=[H, hd, int(at["interleaved"]), H * hd],
                            floats=[], opnd=[a(x), None, wt(n.inputs[1]), wt(n.inputs[2]), a(out), None])
        elif n.op == "kv_write":
            L = at["layer"]
            kpool, vpool = (kv.buffer, kv.offset(L, 0)), (kv.buffer, kv.offset(L, 1))
            ops_args = dict(wtype="f32", rows=ops.ROWS_TOKENS, ints=[kv.kv_dim], floats=[],
                            opnd=[a(x), a(n.inputs[1]), None, None, kpool, vpool])
        elif n.op == "attention":
            L = at["layer"]
            kpool, vpool = (kv.buffer, kv.offset(L, 0)), (kv.buffer, kv.offset(L, 1))
            ops_args = dict(wtype="f32", rows=ops.ROWS_TOKENS,
                            ints=[at["heads"], at["kv_heads"], at["head_dim"], kv.block_size],
                            floats=[at["scale"]], opnd=[a(x), None, kpool, vpool, a(out), None])
        elif n.op in ("swiglu", "add"):
            dim = graph.tensors[out].shape[-1]
            ops_args = dict(wtype="f32", rows=_rows(graph, out), ints=[dim], floats=[],
                            opnd=[a(x), a(n.inputs[1]), None, None, a(out), None])
        elif n.op == "gather":
            dim = graph.tensors[out].shape[-1]
            ops_args = dict(wtype="f32", rows=ops.ROWS_OUT, ints=[dim], floats=[],
                            opnd=[a(x), None, None, None, a(out), None])
        else:
            raise ValueError(f"{n.name}: no kernel for op {n.op!r}")
        try:
            exe.add_op(ops.OPS[n.op], ops.DTYPES[ops_args["wtype"]], ops_args["rows"], ops_args["ints"],
                       ops_args["floats"], ops_args["opnd"])
        except ValueError as e:  # re-raise with the node's name
            raise ValueError(f"{n.name}: {e}") from e
