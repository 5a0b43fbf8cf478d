"""Speculative decoding on the default model: llamajet with and without
n-gram speculation, and llama.cpp with and without prompt lookup beside it.

    python benchmarks/speculative.py [--rounds 3] [--max-tokens 128] [--streams 1,4]
                                     [--llama-cpp-python /path/to/venv/bin/python]
    python benchmarks/speculative.py --record   # (re)write the prompts' greedy outputs

Prompts: benchmarks/data/speculative_prompts.json, two categories (input-
grounded: code edits, a summary that quotes, JSON extraction from a given
text, an agent-like loop that re-reads its context, a paragraph to repeat;
free-form), rendered with the model's chat template (the same token ids for
both engines). Their greedy outputs under llamajet without speculation are
committed in the same file (`--record` wrote them before any tuning), with
the kernel tier that computed them ("greedy_isa"): a row's bits are the same
on one tier whatever the batch, but not across tiers. Every llamajet run,
with or without speculation, is checked token for token against llamajet's
own output without speculation in this run (same machine, same tier), and
against the recorded ids where this machine runs the recorded tier; the
benchmark fails on a difference.

llamajet runs four ways: without speculation, with n-gram speculation as
it runs by default (`llamajet-ngram`: the step-cost model keeps only the
proposed tokens that pay), n-gram verifying every proposal
(`llamajet-ngram-all`, `speculative_cost_model=False`: what the cost model
saves), and suffix decoding (`llamajet-suffix`; each worker process serves
one category's prompts in turn, so its recent-outputs cache holds the
earlier prompts' replies, not the same prompt's).

Each (engine, category, streams) is a fresh process (`--worker`), which loads
the model, warms up on a prompt of neither category, then generates every
prompt of the category (greedy, --max-tokens, the prefix cache off so no
prompt is served from an earlier one): one at a time (streams 1) or all at
once in groups of `streams` (llamajet only; a category with fewer prompts
than streams is cycled up to that many requests). Its figure is total generated
tokens over total time, prompt processing included (the user's wait). Rounds
alternate the engines' order; the table gives medians over rounds and each
speedup as the ratio of medians within one engine. Acceptance (accepted /
proposed) and mean tokens per verifying step are llamajet's counters.

Whether the machine was busy: the CPU time other processes used while the
workers ran (the machine's busy time less the workers' own), printed as a
share of the machine; past 5% it says "busy machine". On a busy machine the
ratios hold better than the absolute speeds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from busy import Others  # noqa: E402

PROMPTS = HERE / "data" / "speculative_prompts.json"
WARMUP = [{"role": "user", "content": "Say hello."}]


def _llamajet(engine: str = "llamajet"):
    """llamajet: no speculation; llamajet-PROPOSER: that proposer as by
    default (the step-cost model verifies what pays); llamajet-PROPOSER-all:
    every proposal verified."""
    from llamajet import LLM
    from llamajet.models import default_model_path

    parts = engine.split("-")
    opts = {"speculative": parts[1]} if len(parts) > 1 else {}
    if parts[-1] == "all":
        opts["speculative_cost_model"] = False
    return LLM(default_model_path(), max_model_len=2048, enable_prefix_caching=False, **opts)


def requests(items: list, streams: int) -> list:
    """A category's prompts, cycled up to `streams` requests when it has
    fewer (5 free-form prompts fill 16 streams as 16 requests); each copy is
    its own request (the prefix cache is off, and a sequence's n-gram index
    holds only its own tokens)."""
    return [items[i % len(items)] for i in range(max(len(items), streams))]


def worker(engine: str, category: str, max_tokens: int, streams: int) -> dict:
    data = json.loads(PROMPTS.read_text())
    items = requests(data[category], streams)
    if engine.startswith("llamajet"):
        from llamajet import SamplingParams

        llm = _llamajet(engine)
        ids = [llm.chat_ids(it["messages"]) for it in items]
        p = SamplingParams(max_tokens=max_tokens, temperature=0)
        llm.generate(llm.chat_ids(WARMUP), SamplingParams(max_tokens=8, temperature=0))
        st0 = llm.engine.stats
        base = (st0.spec_drafts, st0.spec_draft_tokens, st0.spec_accepted_tokens)
        t0 = time.perf_counter()
        outs = []
        for i in range(0, len(ids), streams):
            outs += llm.generate(ids[i:i + streams], p)
        dt = time.perf_counter() - t0
        st = llm.engine.stats
        toks = [o.token_ids for o in outs]
        return {"tokens": sum(map(len, toks)), "seconds": dt, "ids": toks, "isa": llm.isa,
                "drafts": st.spec_drafts - base[0], "draft_tokens": st.spec_draft_tokens - base[1],
                "accepted": st.spec_accepted_tokens - base[2]}
    # llama.cpp through llama-cpp-python (its own venv), the same token ids
    from llama_cpp import Llama

    from_llamajet = json.loads(os.environ["SPEC_BENCH_IDS"])
    kw = {}
    if engine == "llamacpp-lookup":
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        kw["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=10)
    m = Llama(os.environ["SPEC_BENCH_GGUF"], n_ctx=2048, n_threads=os.cpu_count(), verbose=False, **kw)
    m.create_completion(from_llamajet["warmup"], max_tokens=8, temperature=0.0)
    t0 = time.perf_counter()
    n, toks = 0, []
    for ids in from_llamajet[category]:
        m.reset()
        r = m.create_completion(ids, max_tokens=max_tokens, temperature=0.0, top_k=1)
        n += r["usage"]["completion_tokens"]
        toks.append(r["choices"][0]["text"])
    return {"tokens": n, "seconds": time.perf_counter() - t0, "texts": toks}


OTHERS = Others()


def _spawn(engine, category, a, python, env):
    """Runs one worker; also counts what the rest of the machine used
    meanwhile (busy CPU time less the worker's own), the measure of a busy
    machine that the worker's own threads do not inflate (a load average does)."""
    cmd = [python, str(Path(__file__)), "--worker", engine, "--category", category,
           "--max-tokens", str(a.max_tokens), "--streams", str(a._streams)]
    r = OTHERS.run(cmd, env=env, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"{engine} {category}: failed\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--streams", default="1", help="comma-separated concurrent streams (llamajet), e.g. 1,4")
    ap.add_argument("--llama-cpp-python", default=None, metavar="PYTHON",
                    help="a Python with llama-cpp-python installed: adds llama.cpp with and without prompt lookup")
    ap.add_argument("--record", action="store_true", help="write the prompts' greedy outputs (no timing)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--category", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a.worker, a.category, a.max_tokens, int(a.streams))))
        return 0
    data = json.loads(PROMPTS.read_text())
    if a.record:
        from llamajet import SamplingParams

        llm = _llamajet()
        for cat, items in data.items():
            for it in items:
                it["greedy_ids"] = llm.generate(llm.chat_ids(it["messages"]),
                                                SamplingParams(max_tokens=a.max_tokens, temperature=0))[0].token_ids
                it["greedy_isa"] = llm.isa
        PROMPTS.write_text(json.dumps(data, indent=1) + "\n")
        print(f"recorded the greedy outputs ({a.max_tokens} tokens at most) in {PROMPTS}")
        return 0
    from llamajet.models import default_model_path

    load0 = os.getloadavg()
    env = dict(os.environ)
    engines = ["llamajet", "llamajet-ngram", "llamajet-ngram-all", "llamajet-suffix"]
    if a.llama_cpp_python:
        llm = _llamajet()
        env["SPEC_BENCH_IDS"] = json.dumps({"warmup": llm.chat_ids(WARMUP),
                                            **{c: [llm.chat_ids(it["messages"]) for it in items]
                                               for c, items in data.items()}})
        env["SPEC_BENCH_GGUF"] = str(default_model_path())
        del llm
        engines += ["llamacpp", "llamacpp-lookup"]
    streams = [int(s) for s in a.streams.split(",")]
    runs = {}  # (engine, category, streams) -> [results]
    bad = []
    for r in range(a.rounds):
        order = engines[r % len(engines):] + engines[: r % len(engines)]
        for cat in data:
            for s in streams:
                for eng in order:
                    if s > 1 and not eng.startswith("llamajet"):
                        continue
                    a._streams = s
                    py = a.llama_cpp_python if eng.startswith("llamacpp") else sys.executable
                    res = _spawn(eng, cat, a, py, env)
                    runs.setdefault((eng, cat, s), []).append(res)
                    print(f"round {r + 1} {eng:16s} {cat:15s} streams {s}: "
                          f"{res['tokens'] / res['seconds']:7.1f} tok/s", file=sys.stderr, flush=True)
    load1 = os.getloadavg()
    # every llamajet run against llamajet without speculation here (its first run of the same
    # category and streams), and against the record where this machine runs the recorded tier
    recorded = {}
    for (eng, cat, s), v in runs.items():
        for res in v:
            if "ids" not in res:
                continue
            if res["ids"] != runs[("llamajet", cat, s)][0]["ids"]:
                bad.append((eng, cat, s, "differs from llamajet without speculation"))
            items = requests(data[cat], s)
            if all(it.get("greedy_isa") == res["isa"] for it in items):
                recorded[res["isa"]] = True
                if res["ids"] != [it["greedy_ids"][: a.max_tokens] for it in items]:
                    bad.append((eng, cat, s, f"differs from the ids recorded on {res['isa']}"))
    print(f"\ndefault model (SmolLM2-135M-Instruct Q4_1), greedy, max {a.max_tokens} new tokens, "
          f"{a.rounds} rounds, medians; {os.cpu_count()} cores")
    print("| engine | category | streams | tok/s | speedup over the same engine without | accepted / proposed "
          "| tokens per verifying step |")
    print("|---|---|---|---|---|---|---|")
    med = {k: statistics.median(x["tokens"] / x["seconds"] for x in v) for k, v in runs.items()}
    for (eng, cat, s), v in runs.items():
        base = "llamajet" if eng.startswith("llamajet-") else {"llamacpp-lookup": "llamacpp"}.get(eng)
        sp = f"{med[(eng, cat, s)] / med[(base, cat, s)]:.2f}x" if base and (base, cat, s) in med else "—"
        drafts = sum(x.get("drafts", 0) for x in v)
        acc = (f"{sum(x['accepted'] for x in v) / max(1, sum(x['draft_tokens'] for x in v)):.0%}"
               if drafts else "—")
        per = f"{1 + sum(x['accepted'] for x in v) / drafts:.2f}" if drafts else "—"
        print(f"| {eng} | {cat} | {s} | {med[(eng, cat, s)]:.1f} | {sp} | {acc} | {per} |")
    print(f"\nload average (1 min) at start {load0[0]:.2f}, at end {load1[0]:.2f} (the end's includes the "
          f"workers' own threads); {OTHERS.line()}")
    if bad:
        print(f"OUTPUT DIFFERS: {bad}")
        return 1
    tiers = sorted({res["isa"] for v in runs.values() for res in v if "isa" in res})
    print(f"every llamajet output equals llamajet's own greedy output without speculation on this tier "
          f"({', '.join(tiers)})" + (", and the recorded greedy ids" if recorded else
                                     "; the recorded greedy ids are of another tier "
                                     f"({', '.join(sorted({it.get('greedy_isa', '?') for v in data.values() for it in v}))}): not compared"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
