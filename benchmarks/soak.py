"""The engine soak of tests/test_soak.py, for minutes instead of seconds.

    python benchmarks/soak.py [--minutes 10]

Runs the same hypothesis state machine (random requests, steps and
cancellations on stories260K with a KV pool that forces preemption; the
pool, the cache, nothing lost and greedy-equals-alone checked after every
rule) batch after batch with fresh random examples until the time is up,
then prints the counts. Any failure stops it with hypothesis's shrunk
example.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hypothesis import HealthCheck, settings  # noqa: E402

from llamajet import LLM  # noqa: E402
from tests import test_soak  # noqa: E402

STORIES = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "models" / "stories260K-hf"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    a = ap.parse_args(argv)
    busy = LLM(STORIES, max_model_len=128, kv_cache_tokens=96, max_num_seqs=4, max_tokens_per_step=48)
    alone = LLM(STORIES, max_model_len=128, max_num_seqs=1, enable_prefix_caching=False)
    machine = test_soak.soak_machine(busy, alone)
    machine.TestCase.settings = settings(max_examples=25, stateful_step_count=60, deadline=None, database=None,
                                         suppress_health_check=list(HealthCheck))
    test_soak.COUNTS.clear()
    t0, batches = time.perf_counter(), 0
    while time.perf_counter() - t0 < 60 * a.minutes:
        machine.TestCase().runTest()
        batches += 1
    machine.engines.clear()
    c = test_soak.COUNTS
    print(f"soak: {time.perf_counter() - t0:.0f} s, {batches} batches of 25 random runs x up to 60 rules; "
          f"requests {c['requests']}, steps {c['steps']}, preemptions {c['preemptions']}, "
          f"cancellations {c['cancellations']}, invariant checks {c['checks']}, "
          f"greedy-vs-alone comparisons {c['greedy_compared']}; failures: 0")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
