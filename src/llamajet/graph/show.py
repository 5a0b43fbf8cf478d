"""Human-readable dumps of a (planned) graph, for ``llamajet graph``.

    describe(graph, plan, isa)  one line per node: name, op, the kernel it runs,
                                each output with its shape and arena slot; then totals
    totals(graph, plan)         arena vs the naive sum of activations, the lower
                                bound, node (= barrier) and tensor counts
    summary(graph, plan)        the totals on one line (e.g. the graph before the passes)

Works on any graph, fused or not: an op this module does not know is shown
with its weights' storage types like any other.
"""

from __future__ import annotations

from collections import Counter

from llamajet.formats.weight import Kind
from llamajet.graph.ir import Graph, Node
from llamajet.graph.planner import MemoryPlan


def shape_str(shape: tuple) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def human_bytes(n: int) -> str:
    """'1,447,680 B (1.38 MiB)'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n:,} B ({n / scale:.2f} {unit})"
    return f"{n:,} B"


def storage_name(w) -> str:
    """A weight's storage as the kernels see it: 'pk_i4a g32', 'q4_1', 'f32'."""
    group = w.group  # packed weights have a group length; others 0
    return f"{w.dtype} g{group}" if group else str(w.dtype)


def kernel_name(graph: Graph, node: Node, isa: str, *, act_int8: bool = True, kv_dtype: str = "f32") -> str:
    """The kernel a node runs: op kind, operand storage, ISA, e.g.
    'matmul[pk_i4a g32 a8, avx512]' (a8: int8 activations, a16: float ones),
    followed by the prologue / epilogue a fusion pass gave it."""
    if node.op in ("kv_write", "attention"):
        what = [f"kv {kv_dtype}"]  # the pool's storage type, not a weight's
    else:
        what = []
        for t in node.reads():
            w = graph.weights.get(t) if graph.tensors[t].kind == "weight" else None
            if w is None or w.kind is Kind.TABLE:
                continue  # activations and builder tables (RoPE) are f32
            s = storage_name(w)
            if w.group and node.op != "embed":
                s += " a8" if act_int8 else " a16"
            if s not in what:
                what.append(s)
        what = what or ["f32"]
    name = f"{node.op}[{', '.join(what)}, {isa}]"
    # fused work around the main loop (graph/passes), e.g. prologue=prequant epilogue=qkv
    for k in ("prologue", "epilogue"):
        if node.attrs.get(k):
            name += f" {k}={node.attrs[k].name.lower()}"
    return name


def _out_cell(graph: Graph, plan: MemoryPlan | None, t: str) -> str:
    spec = graph.tensors[t]
    if spec.kind == "state":
        return f"{t} (state: KV pool)"
    cell = f"{t}{'' if spec.dtype == 'f32' else ':' + spec.dtype}{shape_str(spec.shape)}"
    if plan is not None and t in plan.offsets:
        cell += f" @{plan.offsets[t]} +{plan.sizes[t]}"
    return cell


def describe(graph: Graph, plan: MemoryPlan | None, isa: str, *, act_int8: bool = True,
             kv_dtype: str = "f32", inputs: bool = True) -> str:
    """The listing: one line per node, then `totals`. Offsets and sizes are
    bytes into the arena (sizes rounded up to the planner's alignment)."""
    rows = []
    for j, n in enumerate(graph.nodes):
        outs = "; ".join(_out_cell(graph, plan, t) for t in n.writes())
        ins = ", ".join(n.reads()) if inputs else ""
        rows.append((str(j), n.name, n.op, kernel_name(graph, n, isa, act_int8=act_int8, kv_dtype=kv_dtype),
                     outs, ins))
    head = ("#", "node", "op", "kernel", "outputs  name[shape] @offset +bytes", "inputs" if inputs else "")
    widths = [max(len(r[k]) for r in [head, *rows]) for k in range(4)]

    def line(r):
        s = "  ".join(r[k].rjust(widths[k]) if k == 0 else r[k].ljust(widths[k]) for k in range(4))
        s += "  " + r[4]
        return s + (f"  <- {r[5]}" if r[5] else "")

    lines = [line(head)] + [line(r) for r in rows]
    if plan is not None:
        lines += ["", totals(graph, plan)]
    return "\n".join(lines)


def _symbols(plan: MemoryPlan) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(plan.symbols.items()))


def totals(graph: Graph, plan: MemoryPlan) -> str:
    kinds = Counter(spec.kind for spec in graph.tensors.values())
    lower = plan.peak_live_bytes()
    ratio = plan.naive_bytes / plan.arena_bytes if plan.arena_bytes else float("inf")
    kind_list = ", ".join(f"{kinds[k]} {k}" for k in ("activation", "weight", "state", "input") if kinds[k])
    read = {t for n in graph.nodes for t in n.reads() if graph.tensors[t].kind == "weight"}
    if len(read) < kinds["weight"]:  # e.g. matrices a fusion pass stacked into one
        kind_list += f"; {len(read)} weights read by a node"
    return "\n".join([
        f"arena:   {human_bytes(plan.arena_bytes)} for {_symbols(plan)}; allocated once, reused every step "
        f"({plan.strategy} placement)",
        f"naive:   {human_bytes(plan.naive_bytes)} = every activation in its own buffer",
        f"ratio:   arena is {ratio:.2f}x smaller than naive; peak live bytes at one node (lower bound) "
        f"{human_bytes(lower)}, arena = {plan.arena_bytes / lower if lower else 1.0:.3f}x of it",
        f"nodes:   {len(graph.nodes)} = ops per step, each cut into chunks the threads claim",
        f"tensors: {len(graph.tensors)} ({kind_list})",
    ])


def summary(graph: Graph, plan: MemoryPlan) -> str:
    n_act = sum(1 for s in graph.tensors.values() if s.kind == "activation")
    ratio = plan.naive_bytes / plan.arena_bytes if plan.arena_bytes else float("inf")
    return (f"{len(graph.nodes)} nodes, {n_act} activations; arena {human_bytes(plan.arena_bytes)} vs naive "
            f"{human_bytes(plan.naive_bytes)} ({ratio:.2f}x)")
