"""Graphviz DOT of a graph: ``dot -Tsvg graph.dot -o graph.svg``.

Ops are rounded boxes labelled with name and kernel; each activation is an
edge from its producer to every reader, labelled with the tensor's name and
shape (and arena slot when a plan is given). Weights are grey boxes feeding
their nodes (leave them out with weights=False: the RoPE tables alone feed
every layer). KV-state edges are dashed: they only order a layer's cache
write before its attention.
"""

from __future__ import annotations

from llamajet.graph.ir import Graph
from llamajet.graph.planner import MemoryPlan
from llamajet.graph.show import kernel_name, shape_str, storage_name


def _q(s: str) -> str:
    """A DOT string literal; `\\n` in `s` stays a DOT line break."""
    return '"' + s.replace('"', '\\"') + '"'


def to_dot(graph: Graph, plan: MemoryPlan | None = None, isa: str = "", *, act_int8: bool = True,
           kv_dtype: str = "f32", weights: bool = True, name: str = "llamajet") -> str:
    out = [f"digraph {_q(name)} {{", "  rankdir=TB;",
           '  node [shape=box, style=rounded, fontname="monospace", fontsize=10];',
           '  edge [fontname="monospace", fontsize=8];']
    producer = graph.producers()
    for n in graph.nodes:
        label = f"{n.name}\\n{kernel_name(graph, n, isa or '?', act_int8=act_int8, kv_dtype=kv_dtype)}"
        out.append(f"  {_q('n:' + n.name)} [label={_q(label)}];")
    for t, spec in graph.tensors.items():
        if spec.kind == "input":
            label = f"{t}{shape_str(spec.shape)}"
            out.append(f"  {_q('t:' + t)} [shape=ellipse, style=solid, label={_q(label)}];")
        elif spec.kind == "weight" and weights and graph.consumers(t):
            w = graph.weights.get(t)
            kind = storage_name(w) if w is not None else spec.dtype
            label = f"{t}{shape_str(spec.shape)}\\n{kind}"
            out.append(f"  {_q('t:' + t)} [shape=box, style=filled, fillcolor=lightgrey, label={_q(label)}];")
    for n in graph.nodes:
        for t in n.reads():
            spec = graph.tensors[t]
            if spec.kind in ("input", "weight"):
                if spec.kind == "weight" and not weights:
                    continue
                out.append(f"  {_q('t:' + t)} -> {_q('n:' + n.name)};")
                continue
            label = f"{t}\\n{'(KV state)' if spec.kind == 'state' else shape_str(spec.shape)}"
            if plan is not None and t in plan.offsets:
                label += f" @{plan.offsets[t]}"
            style = ", style=dashed" if spec.kind == "state" else ""
            out.append(f"  {_q('n:' + producer[t].name)} -> {_q('n:' + n.name)} [label={_q(label)}{style}];")
    for t in graph.outputs:  # read by the caller after the step
        spec = graph.tensors[t]
        out.append(f"  {_q('out:' + t)} [shape=ellipse, style=solid, label={_q('output')}];")
        label = f"{t}\\n{shape_str(spec.shape)}"
        out.append(f"  {_q('n:' + producer[t].name)} -> {_q('out:' + t)} [label={_q(label)}];")
    out.append("}")
    return "\n".join(out) + "\n"
