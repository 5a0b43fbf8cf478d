"""What the outlier channels (RuntimeConfig.act_outliers) cost a load: LLM(path) timed with
each given act_outliers in turn (warm page cache; run a list like 12,0,12,0 and read the later
rounds), with the probe (engine/outliers.input_absmax) and the wiring (graph/passes/outliers.apply,
the weight columns included) timed inside it.

    python benchmarks/outlier_load.py [MODEL] [--outliers 12,0,12,0]

MODEL: a GGUF or folder (default: the default model); the random-weight real shapes come from
benchmarks/make_random_gguf.py (e.g. /tmp/lj-real/8b-q4_k_m.gguf --shape 8b --mix q4_k_m).
"""

from __future__ import annotations

import argparse
import time

import llamajet.engine.runner as runner
from llamajet import LLM


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--outliers", default="12,0,12,0")
    a = ap.parse_args(argv)
    spent: dict[str, float] = {}

    def timed(obj, name):
        f = getattr(obj, name)

        def g(*args, **kw):
            t = time.perf_counter()
            try:
                return f(*args, **kw)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
        setattr(obj, name, g)

    timed(runner.find_outliers, "input_absmax")
    timed(runner.outlier_pass, "apply")
    for k in [int(x) for x in a.outliers.split(",")]:
        spent.clear()
        t = time.perf_counter()
        llm = LLM(a.model, act_outliers=k, max_model_len=4096)
        dt = time.perf_counter() - t
        parts = ", ".join(f"{n} {s:.2f} s" for n, s in spent.items())
        print(f"act_outliers={k}: load {dt:.2f} s" + (f" ({parts})" if parts else ""), flush=True)
        del llm
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
