"""Lowering: a planned Graph -> typed ops appended to a C++ Executor.

One generic rule, no per-op code: each node becomes its op's params struct
(``ops.OPS[node.op]``, fields by name), with
- every operand field set to a Ref of the tensor it names: an activation's
  arena offset (from the MemoryPlan), a weight's array; the step's inputs
  (token ids) and state tensors (ordering only) are not operands;
- every attr set to the value field of the same name (a typo is an error
  naming the node), after the caller's per-op defaults (e.g. matmul's
  ``float_act`` for the W*A16 kernels);
- ``layer`` (attention, kv_write) naming that layer's K and V pools, which
  become the ``k_pool`` / ``v_pool`` fields.
The executor checks every operand's extent and shape again at this boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from llamajet import ops
from llamajet.graph.ir import Graph
from llamajet.graph.planner import MemoryPlan


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
    dtype: str = "f32"  # a key of ops.KV_DTYPES

    @property
    def code(self) -> ops.DType:
        try:
            return ops.KV_DTYPES[self.dtype]
        except KeyError:
            raise ValueError(f"KV cache dtype {self.dtype!r}: use one of {', '.join(ops.KV_DTYPES)}") from None

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

    def refs(self, layer: int) -> tuple[Any, Any]:
        """Refs of the layer's K and V pools: [slots, kv_dim], group = head_dim."""
        return tuple(ops.Ref.in_buffer(self.buffer, self.offset(layer, which), self.code, self.num_slots,
                                       self.kv_dim, self.head_dim) for which in (0, 1))

    @staticmethod
    def row_bytes_of(dtype: str, kv_heads: int, head_dim: int) -> int:
        code = KVLayout(-1, 0, kv_heads, head_dim, 1, dtype).code
        return ops.tensor_bytes(code, 1, kv_heads * head_dim, head_dim)

    @staticmethod
    def nbytes(num_layers: int, num_slots: int, kv_heads: int, head_dim: int, dtype: str = "f32") -> int:
        return 2 * num_layers * KVLayout(-1, num_slots, kv_heads, head_dim, 1, dtype).pool_bytes


def _rows(lead) -> int:
    return {"T": ops.ROWS_TOKENS, "O": ops.ROWS_OUT}.get(lead, lead)


def tensor_ref(graph: Graph, plan: MemoryPlan, arena: int, t: str):
    """The Ref of tensor `t`: an activation in the arena, or a weight's array."""
    spec = graph.tensors[t]
    shape = spec.shape if spec.shape else (1,)
    rows, cols = (shape[0], shape[-1]) if len(shape) > 1 else ((1, shape[0]) if spec.kind == "weight" else
                                                                (shape[0], 1))
    if spec.kind == "weight":
        w = graph.weights[t]
        if w.pending is not None:  # compile_graph writes every deferred weight first
            raise RuntimeError(f"{t}: weight bytes not written yet (formats.pending.materialize)")
        if not w.data.flags.c_contiguous:  # a part of a saved gate/up not fused here (formats/saved.py)
            w = graph.weights[t] = replace(w, data=np.ascontiguousarray(w.data), stacked=None)
        return ops.Ref.from_array(w.data, w.code, rows, cols, w.group)
    return ops.Ref.in_buffer(arena, plan.offsets[t], ops.dtype(spec.dtype), _rows(rows), cols, spec.group)


def lower(graph: Graph, plan: MemoryPlan, exe, arena: int, kv: KVLayout,
          defaults: dict[str, dict[str, Any]] | None = None) -> None:
    """Appends one op per node of `graph` to executor `exe`. `defaults`: per op
    name, value fields set before the node's own attrs."""
    defaults = defaults or {}
    for n in graph.nodes:
        cls = ops.OPS.get(n.op)
        if cls is None:
            raise ValueError(f"{n.name}: no kernel for op {n.op!r}")
        p = cls()
        try:
            for fld, t in {**n.inputs, **n.outputs}.items():
                if graph.tensors[t].kind not in ("input", "state"):
                    setattr(p, fld, tensor_ref(graph, plan, arena, t))
            for k, v in {**defaults.get(n.op, {}), **n.attrs}.items():
                if k == "layer":
                    p.k_pool, p.v_pool = kv.refs(v)
                else:
                    setattr(p, k, v)
            exe.add(p)
        except (ValueError, AttributeError, TypeError) as e:  # re-raise with the node's name
            raise ValueError(f"{n.name}: {e}") from e
