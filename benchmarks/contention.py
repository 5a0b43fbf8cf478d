"""Speed on a busy machine: llamajet beside llama.cpp with other programs on
the cores (issue 40).

    python benchmarks/contention.py                          # default model, llamajet + llama.cpp
    python benchmarks/contention.py --model /tmp/1b-q4km.gguf --new-tokens 64
    python benchmarks/contention.py --engine base=/tmp/base/.venv/bin/python --no-llama-cpp \
        --scenarios quiet --prefill 128,512 --batch 16       # quiet A/B against another build

Rows (each engine, same GGUF, same threads, greedy):
  quiet          1 and 2 threads
  busy1          `while True: pass` pinned to the last core; 1 and 2 threads
  busy2          one such loop on each core; 1 and 2 threads
  t4             -t 4 on this machine (llamajet lowers it to the usable cores, with its warning)
  cgroup         2 threads in a child cgroup limited to 1.5 CPUs (v2 cpu.max 150000 100000, or v1
                 cpu.cfs_quota_us 150000 / cpu.cfs_period_us 100000); a row that cannot run says why

Method: every engine and thread count is its own worker process (this file,
--worker), loaded once, which answers "these ids, n new tokens" with the
seconds to the n-th token. Within a row the engines alternate round by
round (and which goes first), and each figure is the median of --rounds.
Prefill tok/s = prompt tokens / time to the first token; decode tok/s = new
tokens / (time to 1 + N tokens - time to the first). Every request's prompt
is different (seeded draws from the vocabulary) and llamajet's prefix cache
is off, so nothing is computed once and timed twice. llama.cpp
(llama-cpp-python 0.3.36, -DGGML_NATIVE=ON) runs with flash attention,
n_batch 512, n_threads = n_threads_batch; it runs under --llama-cpp-python
(a venv that has llama_cpp; default: this interpreter). llamajet's rows
also print, per thread, the chunks it claimed and stole and
thread_idle_fraction (the share of the threads' step time spent waiting).
The load average before the run is printed: this is a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = 128


# ---------------------------------------------------------------- workers (child processes)

def _llamajet_worker(model: str, threads: int, batch: int) -> None:
    import warnings

    from llamajet import LLM, SamplingParams

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = LLM(model, n_threads=threads, max_model_len=1024, max_tokens_per_step=512,
                  enable_prefix_caching=False, max_num_seqs=max(1, batch), kv_cache_tokens=max(1024, 300 * batch))
    note = "; ".join(str(w.message) for w in caught if "n_threads" in str(w.message))
    runner = llm.engine.runner
    _serve(f"llamajet ({llm.isa})", llm.n_threads, note, lambda ids, n: _time(
        lambda: llm.generate(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))),
        getattr(runner, "reset_thread_stats", None), getattr(runner, "thread_stats", None))  # (older builds: none)


def _llama_cpp_worker(model: str, threads: int, batch: int) -> None:
    import llama_cpp
    import numpy as np

    lc = llama_cpp.Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=1024, n_batch=512,
                         flash_attn=True, verbose=False)
    n_vocab = lc.n_vocab()

    def last():
        return int(np.argmax(np.ctypeslib.as_array(lc._ctx.get_logits(), shape=(n_vocab,))))

    def run(ids, n):
        if ids and isinstance(ids[0], list):
            raise SystemExit("llama.cpp worker: batched requests are not measured")
        lc.reset()
        lc.eval(ids)
        for _ in range(n - 1):
            lc.eval([last()])
        last()

    _serve(f"llama.cpp {llama_cpp.__version__}", threads, "", lambda ids, n: _time(lambda: run(ids, n)), None, None)


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _serve(label, threads, note, timed, reset, stats) -> None:
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing else may write on the protocol's pipe
    out.write(json.dumps({"label": label, "threads": threads, "note": note}) + "\n")
    out.flush()
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("quit"):
            return
        if reset:
            reset()
        s = timed(msg["ids"], msg["n"])
        st = stats() if stats else None
        if st:
            st = {k: st.get(k) for k in ("chunks", "stolen", "sleeps", "thread_idle_fraction", "steps", "busy_steps",
                                         "all_busy_steps", "backups", "discarded", "staged_steps")}
        out.write(json.dumps({"s": s, "stats": st}) + "\n")
        out.flush()


# ---------------------------------------------------------------- the parent

class Worker:
    def __init__(self, python: str, engine: str, model: str, threads: int, batch: int = 0):
        self.engine = engine
        python, *env = python.split(";")  # NAME=PYTHON;VAR=VALUE;...: the worker's environment too
        self.p = subprocess.Popen([python, __file__, "--worker", engine, "--model", model, "--threads", str(threads),
                                   "--batch", str(batch)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, **dict(e.split("=", 1) for e in env)})
        hello = json.loads(self._line())
        self.label, self.threads, self.note = hello["label"], hello["threads"], hello["note"]

    def _line(self) -> str:
        line = self.p.stdout.readline()
        if not line:
            raise SystemExit(f"contention: the {self.engine} worker died (exit code {self.p.wait()})")
        return line

    def ask(self, ids, n):
        self.p.stdin.write(json.dumps({"ids": ids, "n": n}) + "\n")
        self.p.stdin.flush()
        r = json.loads(self._line())
        return r["s"], r["stats"]

    def close(self):
        try:
            self.p.stdin.write('{"quit": true}\n')
            self.p.stdin.flush()
        except BrokenPipeError:
            pass
        self.p.wait(30)


def busy_loops(cores: list[int]) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{c}}})\nwhile True: pass"])
            for c in cores]


class CpuLimit:
    """A child cgroup of the cpu controller limited to `cpus` CPUs, which
    worker processes are moved into and back out of. Raises OSError (with
    why) where it cannot be made."""

    def __init__(self, cpus: float):
        period = 100000
        quota = int(cpus * period)
        v2 = Path("/sys/fs/cgroup/cgroup.controllers")
        if v2.exists() and "cpu" in v2.read_text().split():
            base = Path("/sys/fs/cgroup")
            self.dir = base / f"llamajet-contention-{os.getpid()}"
            self.dir.mkdir()
            (self.dir / "cpu.max").write_text(f"{quota} {period}\n")
            self.kind = f"v2 cpu.max {quota} {period}"
        else:
            base = next((Path("/sys/fs/cgroup") / d for d in ("cpu", "cpu,cpuacct", "cpuacct,cpu")
                         if (Path("/sys/fs/cgroup") / d / "cpu.cfs_quota_us").exists()), None)
            if base is None:
                raise OSError("no cgroup cpu controller is mounted (neither v2 cpu.max nor v1 cpu.cfs_quota_us)")
            self.dir = base / f"llamajet-contention-{os.getpid()}"
            self.dir.mkdir()
            (self.dir / "cpu.cfs_period_us").write_text(f"{period}\n")
            (self.dir / "cpu.cfs_quota_us").write_text(f"{quota}\n")
            self.kind = f"v1 cpu.cfs_quota_us {quota} / cpu.cfs_period_us {period}"
        self.base = base

    def enter(self, pid: int) -> None:
        (self.dir / "cgroup.procs").write_text(f"{pid}\n")

    def leave(self, pid: int) -> None:
        (self.base / "cgroup.procs").write_text(f"{pid}\n")

    def throttled(self) -> str:
        try:
            st = dict(line.split() for line in (self.dir / "cpu.stat").read_text().splitlines())
        except OSError:
            return ""
        ns = int(st.get("throttled_time", 0)) or int(st.get("throttled_usec", 0)) * 1000
        return f"throttled {st.get('nr_throttled', '?')} of {st.get('nr_periods', '?')} periods, {ns / 1e9:.2f} s"

    def remove(self) -> None:
        try:
            self.dir.rmdir()
        except OSError:
            pass


def prompts(model: str, count: int, length: int) -> list[list[int]]:
    from llamajet.eval.bench import prompt_ids
    from llamajet.loaders import load_model
    from llamajet.tokenizer import load_tokenizer, tokenizer_from_gguf

    lm = load_model(model)
    tok = tokenizer_from_gguf(lm.gguf_reader) if lm.gguf_reader is not None else load_tokenizer(model)
    ids = prompt_ids(tok, lm.config.vocab_size, count * length + 1)
    return [ids[i * length: (i + 1) * length] for i in range(count)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", choices=["llamajet", "llama.cpp"], help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help="a GGUF (default: the default model)")
    ap.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=0, help="also time N sequences decoding together (quiet rows, "
                                                         "llamajet engines only)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill", default="128", help="prompt lengths timed for prefill, comma-separated")
    ap.add_argument("--scenarios", default="quiet,busy1,busy2,t4,cgroup")
    ap.add_argument("--engine", action="append", default=[], metavar="NAME=PYTHON[;VAR=VALUE...]",
                    help="another llamajet build to measure beside this one (its venv's python), or this one "
                         "with other environment variables (e.g. 'nospin=.venv/bin/python;LLAMAJET_SPIN_US=0,0')")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--llama-cpp-python", default=sys.executable)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.worker:
        (_llamajet_worker if a.worker == "llamajet" else _llama_cpp_worker)(a.model, a.threads, a.batch)
        return 0

    from llamajet.eval.bench_latency import _machine_load
    from llamajet.models import default_model_path

    model = str(a.model or default_model_path())
    scen = a.scenarios.split(",")
    pre_lens = [int(x) for x in a.prefill.split(",")]
    engines = [("llamajet", sys.executable, "llamajet")] + [(n, p, "llamajet") for n, p in
                                                             (e.split("=", 1) for e in a.engine)]
    if not a.no_llama_cpp:
        engines.append(("llama.cpp", a.llama_cpp_python, "llama.cpp"))
    ncpu = len(os.sched_getaffinity(0))
    cores = sorted(os.sched_getaffinity(0))
    print(f"contention: {model}; {ncpu} CPUs; {a.rounds} rounds alternating, medians; decode over {a.new_tokens} "
          f"new tokens after a {PROMPT}-token prompt")
    print(_machine_load(), flush=True)
    pool = iter(prompts(model, 2000, max([PROMPT] + pre_lens)))
    # (scenario, threads) -> the setting's rows; engine -> metric -> [per round]
    settings = [(sc, t) for sc in scen for t in ({"quiet": (1, 2), "busy1": (1, 2), "busy2": (1, 2), "t4": (4,),
                                                 "cgroup": (2,)}[sc])]
    figs = {(sc, t, n): {} for sc, t in settings for n, _, _ in engines}
    last = {}
    lim, why = None, None
    if "cgroup" in scen:
        try:
            lim = CpuLimit(1.5)
            print(f"  cgroup: {lim.kind}")
        except OSError as e:
            why = str(e)
            print(f"  cgroup 1.5 CPUs: cannot run: {why}")
    batch_figs = {n: [] for n, _, k in engines if k == "llamajet"} if a.batch else {}

    def one(sc, t, name, w):
        if lim and sc == "cgroup":
            lim.enter(w.p.pid)
        try:
            f = figs[sc, t, name]
            for p in pre_lens:
                s, _ = w.ask(next(pool)[:p], 1)
                f.setdefault(f"prefill{p}", []).append(p / s)
            ids = next(pool)[:PROMPT]
            s1, _ = w.ask(ids, 1)
            s2, st = w.ask(ids, 1 + a.new_tokens)
            f.setdefault("decode", []).append(a.new_tokens / (s2 - s1))
            last[sc, t, name] = st
        finally:
            if lim and sc == "cgroup":
                lim.leave(w.p.pid)
        print(f"    {sc} -t {t} round {r + 1} {name}: decode {f['decode'][-1]:.1f} tok/s, "
              + ", ".join(f"prefill {p} {f[f'prefill{p}'][-1]:.1f}" for p in pre_lens)
              + (f"; {st['chunks']} chunks, idle {st['thread_idle_fraction']:.2f}, busy steps {st['busy_steps']} "
                 f"all {st['all_busy_steps']} of {st['steps']}" if st else ""), flush=True)

    # Fresh worker processes every round: one process's speed can sit a few
    # percent off another's of the same build for its whole life (measured:
    # the same build in two workers, 0.90x at decode over 4 rounds; where its
    # memory landed, presumably), so a figure is a median over processes.
    try:
        for r in range(a.rounds):
            order = engines if r % 2 == 0 else engines[::-1]
            workers = {}
            try:
                for name, py, kind in order:
                    for t in sorted({t for _, t in settings}):
                        workers[name, t] = w = Worker(py, kind, model, t)
                        if r == 0:
                            print(f"  {name} -t {t}: {w.label}, {w.threads} threads" + (f" ({w.note})" if w.note else ""),
                                  flush=True)
                for sc, t in settings:
                    if sc == "cgroup" and lim is None:
                        continue
                    loops = busy_loops(cores[-1:] if sc == "busy1" else cores) if sc in ("busy1", "busy2") else []
                    try:
                        time.sleep(0.3 if loops else 0)
                        for name, _, _ in order:
                            one(sc, t, name, workers[name, t])
                    finally:
                        for p in loops:
                            p.kill()
                            p.wait()
                if batch_figs:  # quiet, 2 threads, N sequences together
                    for name in [n for n, _, _ in order if n in batch_figs]:
                        w = Worker(next(py for n, py, _ in engines if n == name), "llamajet", model, 2, a.batch)
                        try:  # decode tok/s of the N sequences: (time to 1 + N tokens - time to 1) each
                            ids = [next(pool)[:PROMPT] for _ in range(a.batch)]
                            s1, _ = w.ask(ids, 1)
                            s2, _ = w.ask(ids, 1 + a.new_tokens)
                        finally:
                            w.close()
                        batch_figs[name].append(a.batch * a.new_tokens / (s2 - s1))
                        print(f"    batch {a.batch} -t 2 round {r + 1} {name}: decode {batch_figs[name][-1]:.1f} tok/s",
                              flush=True)
            finally:
                for w in workers.values():
                    w.close()
    finally:
        if lim:
            print(f"  cgroup: {lim.throttled()}")
            lim.remove()
    rows = []  # (scenario, threads, engine, {metric: median}, stats of its last round)
    for sc, t in settings:
        if sc == "cgroup" and lim is None:
            rows.append(("cgroup", 2, None, {"why": why}, None))
            continue
        for name, _, _ in engines:
            rows.append((sc, t, name, {k: statistics.median(v) for k, v in figs[sc, t, name].items()},
                         last.get((sc, t, name))))
    for name, v in batch_figs.items():
        rows.append((f"batch{a.batch}", 2, name, {"output": statistics.median(v)}, None))

    print()
    print(_machine_load().replace("before the run", "after the run"))
    hdr = f"{'row':10s} {'-t':>3s} {'engine':12s} {'decode':>8s} " + " ".join(f"{'pre' + str(p):>8s}" for p in pre_lens)
    print(hdr + "   llamajet threads: chunks / stolen, idle, sleeps, backups (builds that have them)")
    print("-" * (len(hdr) + 40))
    for sc, t, name, m, st in rows:
        if name is None:
            print(f"{sc:10s} {t:3d} cannot run: {m['why']}")
            continue
        if "output" in m:
            print(f"{sc:10s} {t:3d} {name:12s} {m['output']:8.1f} (decode tok/s, {a.batch} sequences together)")
            continue
        extra = ""
        if st:
            extra = ("   " + " ".join(f"{c}/{s}" for c, s in zip(st["chunks"], st["stolen"]))
                     + f", idle {st['thread_idle_fraction']:.2f}, sleeps {st['sleeps']}")
            if st.get("backups") is not None:  # chunks committed for a holder / copies dropped, staged steps
                extra += (f", backups {'/'.join(map(str, st['backups']))} dropped "
                          f"{'/'.join(map(str, st['discarded']))} in {st['staged_steps']} staged steps")
        print(f"{sc:10s} {t:3d} {name:12s} {m['decode']:8.1f} " + " ".join(f"{m[f'prefill{p}']:8.1f}" for p in pre_lens)
              + extra)
    print("(tok/s)")
    # the targets (issue 40), per engine
    get = {(sc, t, n): m for sc, t, n, m, _ in rows if n}
    print()
    for name, _, _ in engines:
        checks = []

        def ratio(label, num, den, target, metric="decode"):
            if num in get and den in get:
                r = get[num][metric] / get[den][metric]
                checks.append(f"{label} {r:.2f}x (>= {target}: {'met' if r >= target else 'NOT met'})")
            elif num[0] == "cgroup" and ("cgroup", 2, None) in [(s, t, n) for s, t, n, _, _ in rows]:
                checks.append(f"{label}: cannot run, NOT met")

        ratio("busy1 -t2 / quiet -t1 decode", ("busy1", 2, name), ("quiet", 1, name), 0.9)
        ratio("prefill", ("busy1", 2, name), ("quiet", 1, name), 0.9, f"prefill{pre_lens[0]}")
        ratio("busy2 -t2 / quiet -t2 decode", ("busy2", 2, name), ("quiet", 2, name), 0.4)
        ratio("busy2 -t2 / busy2 -t1 decode", ("busy2", 2, name), ("busy2", 1, name), 1.0)
        ratio("-t4 / quiet -t2 decode", ("t4", 4, name), ("quiet", 2, name), 0.9)
        ratio("cgroup 1.5 / quiet -t2 decode", ("cgroup", 2, name), ("quiet", 2, name), 0.6)
        for other, _, _ in engines:
            if other != name and name == "llamajet":
                for sc, t in (("quiet", 1), ("quiet", 2)):
                    if (sc, t, other) in get:
                        checks.append(f"{sc} -t{t} decode vs {other} "
                                      f"{get[sc, t, name]['decode'] / get[sc, t, other]['decode']:.3f}x, prefill "
                                      + ", ".join(f"{get[sc, t, name][f'prefill{p}'] / get[sc, t, other][f'prefill{p}']:.3f}x"
                                                  for p in pre_lens))
                if (f"batch{a.batch}", 2, other) in get:
                    checks.append(f"batch {a.batch} vs {other} "
                                  f"{get[f'batch{a.batch}', 2, name]['output'] / get[f'batch{a.batch}', 2, other]['output']:.3f}x")
        print(f"{name}: " + "; ".join(checks))
    if a.json:
        Path(a.json).write_text(json.dumps([{"row": sc, "threads": t, "engine": n, "figures": m, "stats": st}
                                            for sc, t, n, m, st in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
