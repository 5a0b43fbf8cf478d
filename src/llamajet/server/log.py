"""What an operator reads in `llamajet serve`'s log: a startup banner
(model, weights, context, threads, ISA, KV pool), one access line per
request (route, status, prompt and completion tokens, time to first token,
duration), and the drain's start and end. Loggers `llamajet.server` and
`llamajet.access`, on stderr at the level of --log-level."""

from __future__ import annotations

import logging
from collections import Counter

server_log = logging.getLogger("llamajet.server")
access_log = logging.getLogger("llamajet.access")


def setup(level: str) -> None:
    """A stderr handler for the llamajet loggers (uvicorn configures its own
    only), in uvicorn's line format."""
    lg = logging.getLogger("llamajet")
    if not any(getattr(h, "_llamajet", False) for h in lg.handlers):
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        h._llamajet = True
        lg.addHandler(h)
    lg.setLevel(level.upper())
    lg.propagate = False


def banner(llm, model_name: str) -> str:
    from llamajet import ops

    r = llm.engine.runner
    mib = 2 ** 20
    by_type: Counter = Counter()
    for w in r.weights.values():
        by_type[w.dtype] += w.data.nbytes
    formats = ", ".join(f"{t} {b / mib:.0f} MiB" for t, b in by_type.most_common())
    usable, why = ops.usable_cores()
    cfg = llm.model.config
    return (f"serving {model_name!r}: {llm.model.source} ({cfg.name or cfg.architecture}, "
            f"architecture {cfg.architecture}, {cfg.num_layers} layers); weights {formats}; "
            f"context {r.max_model_len} tokens; {r.n_threads} threads of {usable} usable cores ({why}); "
            f"isa {r.isa}, kernels {llm.runtime.kernels}; KV pool {r.num_blocks * r.block_size} tokens "
            f"({r.kv_pool_bytes / mib:.0f} MiB, {r.num_blocks} blocks of {r.block_size}, {r.kv_dtype}); "
            f"step {r.max_tokens} tokens / {r.max_seqs} sequences")


def access(method: str, path: str, status: int, duration_s: float, counts: dict | None) -> None:
    """counts: what the route recorded (request.state.llamajet_access):
    prompt and completion tokens, seconds to the first token."""
    c = counts if counts is not None else {}
    ttft = c.get("ttft")
    access_log.info("%s %s %d prompt_tokens=%s completion_tokens=%s ttft=%s duration=%.3fs", method, path,
                    status, c.get("prompt_tokens", "-"), c.get("completion_tokens", "-"),
                    f"{ttft:.3f}s" if ttft is not None else "-", duration_s)
