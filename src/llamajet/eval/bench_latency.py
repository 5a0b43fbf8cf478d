"""Single-stream speed, llamajet beside llama.cpp: `llamajet bench --vs-llama-cpp`.

Measures what one user sees: prefill tok/s (time to the first token) at
prompt lengths 128 and 512, decode tok/s over 128 new tokens (greedy, EOS
ignored), and each engine's peak RSS.

Each engine runs in its own worker process (so its peak RSS is its own) and
loads the model once; the parent alternates the engines round by round
(and which goes first), because this machine's speed drifts minute to
minute: only figures measured side by side in one run are compared. Both
engines get the same token ids (seeded draws from the model's vocabulary,
or the tokens of --corpus; the vocabulary is the GGUF's for both) and the
same thread count. Each figure is printed as it is measured (`progress`). llama.cpp
(PyPI llama-cpp-python, built with -DGGML_NATIVE=ON) runs at its best
settings: flash attention, n_batch 512, n_threads = n_threads_batch.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path


PROMPTS = (128, 512)
NEW_TOKENS = 128


def _peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _llamajet_worker(conn, model, cfg, max_len, fuse=True):
    from llamajet import LLM, SamplingParams

    # no prefix cache: every round must really prefill; one step holds the 512-token prompt
    t0 = time.perf_counter()  # load: from the call to ready to generate (tokenizer and KV pool included)
    # the KV pool holds one context, as llama.cpp's n_ctx (the same memory for the same work)
    pool = {} if cfg.kv_cache_memory else {"kv_cache_tokens": cfg.kv_cache_tokens or max_len}
    llm = LLM(model, cfg, max_model_len=max_len, max_tokens_per_step=512, enable_prefix_caching=False,
              max_num_seqs=1, fuse=fuse and cfg.fuse, **pool)
    load = time.perf_counter() - t0
    conn.send(("ready", f"llamajet ({llm.isa}, {cfg.kernels}{'' if llm.runtime.fuse else ', no-fuse'})", load,
               _memory_figures(llm)))

    runner = llm.engine.runner

    def timed(ids, n):
        runner.reset_thread_stats()
        t = time.perf_counter()
        llm.generate([ids], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return time.perf_counter() - t, runner.thread_stats()["thread_idle_fraction"]

    _serve(conn, timed)


def _memory_figures(llm) -> dict:
    """What the loaded model holds and reads: the weights as the kernels read
    them, the KV pool, and the bytes one decode step streams (every matmul's
    weights whole; an embedding gather reads one row, nothing to count)."""
    r = llm.engine.runner
    mm = {n.inputs["w"] for n in r.graph.nodes if n.op == "matmul"}
    return {"weights_bytes": sum(w.data.nbytes for w in r.weights.values()), "kv_bytes": r.kv_pool_bytes,
            "decode_bytes": sum(w.data.nbytes for name, w in r.weights.items() if name in mm)}


def _llama_cpp_worker(conn, model, cfg, max_len, fuse=True):
    import llama_cpp
    import numpy as np

    from llamajet.ops import default_threads

    threads = cfg.n_threads or default_threads()
    t0 = time.perf_counter()
    lc = llama_cpp.Llama(model_path=str(model), n_threads=threads, n_threads_batch=threads, n_ctx=max_len,
                         n_batch=512, flash_attn=True, verbose=False)
    load = time.perf_counter() - t0
    conn.send(("ready", f"llama.cpp {llama_cpp.__version__}", load, {}))

    n_vocab = lc.n_vocab()

    def last_logits():
        # the context's logits of the last evaluated token (Llama.scores is only
        # written with logits_all=True in 0.3.x: argmax of it was of stale rows)
        return np.ctypeslib.as_array(lc._ctx.get_logits(), shape=(n_vocab,))

    def timed(ids, n):
        lc.reset()
        t = time.perf_counter()
        lc.eval(ids)
        for _ in range(n - 1):  # the same greedy loop llamajet runs
            lc.eval([int(np.argmax(last_logits()))])
        int(np.argmax(last_logits()))
        return time.perf_counter() - t

    _serve(conn, timed)


def _serve(conn, timed):
    """Answers (prompt ids, n new tokens) with seconds until the n-th token."""
    while True:
        msg = conn.recv()
        if msg is None:
            conn.send(("rss", _peak_rss_mib()))
            return
        r = timed(*msg)  # seconds, or (seconds, thread_idle_fraction)
        conn.send(("t",) + (r if isinstance(r, tuple) else (r, None)))


class _Checked:
    """A worker's pipe end: a worker that dies (e.g. a native crash in the
    yardstick) is reported by name and exit code instead of hanging the bench."""

    def __init__(self, conn, name, proc):
        self.conn, self.name, self.proc = conn, name, proc

    def send(self, msg):
        self.conn.send(msg)

    def recv(self):
        try:
            return self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise SystemExit(f"llamajet bench: the {self.name} worker died (exit code {self.proc.exitcode})") from None


@dataclass
class EngineFigures:
    name: str
    prefill: dict = field(default_factory=lambda: {p: [] for p in PROMPTS})  # P -> [tok/s]
    decode: list = field(default_factory=list)  # tok/s
    decode_long: list = field(default_factory=list)  # tok/s after the long prompt
    idle: list = field(default_factory=list)  # llamajet's thread_idle_fraction over each decode run
    peak_rss_mib: float = float("nan")
    load_s: float = float("nan")
    memory: dict = field(default_factory=dict)  # llamajet's: weights_bytes, kv_bytes, decode_bytes

    def med(self):
        return ({p: statistics.median(v) for p, v in self.prefill.items()}, statistics.median(self.decode))


def _round(conn, prompts, fig: EngineFigures, long_prompt=None):
    for p in PROMPTS:
        conn.send((prompts[p], 1))
        fig.prefill[p].append(p / conn.recv()[1])
    # decode: time to 1 + NEW_TOKENS tokens minus time to the first token
    conn.send((prompts[PROMPTS[0]], 1))
    t1 = conn.recv()[1]
    conn.send((prompts[PROMPTS[0]], 1 + NEW_TOKENS))
    _, t2, idle = conn.recv()
    fig.decode.append(NEW_TOKENS / (t2 - t1))
    if idle is not None:
        fig.idle.append(idle)
    if long_prompt:  # decode with a long context in the KV cache (attention reads it every token)
        conn.send((long_prompt, 1))
        t1 = conn.recv()[1]
        conn.send((long_prompt, 1 + NEW_TOKENS))
        fig.decode_long.append(NEW_TOKENS / (conn.recv()[1] - t1))


def warm_page_cache(model: str) -> None:
    """Reads the model's files through once, so every engine loads from a warm
    page cache: the engine loaded first (llamajet) would otherwise also pay the
    disk for whatever of the file earlier runs evicted (an 8B GGUF's first load
    measured 13.0 s against 5-6 s warm, beside llama.cpp's 4.7 s loading second)."""
    p = Path(model)
    files = [p] if p.is_file() else sorted(p.glob("*.safetensors")) + sorted(p.glob("*.gguf"))
    buf = bytearray(1 << 24)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


LLAMA_CPP_HINT = ("llamajet bench --vs-llama-cpp needs llama-cpp-python: CMAKE_ARGS=\"-DGGML_NATIVE=ON\" "
                  "pip install llama-cpp-python==0.3.36 (builds from source, ~6 min; CPUs with AMX: the README's flags)")


def _machine_load() -> str:
    """What else the machine was doing just before the run (these machines are shared)."""
    import os

    try:
        one, five, _ = os.getloadavg()
    except OSError:
        return "load average unknown"
    n = os.cpu_count() or 1
    busy = "busy" if one > 0.5 else "quiet"
    return f"machine {busy} before the run: load average {one:.2f} (1 min), {five:.2f} (5 min) on {n} cores"


def run(model: str | None = None, cfg=None, rounds: int = 3, vs_llama_cpp: bool = False,
        corpus: Path | None = None, json_path: str | None = None, vs_no_fuse: bool = False,
        long_prompt: int = 0, figures: list | None = None, progress=None) -> str:
    """`cfg`: the RuntimeConfig both llamajet workers start from (threads, kernels, KV type, ...).
    corpus: a text to cut the prompts from (default: draws from the model's vocabulary).
    long_prompt: also decode after a prompt of that many tokens (both engines' context grows to hold it).
    figures: a list the EngineFigures are appended to (for callers that tabulate).
    progress: called with a line for each figure as it is measured (the CLI prints them)."""
    import importlib.util

    from llamajet.config import RuntimeConfig
    from llamajet.eval.bench import prompt_ids
    from llamajet.loaders import load_model
    from llamajet.models import default_model_path
    from llamajet.ops import default_threads, read_bandwidth
    from llamajet.tokenizer import load_tokenizer, tokenizer_from_gguf

    if vs_llama_cpp and importlib.util.find_spec("llama_cpp") is None:
        raise SystemExit(LLAMA_CPP_HINT)
    say = progress or (lambda line: None)
    model = str(model or default_model_path())
    cfg = cfg or RuntimeConfig()
    threads = cfg.n_threads or default_threads()
    load_note = _machine_load()
    lm = load_model(model)
    tok = tokenizer_from_gguf(lm.gguf_reader) if lm.gguf_reader is not None else load_tokenizer(model)
    need = 2000 + max(long_prompt, PROMPTS[-1])
    ids = prompt_ids(tok, lm.config.vocab_size, need, Path(corpus) if corpus else None)
    source = f"the tokens of {corpus}" if corpus else "seeded draws from the model's vocabulary"
    prompts = {p: ids[1000 : 1000 + p] for p in PROMPTS}
    long_ids = ids[2000 : 2000 + long_prompt] if long_prompt else None
    max_len = max(1024, long_prompt + NEW_TOKENS + 16)
    del lm
    say(f"llamajet bench: {model}; threads {threads}, {rounds} rounds alternating; prompts: {source}")
    say(load_note)
    warm_page_cache(model)
    ctx = mp.get_context("spawn")
    workers = [("llamajet", _llamajet_worker, True)]
    workers += [("llamajet", _llamajet_worker, False)] if vs_no_fuse else []
    workers += [("llama.cpp", _llama_cpp_worker, True)] if vs_llama_cpp else []
    conns, procs, figs = [], [], []
    for name, fn, fuse in workers:
        a, b = ctx.Pipe()
        pr = ctx.Process(target=fn, args=(b, model, cfg.with_options(n_threads=threads), max_len, fuse), daemon=True)
        pr.start()
        b.close()  # only the child holds its end: if it dies, recv() here raises EOFError instead of waiting
        conns.append(_Checked(a, name, pr))
        procs.append(pr)
        tag, label, load, memory = conns[-1].recv()
        figs.append(EngineFigures(label, load_s=load, memory=memory))
        say(f"  {label}: loaded in {load:.2f} s")
    for c, f in zip(conns, figs):  # warm-up round, not recorded
        _round(c, prompts, EngineFigures("warm-up"))
        say(f"  {f.name}: warm-up round done")
    # the machine's read bandwidth, measured in this run between the rounds
    # (here, in the parent: the workers' peak RSS stays theirs), on a buffer
    # far larger than the caches
    bw = []
    for r in range(rounds):
        order = list(range(len(conns)))
        if r % 2:
            order.reverse()
        for i in order:
            _round(conns[i], prompts, figs[i], long_ids)
            f = figs[i]
            say(f"  round {r + 1}/{rounds} {f.name}: prefill " + ", ".join(f"{p} {f.prefill[p][-1]:.1f}" for p in PROMPTS)
                + f"; decode {f.decode[-1]:.1f}" + (f", after {long_prompt}: {f.decode_long[-1]:.1f}" if long_prompt
                                                    else "") + " tok/s")
        bw.append(read_bandwidth(1 << 30, threads, 3))
    for c, pr, f in zip(conns, procs, figs):
        c.send(None)
        f.peak_rss_mib = c.recv()[1]
        pr.join()
    lines = [f"model {model}", f"threads {threads}, {rounds} rounds alternating, medians; decode over {NEW_TOKENS} "
             f"new tokens after the {PROMPTS[0]}-token prompt; prompts: {source}", load_note, ""]
    longh = f" {'dec@' + str(long_prompt):>9s}" if long_prompt else ""
    hdr = (f"{'engine':34s} " + " ".join(f"{'prefill ' + str(p):>12s}" for p in PROMPTS) + f" {'decode':>9s}" + longh
           + f" {'peak RSS':>9s} {'load':>7s}")
    lines += [hdr, "-" * len(hdr)]
    meds = [f.med() for f in figs]
    dl = [statistics.median(f.decode_long) if f.decode_long else float("nan") for f in figs]
    for f, (pre, dec), d2 in zip(figs, meds, dl):
        lines.append(f"{f.name:34s} " + " ".join(f"{pre[p]:12.1f}" for p in PROMPTS) + f" {dec:9.1f}"
                     + (f" {d2:9.1f}" if long_prompt else "") + f" {f.peak_rss_mib:7.0f}Mi {f.load_s:6.2f}s")
    for i in range(1, len(figs)):
        (p0, d0), (p1, d1) = meds[0], meds[i]
        lines.append(f"{'ratio first / ' + figs[i].name[:20]:34s} " + " ".join(f"{p0[p] / p1[p]:11.2f}x" for p in PROMPTS)
                     + f" {d0 / d1:8.2f}x" + (f" {dl[0] / dl[i]:8.2f}x" if long_prompt else "")
                     + f" {figs[0].peak_rss_mib / figs[i].peak_rss_mib:8.2f}x {figs[0].load_s / figs[i].load_s:6.2f}x")
    if figures is not None:
        figures.extend(figs)
    lines.append("(tok/s; prefill = prompt tokens / time to the first token)")
    for f in figs:
        if f.idle:
            i = statistics.median(f.idle)
            lines.append(f"{f.name}: thread_idle_fraction {i:.2f} while decoding (share of its threads' step time "
                         f"spent waiting{'; the machine was busy' if i > 0.25 else ''})")
    bwm = statistics.median(bw) if bw else float("nan")
    for f, (_, dec) in zip(figs, meds):
        m = f.memory
        if not m:
            continue
        floor = bwm / m["decode_bytes"]
        bound = 1.1 * (m["weights_bytes"] + m["kv_bytes"]) / 2**20 + 150
        f.memory.update(read_bw=bwm, decode_floor=floor, rss_bound_mib=bound)
        lines.append(f"{f.name}: decode {dec:.1f} tok/s = {dec / floor:.0%} of the bandwidth floor "
                     f"({m['decode_bytes'] / 1e6:.0f} MB a token at {bwm / 1e9:.1f} GB/s read, measured in this run: "
                     f"{floor:.1f} tok/s); peak RSS {f.peak_rss_mib:.0f} MiB vs 1.1 x (weights "
                     f"{m['weights_bytes'] / 2**20:.0f} + KV {m['kv_bytes'] / 2**20:.0f} MiB) + 150 = {bound:.0f} MiB")
    if json_path:
        Path(json_path).write_text(json.dumps([{"engine": f.name, "prefill": f.prefill, "decode": f.decode,
                                                "decode_long": f.decode_long, "peak_rss_mib": f.peak_rss_mib,
                                                "load_s": f.load_s, "memory": f.memory} for f in figs], indent=1))
    return "\n".join(lines)
