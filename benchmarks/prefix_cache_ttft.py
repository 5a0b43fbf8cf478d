"""Time to first token with and without a cached prefix (the timing the test
suite no longer asserts: tests/test_scheduler.py counts the tokens computed).

A request sharing a 256-token prefix with a finished one: cold (fresh prefix,
264 prompt tokens computed) and warm (the same prefix again, 8 computed), in
alternating pairs so a load burst hits both; medians over --pairs pairs.

    python benchmarks/prefix_cache_ttft.py [--model F.gguf] [--pairs 5]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT.parent / "shared" / "data" / "corpora" / "wikitext-2-raw-test.txt"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--corpus", default=str(CORPUS))
    a = ap.parse_args()
    from llamajet import LLM, SamplingParams

    llm = LLM(a.model, max_model_len=512)
    ids = llm.tokenizer.encode(Path(a.corpus).read_text(encoding="utf-8")[:40_000])
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    cold, warm = [], []
    for r in range(a.pairs):
        prefix = ids[600 * r : 600 * r + 256]  # a fresh prefix each pair: a real cold start
        cold.append(llm.generate([prefix + ids[4000 + 20 * r : 4008 + 20 * r]], p)[0].metrics.ttft_s)
        out = llm.generate([prefix + ids[6000 + 20 * r : 6008 + 20 * r]], p)[0]
        assert out.metrics.cached_tokens == 256
        warm.append(out.metrics.ttft_s)
    c, w = statistics.median(cold), statistics.median(warm)
    print(f"TTFT cold {c * 1e3:.1f} ms, warm (256 of 264 prompt tokens cached) {w * 1e3:.1f} ms: {c / w:.1f}x "
          f"(medians of {a.pairs} alternating pairs; model {llm.path.name})")


if __name__ == "__main__":
    main()
