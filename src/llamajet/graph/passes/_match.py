"""Helpers shared by the passes: graph queries and the int8 input copy.

Weights are stacked for fused ops by their owner, the formats layer
(formats/stack.py); passes only ask for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llamajet import ops
from llamajet.formats.weight import Kind, float_weight
from llamajet.graph.ir import Graph, Node


def only_consumer(graph: Graph, tensor: str) -> Node | None:
    """The single node reading `tensor` (None if zero or several, or if it is a graph output)."""
    if tensor in graph.outputs:
        return None
    cs = graph.consumers(tensor)
    return cs[0] if len(cs) == 1 else None


def plain_matmul(n: Node | None) -> bool:
    """A matmul no pass has touched: input x, weights w (and maybe a bias),
    output out, nothing fused."""
    return (n is not None and n.op == "matmul" and set(n.inputs) - {"bias"} == {"x", "w"}
            and set(n.outputs) == {"out"} and not n.attrs)


@dataclass(frozen=True)
class QuantInput:
    """How a tensor's readers want it quantized: groups of `group` (their sums),
    one scale per `span` values; dtype q8_act (span = group) or q8_actk (the
    K-quants' 256: formats.schemes.QuantScheme.act_dtype)."""
    group: int
    dtype: str

    @property
    def span(self) -> int:
        return ops.qact_span(self.dtype, self.group)

    def __str__(self) -> str:
        return f"int8 g{self.group}" + (f" (one scale per {self.span})" if self.span != self.group else "")


def quant_readers(graph: Graph, t: str, ctx) -> QuantInput | None:
    """How t is quantized if every reader of t can take it pre-quantized
    (packed matmuls with int8 activations, no prologue, one group and one
    activation type, K = t's width), else None."""
    readers = graph.consumers(t)
    if not ctx.act_int8 or not readers or t in graph.outputs:
        return None
    wants = set()
    for r in readers:
        if r.op != "matmul" or r.inputs.get("x") != t or r.attrs.get("prologue", ops.Prologue.NONE) != ops.Prologue.NONE:
            return None
        w = graph.weights[r.inputs["w"]]
        if not w.packed or w.shape[1] != graph.tensors[t].shape[-1]:
            return None
        wants.add(QuantInput(w.group, w.scheme.act_dtype))
    return wants.pop() if len(wants) == 1 else None


def prequant_copy(graph: Graph, t: str, name: str, qi: QuantInput) -> str:
    """A new q8_act / q8_actk tensor `name`.q8 holding t quantized as qi says
    (int8 codes, scales, sums), and every reader of t switched to read it with
    the prequant prologue. Returns its name."""
    spec = graph.tensors[t]
    tq = graph.tensor(f"{name}.q8", spec.shape, qi.dtype, group=qi.group)
    for r in graph.consumers(t):
        del r.inputs["x"]
        r.inputs["qin"] = tq
        r.attrs["prologue"] = ops.Prologue.PREQUANT
    return tq


def biases(graph: Graph, nodes: list[Node], name: str):
    """The biases of matmuls `nodes` (zeros for one without: adding 0 changes
    nothing), or None when none has one."""
    if not any("bias" in n.inputs for n in nodes):
        return None
    out = []
    for n in nodes:
        if "bias" in n.inputs:
            out.append(graph.weights[n.inputs["bias"]])
        else:
            rows = graph.weights[n.inputs["w"]].shape[0]
            out.append(float_weight(f"{name}.{len(out)}", Kind.BIAS, np.zeros(rows, np.float32)))
    return out


def drop_unread_weights(graph: Graph, names) -> None:
    """Weights `names` no node reads any more (the parts a pass just stacked)
    leave the graph now, not at the end of the passes: a load then holds one
    layer's parts beside the stacked copies, not every layer's (fuse() also
    drops whatever is left unread at the end)."""
    for w in names:
        if w in graph.weights and not graph.consumers(w):
            del graph.weights[w]
            del graph.tensors[w]
