"""Prompt processing (pp) and decode (tg) of llamajet beside two peers, on
random-weight GGUFs of real shapes, one file per type:

- mainline llama.cpp's llama-bench (from the pinned llama-cpp-python sdist);
- ik_llama.cpp's llama-bench (from the ik-llama-cpp-python sdist; a
  benchmark-only peer), with -rtr 0 and 1 (its run-time repack), its best
  printed beside.

Both are built by `benchmarks/build_llama_cpp.sh llama-bench` (FORK=ik for
the fork). Files are written by make_random_gguf.py into --dir (never
committed); a missing one is written first.

Each engine runs in its own process per file and round, engines alternate
within a round (the order turning each round), and the medians over rounds
are printed. llama-bench runs its own warm-up and -r repetitions inside a
round and reports their mean; llamajet's worker does the same (one warm-up
prompt, then -r timed prompts per pp size, fresh ids each so no prefix is
reused; prefix caching is off anyway). pp N: an N-token prompt in steps of
512 tokens (llama-bench's default micro-batch), its last logits row computed
(llamajet samples the one token after it, as a generation does). tg 64: 64
decoded tokens after a one-token prompt.

pp512 is the issue's target: printed as llamajet / mainline and llamajet /
ik's best. On the avx512 tier each type's pp512 is also printed as a share
of the vpdpbusd peak of the cores used (measured here, one core's rate times
threads), from the matrices' multiply-adds per prompt token (the LM head's
left out, as a prompt runs it on its last token only; the non-matrix work is
left out too, so the share is of matrix work at that speed). Whether the machine
was busy: the CPU time other processes used while the workers ran.

    python benchmarks/prefill_peers.py --mainline /tmp/mainline-llama-bench/bin/llama-bench \\
        --ik /tmp/ik-llama-bench/bin/llama-bench [--types q4_0,q6_k] [--shape 1b] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from busy import Others  # noqa: E402

TYPES = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k_m", "q5_k_m", "q6_k"]
PP = [128, 512, 2048]
TG = 64


OTHERS = Others()


def _run(cmd: list[str]) -> str:
    out = OTHERS.run(cmd)
    if out.returncode != 0:
        raise SystemExit(f"{cmd[0]}: failed ({out.returncode})\n{out.stderr[-3000:]}")
    return out.stdout


def llama_bench(binary: str, model: Path, threads: int, reps: int, extra: list[str]) -> dict[str, float]:
    """tok/s by test name ("pp512", "tg64") from one llama-bench process."""
    out = _run([binary, "-m", str(model), "-t", str(threads), "-fa", "1", "-r", str(reps), "-p", ",".join(map(str, PP)), "-n", str(TG), "-o", "json", *extra])
    res = {}
    for row in json.loads(out[out.index("["):]):
        name = f"pp{row['n_prompt']}" if row["n_gen"] == 0 else f"tg{row['n_gen']}"
        res[name] = float(row["avg_ts"])
    return res


WORKER = """
import json, sys, time
import numpy as np
from llamajet import LLM, SamplingParams
model, threads, reps, pp, tg = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), int(sys.argv[5])
ctx = max(pp) + tg + 16
llm = LLM(model, max_model_len=ctx, max_tokens_per_step=512, enable_prefix_caching=False, max_num_seqs=1,
          kv_cache_tokens=ctx, n_threads=threads)
rng = np.random.default_rng(0)
V = llm.config.vocab_size
one = SamplingParams(max_tokens=1, temperature=0)
llm.generate([rng.integers(0, V, 64).tolist()], one)  # warm-up
res = {"isa": llm.isa}
for n in pp:
    ts = []
    for _ in range(reps):
        ids = rng.integers(0, V, n).tolist()
        t = time.perf_counter()
        llm.generate([ids], one)
        ts.append(n / (time.perf_counter() - t))
    res[f"pp{n}"] = sum(ts) / len(ts)
ts = []
for _ in range(reps):
    t = time.perf_counter()
    out = llm.generate([rng.integers(0, V, 1).tolist()], SamplingParams(max_tokens=tg + 1, temperature=0, ignore_eos=True))
    dt = time.perf_counter() - t
    assert len(out[0].token_ids) == tg + 1
    ts.append(tg / dt)  # tg + 1 steps: the one-token prompt's step and tg decode steps
res[f"tg{tg}"] = sum(ts) / len(ts)
# multiply-adds per prompt token of the matrices: not the LM head's, which a prompt runs on its last
# row only (llama-bench's pp too: its batch asks for the last token's logits)
r = llm.engine.runner
res["macs_per_token"] = int(sum(r.weights[n.inputs["w"]].shape[0] * r.weights[n.inputs["w"]].shape[1]
                                for n in r.graph.nodes if n.op == "matmul" and n.outputs.get("out") != "logits"))
