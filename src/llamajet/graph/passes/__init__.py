"""Fusion passes over the Graph IR, one file each.

Each pass is a pattern rewrite, matched by structure (the producers and
readers of tensors, the roles of named operands), never by node names. It
checks its legality rules first and leaves the graph unchanged where one
fails:
  - no cycle: the fused node takes the place of the pattern's first node, and
    every input it reads is produced before that place;
  - an intermediate the fusion removes has no consumer outside the pattern;
  - same dtype / storage kind, compatible shapes (tile and head alignment).
Order: qkv -> gate_up -> residual -> norm_head -> add_rmsnorm -> attn_quant
-> ffn_quant (the later ones match what the earlier ones leave: once o-proj
absorbs its residual add there is no add left before the next norm, and that
norm then quantizes on write; attention quantizes on write for the o-proj;
a quantize op after gate/up + SwiGLU feeds the down projection).

``fuse(graph, ctx)`` runs them in order and returns the log of rewrites.
"""

from __future__ import annotations

from dataclasses import dataclass

from llamajet.graph.ir import Graph


@dataclass(frozen=True)
class FusionContext:
    """What the passes must know about how the graph will run."""

    act_int8: bool = True   # packed matmuls take int8 activations (W*A8)
    # the LM head reads its input quantized by the final norm (quantize-on-write) instead of
    # normalizing it in its prologue, so passes/outliers.py can give that input outlier channels
    prequant_head: bool = False


PASSES = ("qkv", "gate_up", "residual", "norm_head", "add_rmsnorm", "attn_quant", "ffn_quant")


def fuse(graph: Graph, ctx: FusionContext | None = None, only: tuple[str, ...] | None = None) -> list[str]:
    """Runs the passes (or those named in `only`) in order; returns the log."""
    from importlib import import_module

    ctx = ctx or FusionContext()
    log: list[str] = []
    for name in PASSES:
        if only is None or name in only:
            log += import_module(f"llamajet.graph.passes.{name}").run(graph, ctx)
    # weights no node reads any more (the unstacked q/k/v, gate/up) are dropped,
    # so the stacked copies are the only ones kept alive
    used = {t for n in graph.nodes for t in n.reads()}
    for w in [w for w in graph.weights if w not in used]:
        del graph.weights[w]
        del graph.tensors[w]
    graph.verify()
    return log
