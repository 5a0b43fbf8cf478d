"""Structured output speed: json_schema generation vs unconstrained, at 1 and
16 concurrent requests, on a model with Llama-3's 128k vocabulary.

    python benchmarks/make_random_gguf.py /tmp/lj-real/1b-q4_0.gguf --shape 1b --mix q4_0
    python benchmarks/structured_speed.py /tmp/lj-real/1b-q4_0.gguf

(llama.cpp's issue #7554: 85 ms/token of grammar sampling against 10.6 ms of
eval on a 128k vocabulary; the target here is >= 90% of unconstrained tok/s.)

Both runs use the engine with the same sequences, the same sampling
(temperature 0.8, seeded) and `max_tokens`; the constrained run gives every
sequence a GrammarConstraint from the server's own path (llguidance masks,
one matcher per sequence). The schema's strings and arrays are unbounded, so
a random-weight model keeps generating inside the grammar rather than ending
early; tok/s counts tokens generated over the steps' wall time. Rounds
alternate between the two and the median round is reported.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

SCHEMA = {"type": "object",
          "properties": {"title": {"type": "string"},
                         "items": {"type": "array", "items": {"type": "object",
                                                              "properties": {"name": {"type": "string"},
                                                                             "score": {"type": "number"}},
                                                              "required": ["name", "score"]}}},
          "required": ["title", "items"]}


class _Timed:
    """A GrammarConstraint that adds up the time spent in it (mask + consume)."""

    def __init__(self, c) -> None:
        self.c, self.seconds = c, 0.0

    def allowed(self, v):
        t = time.perf_counter()
        m = self.c.allowed(v)
        self.seconds += time.perf_counter() - t
        return m

    def consume(self, tok):
        t = time.perf_counter()
        self.c.consume(tok)
        self.seconds += time.perf_counter() - t

    def is_done(self):
        return self.c.is_done()

    def copy(self):
        return _Timed(self.c.copy())


def run(llm, grammars, batch: int, max_tokens: int, constrained: bool, seed: int) -> tuple[float, int, float]:
    from llamajet.engine.sampling import SamplingParams

    eng = llm.engine
    eng.blocks.reset_cache()
    grammar = grammars.from_json_schema(SCHEMA) if constrained else None
    seqs = []
    for i in range(batch):
        ids = llm.tokenizer.encode(f"Request {seed}-{i}: write a JSON report about topic number {i * 7 + seed}.")
        c = _Timed(grammars.constraint(grammar)) if constrained else None
        p = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=seed * 1000 + i, ignore_eos=True)
        seqs.append(eng.new_sequence(ids, p, c))
    for s in seqs:
        eng.add_request(s)
    t0 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    wall = time.perf_counter() - t0
    mask_s = sum(s.constraint.seconds for s in seqs) if constrained else 0.0
    n = sum(s.num_output for s in seqs)
    for s in seqs:
        s.events.clear()
    return n / wall, n, mask_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    from llamajet import LLM
    from llamajet.server.grammar import Grammars

    batches = [int(b) for b in a.batches.split(",")]
    opts = {"max_num_seqs": max(batches), "max_model_len": 256}
    if a.threads:
        opts["n_threads"] = a.threads
    llm = LLM(a.model, **opts)
    grammars = Grammars(llm.tokenizer, llm.config.vocab_size)
    t = time.perf_counter()
    grammars.ll_tokenizer()
    print(f"model {llm.path.name}: vocab {llm.config.vocab_size}, isa {llm.isa}, threads {llm.n_threads}; "
          f"llguidance tokenizer built in {time.perf_counter() - t:.2f} s (once per server)")
    run(llm, grammars, 2, 4, True, 0)  # warm-up both paths
    run(llm, grammars, 2, 4, False, 0)
    print(f"| batch | unconstrained tok/s | json_schema tok/s | ratio | json tokens/seq (of {a.max_tokens}) | "
          "grammar ms/token | grammar share of time |\n|---|---|---|---|---|---|---|")
    ok = True
    for b in batches:
        free, cons, toks, mask = [], [], [], []
        for r in range(a.rounds):
            free.append(run(llm, grammars, b, a.max_tokens, False, r + 1)[0])
            tps, n, ms = run(llm, grammars, b, a.max_tokens, True, r + 1)
            cons.append(tps)
            toks.append(n / b)
            mask.append(ms / n)
        f, c = statistics.median(free), statistics.median(cons)
        ok &= c / f >= 0.9
        print(f"| {b} | {f:.1f} | {c:.1f} | {c / f:.3f} | {statistics.mean(toks):.1f} | "
              f"{1e3 * statistics.median(mask):.3f} | {100 * statistics.median(mask) * c:.1f}% |", flush=True)
    print("target >= 0.90:", "met" if ok else "MISSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