print(json.dumps(res))
"""


def llamajet(python: str, model: Path, threads: int, reps: int) -> dict:
    return json.loads(_run([python, "-c", WORKER, str(model), str(threads), str(reps), json.dumps(PP),
                            str(TG)]).strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mainline", help="mainline llama-bench binary")
    ap.add_argument("--ik", help="ik_llama.cpp llama-bench binary")
    ap.add_argument("--types", default=",".join(TYPES), help="make_random_gguf.py mixes, comma-separated")
    ap.add_argument("--shape", default="1b", choices=["1b", "3b", "8b"])
    ap.add_argument("--files", default="", help="GGUF files to run as they are (comma-separated), besides --types")
    ap.add_argument("--dir", default="/tmp/prefill_peers", help="where the random-weight GGUFs are written")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=2, help="timed repetitions per test inside each process")
    ap.add_argument("--threads", type=int, default=None, help="every engine's threads (default: usable cores)")
    ap.add_argument("--pp", default=",".join(map(str, PP)), help="prompt sizes (512 is the target's)")
    ap.add_argument("--llamajet-python", default=sys.executable)
    ap.add_argument("--base-python", default=None, metavar="PYTHON",
                    help="a Python with an earlier llamajet build: run beside as 'base', ratios printed (paired A/B)")
    a = ap.parse_args(argv)
    PP[:] = sorted({int(x) for x in a.pp.split(",")} | {512})
    from llamajet import _core, ops

    threads = a.threads or ops.default_threads()
    peak = None
    if "avx512" in ops.supported_isas():
        peak = max(_core.vnni_peak_gmacs() for _ in range(3)) * threads
    engines: list[tuple[str, object]] = [("llamajet", lambda f: llamajet(a.llamajet_python, f, threads, a.reps))]
    if a.base_python:
        engines.append(("base", lambda f: llamajet(a.base_python, f, threads, a.reps)))
    if a.mainline:
        engines.append(("mainline", lambda f: llama_bench(a.mainline, f, threads, a.reps, [])))
    if a.ik:
        for rtr in (0, 1):
            engines.append((f"ik -rtr {rtr}", lambda f, rtr=rtr: llama_bench(a.ik, f, threads, a.reps,
                                                                            ["-rtr", str(rtr)])))
    Path(a.dir).mkdir(parents=True, exist_ok=True)
    print(f"{threads} threads, {a.rounds} rounds, engines: {', '.join(n for n, _ in engines)}"
          + (f"; vpdpbusd peak {peak:.1f} GMAC/s ({threads} cores)" if peak else ""), flush=True)
    tests = [f"pp{n}" for n in PP] + [f"tg{TG}"]
    summary = []
    runs = [(t, Path(a.dir) / f"{a.shape}-{t}.gguf") for t in a.types.split(",") if t]
    runs += [(Path(f).stem, Path(f)) for f in a.files.split(",") if f]
    for typ, f in runs:
        if not f.exists():
            subprocess.run([sys.executable, str(HERE / "make_random_gguf.py"), str(f), "--shape", a.shape,
                            "--mix", typ], check=True, capture_output=True)
        got: dict[str, list[dict]] = {n: [] for n, _ in engines}
        macs = None
        for r in range(a.rounds):
            order = engines[r % len(engines):] + engines[:r % len(engines)]
            for name, fn in order:
                res = fn(f)
                macs = res.get("macs_per_token", macs)
                got[name].append(res)
        med = {n: {t: statistics.median(x[t] for x in v) for t in tests} for n, v in got.items()}
        print(f"\n{f.name} ({f.stat().st_size / 2**20:.0f} MiB), tok/s, medians of {a.rounds} rounds:")
        print(f"  {'engine':<12}" + "".join(f"{t:>10}" for t in tests))
        for n, m in med.items():
            print(f"  {n:<12}" + "".join(f"{m[t]:>10.1f}" for t in tests))
        lj = med["llamajet"]["pp512"]
        line = {"type": typ, "llamajet_pp512": lj}
        parts = []
        if "mainline" in med:
            line["vs_mainline"] = lj / med["mainline"]["pp512"]
            parts.append(f"{line['vs_mainline']:.2f}x mainline")
        ik = [med[n]["pp512"] for n in med if n.startswith("ik")]
        if ik:
            line["vs_ik_best"] = lj / max(ik)
            parts.append(f"{line['vs_ik_best']:.2f}x ik's best")
        if peak and macs:
            line["peak_share"] = lj * macs / 1e9 / peak
            parts.append(f"{100 * line['peak_share']:.0f}% of the vpdpbusd peak in matrix work "
                         f"({lj * macs / 1e9:.1f} of {peak:.1f} GMAC/s)")
        if "base" in med:
            line["vs_base"] = {t: med["llamajet"][t] / med["base"][t] for t in tests}
            rounds = {t: [x[t] / y[t] for x, y in zip(got["llamajet"], got["base"])] for t in tests}
            print("  llamajet / base: " + ", ".join(
                f"{t} {line['vs_base'][t]:.3f}x (rounds {' '.join(f'{v:.3f}' for v in rounds[t])})" for t in tests))
        print("  llamajet pp512: " + ", ".join(parts), flush=True)
        summary.append(line)
    print(f"\nmachine: {OTHERS.line()}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
