"""Multiple-choice scoring time per item: llamajet (lm-evaluation-harness's
`local-completions` against `llamajet serve`) beside llama.cpp's own
loglikelihood through llama-cpp-python.

    python benchmarks/score_bench.py                   # 200 items, 2 threads, 2 rounds
    python benchmarks/score_bench.py --quick           # 40 items, 1 round (a smoke test)
    python benchmarks/score_bench.py --model /tmp/1b-q4km.gguf --items 200 --concurrency 1,8

The items (written to a temporary directory, never to the repository): a
seeded draw of sentences from WikiText-2 (../shared/data/corpora); the
context is a sentence's first ~60% of words, the true continuation the rest,
and three distractors are the endings of other sentences with about as many
words (+-2), so length alone does not give the answer away.
lm-eval sends 4 loglikelihood requests per item (context, " " + choice).

Rows (same GGUF, same --threads):
  llamajet c=N   a fresh `llamajet serve` per round (the c=N rows of a round share
                 it); lm-eval's simple_evaluate in one process of its own, once per
                 N, with num_concurrent=N, tokenizer_backend=remote (so every context
                 and context+choice goes through /tokenize first)
  llama.cpp      llama_cpp.Llama(logits_all=True) in a process of
                 --llama-cpp-python; for each request it tokenizes as lm-eval's
                 _encode_pair does (context, then whole[len(context):]), resets,
                 evals the ids and sums the log-softmax of the continuation's rows

Timed: llamajet's s/item is lm-eval's requests phase (_loglikelihood_tokens:
every HTTP scoring request and its parsing) over the items; the tokenize
phase (lm-eval's /tokenize calls, 2 per request) is timed beside it and
printed apart, because a remote tokenizer costs a round trip per string and
is not scoring. llama.cpp's s/item covers tokenizing, reset, eval and the
log-softmax of the continuation rows; its model load and one warm-up request
are not timed, as neither is llamajet's server start. Neither side reuses a
prefix across requests: llamajet's echo+logprobs requests bypass its prefix
cache (the hit counter is printed to show it) and llama.cpp is reset before
each request. Rounds alternate which engine goes first; figures are medians
with (min-max). Accuracy is lm-eval's acc (argmax of the summed
loglikelihoods), and for llama.cpp the same rule on its own sums. The two
engines run different kernels on the same quantized weights, so their
loglikelihoods differ a little; the differences are printed, not judged.
The load average before the run is printed: this is a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from serve_load import free_port, metrics  # the load test's own (this folder is on sys.path)

TASK = "score_bench_mc"
SERVED = "m"

TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
"""


# ---------------------------------------------------------------- the items

def _clean(line: str) -> str:
    """WikiText's raw text spaces its punctuation ("the game 's 1 @,@ 000 men ,");
    join it back so the model reads ordinary prose."""
    s = line.strip()
    for a, b in ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", ".")):
        s = s.replace(a, b)
    s = re.sub(r" ([,.;:!?)'])", r"\1", s)
    s = re.sub(r"\( ", "(", s)
    return s.replace(" n't", "n't")


def make_items(n: int, seed: int = 0) -> list[dict]:
    """n cloze items {question, choices[4], label}, the same for a given (n, seed)."""
    from llamajet.eval.perplexity import DEFAULT_CORPUS  # WikiText-2 test, ../shared/data/corpora

    sents = []
    for line in Path(DEFAULT_CORPUS).read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("="):
            continue
        for s in re.split(r"(?<=\.) (?=[A-Z])", _clean(line)):
            w = s.split()
            if 14 <= len(w) <= 32 and s.endswith(".") and '"' not in s:
                sents.append(w)
    rng = random.Random(seed)
    rng.shuffle(sents)
    chosen, pool = sents[:n], sents[n:]
    by_len: dict[int, list[list[str]]] = {}
    for w in pool:
        by_len.setdefault(len(w) - int(len(w) * 0.6), []).append(w)
    items = []
    for w in chosen:
        cut = int(len(w) * 0.6)
        true = " ".join(w[cut:])
        near = [x for k in range(len(w) - cut - 2, len(w) - cut + 3) for x in by_len.get(k, [])]
        distract = []
        while len(distract) < 3:
            x = rng.choice(near)
            end = " ".join(x[int(len(x) * 0.6):])
            if end != true and end not in distract:
                distract.append(end)
        choices = distract + [true]
        rng.shuffle(choices)
        items.append({"question": " ".join(w[:cut]), "choices": choices, "label": choices.index(true)})
    if len(items) < n:
        raise SystemExit(f"score_bench: the corpus gives only {len(items)} items")
    return items


def pairs(items: list[dict]) -> list[tuple[str, str]]:
    """The (context, continuation) requests lm-eval makes of the items, in item order."""
    return [(it["question"], " " + c) for it in items for c in it["choices"]]


# ---------------------------------------------------------------- llama.cpp (its own process)

def _llama_cpp_worker(a) -> None:
    import llama_cpp
    import numpy as np

    reqs = [tuple(p) for p in json.loads(Path(a.pairs).read_text())]
    lc = llama_cpp.Llama(model_path=a.model, logits_all=True, n_ctx=a.ctx, n_batch=512, n_threads=a.threads,
                         n_threads_batch=a.threads, flash_attn=True, verbose=False)

    def tok(s: str) -> list[int]:
        return lc.tokenize(s.encode("utf-8"), add_bos=False, special=False)

    def score(ctx: str, cont: str):
        # lm-eval's TemplateLM._encode_pair for a causal model: trailing spaces of the
        # context move to the continuation, the whole is encoded and cut at len(context)
        n = len(ctx) - len(ctx.rstrip())
        if n:
            ctx, cont = ctx[:-n], ctx[-n:] + cont
        c_ids = tok(ctx)
        k_ids = tok(ctx + cont)[len(c_ids):]
        ids = c_ids + k_ids
        lc.reset()  # the KV cells from n_tokens = 0 on are dropped at the next eval: no reuse
        lc.eval(ids)
        rows = np.asarray(lc.scores[len(c_ids) - 1: len(ids) - 1], dtype=np.float64)  # row i predicts ids[i + 1]
        m = rows.max(axis=1, keepdims=True)
        lse = (m + np.log(np.exp(rows - m).sum(axis=1, keepdims=True)))[:, 0]
        return float(sum(rows[j, t] - lse[j] for j, t in enumerate(k_ids))), c_ids, k_ids

    score(*reqs[0])  # warm-up, untimed
    out, each = [], []
    t0 = time.perf_counter()
    for c, k in reqs:
        t = time.perf_counter()
        out.append(score(c, k))
        each.append(time.perf_counter() - t)
    s = time.perf_counter() - t0
    print(json.dumps({"label": f"llama.cpp {llama_cpp.__version__}", "s": s, "request_s": each,
                      "ll": [o[0] for o in out], "ids": [[o[1], o[2]] for o in out]}))


# ---------------------------------------------------------------- lm-eval (its own process)

def _lm_eval_client(a) -> None:
    """simple_evaluate once per --concurrent value (one process: lm-eval's imports
    are paid once); prints a JSON line per run."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # the json builder reads the local file; nothing is fetched
    os.environ["HF_HUB_OFFLINE"] = "1"
    from lm_eval import simple_evaluate
    from lm_eval.models.api_models import TemplateAPI
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import RemoteTokenizer

    # Time the two phases of TemplateLM.loglikelihood apart: the /tokenize round
    # trips (RemoteTokenizer.encode) and the scoring requests (_loglikelihood_tokens);
    # and, where num_concurrent is 1, each HTTP scoring request (TemplateAPI.model_call).
    clock: dict = {}
    encode, requests_phase, call = (RemoteTokenizer.encode, LocalCompletionsAPI._loglikelihood_tokens,
                                    TemplateAPI.model_call)

    def timed(fn, key, count=None):
        def wrapper(*args, **kw):
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                dt = time.perf_counter() - t
                if count:
                    clock[count].append(dt)
                clock[key] += dt
        return wrapper

    def requests_with_ids(self, requests, **kw):
        clock["sent"] = {tuple(key): [c, k] for key, c, k in requests}  # key: (context, continuation)
        return requests_phase(self, requests, **kw)

    RemoteTokenizer.encode = timed(encode, "tok_s", "tok_calls")
    LocalCompletionsAPI._loglikelihood_tokens = timed(requests_with_ids, "s")
    TemplateAPI.model_call = timed(call, "call_s", "calls")
    for c in map(int, a.concurrent.split(",")):
        clock.update(tok_s=0.0, tok_calls=[], s=0.0, call_s=0.0, calls=[], sent={})
        args = (f"base_url={a.url}/v1/completions,model={SERVED},tokenizer_backend=remote,"
                f"num_concurrent={c},max_retries=1,tokenized_requests=True,max_length={a.ctx}")
        m0 = metrics(a.url)
        t0 = time.perf_counter()
        out = simple_evaluate(model="local-completions", model_args=args, tasks=[TASK],
                              task_manager=TaskManager(include_path=a.tasks, include_defaults=False),
                              log_samples=True, random_seed=0,
                              numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
        total = time.perf_counter() - t0
        m1 = metrics(a.url)
        samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
        print(json.dumps({
            "concurrent": c, "total_s": total, "tok_s": clock["tok_s"], "tok_calls": len(clock["tok_calls"]),
            "s": clock["s"], "request_s": clock["calls"], "acc": out["results"][TASK]["acc,none"],
            # the server's counters over the run: prompt tokens admitted, prompt tokens the prefix cache served
            **{k: m1.get(f"llamajet:{k}_total", 0.0) - m0.get(f"llamajet:{k}_total", 0.0)
               for k in ("prompt_tokens", "prefix_cache_hits")},
            # per request, in item order: the (context, continuation), lm-eval's parsed loglikelihood, the ids sent
            "args": [list(arg) for s in samples for arg in s["arguments"]],
            "ll": [float(r[0][0]) for s in samples for r in s["resps"]],
            "sent": [clock["sent"][tuple(arg)] for s in samples for arg in s["arguments"]],
        }), flush=True)


# ---------------------------------------------------------------- the parent

class Server:
    """`llamajet serve` in a subprocess (tests/serverlib.py's command line), ready and warmed."""

    def __init__(self, model: str, threads: int, ctx: int, max_seqs: int, log: Path):
        import httpx

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "llamajet.cli", "serve", "--model", model, "--port", str(port),
               "--log-level", "warning", "--served-model-name", SERVED, "--threads", str(threads),
               "--max-model-len", str(ctx), "--max-num-seqs", str(max_seqs)]
        with log.open("w") as out:
            self.p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 300
            while True:
                if self.p.poll() is not None:
                    raise SystemExit(f"score_bench: llamajet serve exited {self.p.returncode}: "
                                     f"{log.read_text()[-3000:]}")
                try:
                    if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.time() > deadline:
                    raise SystemExit("score_bench: llamajet serve did not become ready")
                time.sleep(0.2)
            # one scoring request, as lm-eval sends them, so no first-call cost lands in a timed row
            httpx.post(self.url + "/v1/completions", timeout=120, json={
                "model": SERVED, "prompt": "The capital of France is Paris", "max_tokens": 1, "logprobs": 1,
                "echo": True, "temperature": 0}).raise_for_status()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.p.send_signal(signal.SIGTERM)
        try:
            self.p.wait(60)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


def child(cmd: list[str], what: str, log: Path, timeout: float) -> list[dict]:
    """Run a worker; its JSON lines (stderr, lm-eval's logging included, goes to `log`)."""
    with log.open("w") as err:
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, timeout=timeout)
    lines = [json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"score_bench: {what} failed ({out.returncode}): {log.read_text()[-3000:]}")
    return lines


def other_load() -> str:
    """The processes using a CPU just now, besides this benchmark's (these machines are shared)."""
    try:
        ps = subprocess.run(["ps", "-eo", "pid,ppid,pcpu,comm", "--sort=-pcpu"], capture_output=True, text=True,
                            timeout=10).stdout.splitlines()[1:]
    except (OSError, subprocess.SubprocessError):
        return "other processes: unknown"
    mine = {os.getpid()}
    busy = [f"{c} {p}%" for pid, ppid, p, c in (ln.split(None, 3) for ln in ps)
            if float(p) >= 20 and int(pid) not in mine and int(ppid) not in mine]
    return "other processes over 20% CPU: " + (", ".join(busy[:6]) if busy else "none")


nan = float("nan")


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.4f} ({min(xs):.4f}-{max(xs):.4f})"


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return nan
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def picked(ll: list[float], i: int) -> int:
    """Item i's answer: its choice of largest summed loglikelihood (ll: 4 per item, in item order)."""
    return max(range(4), key=lambda j: ll[4 * i + j])


def accuracy(ll: list[float], items: list[dict]) -> float:
    """lm-eval's acc."""
    return sum(picked(ll, i) == it["label"] for i, it in enumerate(items)) / len(items)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF (default: the default model)")
    ap.add_argument("--items", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", default="1,4", help="lm-eval num_concurrent values, one row each")
    ap.add_argument("--seed", type=int, default=0, help="which sentences and distractors")
    ap.add_argument("--ctx", type=int, default=512, help="context both engines are given (the items are short)")
    ap.add_argument("--quick", action="store_true", help="40 items, 1 round")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--llama-cpp-python", default="/work/lcpp-venv/bin/python",
                    help="an interpreter that has llama_cpp")
    ap.add_argument("--show", type=int, default=8, help="requests whose loglikelihoods are printed side by side")
    ap.add_argument("--json", default=None, help="also write every figure here")
    # the child processes
    ap.add_argument("--worker", choices=["llama.cpp", "lm-eval"], help=argparse.SUPPRESS)
    ap.add_argument("--pairs", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--tasks", help=argparse.SUPPRESS)
    ap.add_argument("--concurrent", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker == "llama.cpp":
        _llama_cpp_worker(a)
        return 0
    if a.worker == "lm-eval":
        _lm_eval_client(a)
        return 0

    from llamajet.eval.bench_latency import _machine_load
    from llamajet.models import default_model_path

    if a.quick:
        a.items, a.rounds = 40, 1
    model = str(a.model or default_model_path())
    conc = [int(c) for c in a.concurrency.split(",")]
    items = make_items(a.items, a.seed)
    reqs = pairs(items)
    engines = [f"llamajet c={c}" for c in conc] + ([] if a.no_llama_cpp else ["llama.cpp"])
    print(f"score_bench: {model}; {a.items} items x 4 choices = {len(reqs)} requests (WikiText-2 sentences, "
          f"seed {a.seed}); {a.threads} threads; {a.rounds} rounds alternating, medians (min-max)")
    print(f"{_machine_load()}; {len(os.sched_getaffinity(0))} CPUs usable")
    print(other_load(), flush=True)

    figs: dict[str, dict[str, list]] = {e: {} for e in engines}  # engine -> figure -> [per round]
    last: dict[str, dict] = {}  # engine -> its last round's worker output (loglikelihoods, ids)
    with tempfile.TemporaryDirectory(prefix="score_bench_") as tmp:
        tmp = Path(tmp)
        data = tmp / "items.jsonl"
        data.write_text("".join(json.dumps(it) + "\n" for it in items))
        (tmp / "task.yaml").write_text(TASK_YAML.format(task=TASK, path=data))
        (tmp / "pairs.json").write_text(json.dumps(reqs))
        os.environ["HF_DATASETS_CACHE"] = str(tmp / "hf_datasets")  # the children inherit it: no cache left behind
        base = [__file__, "--model", model, "--threads", str(a.threads), "--ctx", str(a.ctx)]

        def keep(e: str, r: int, res: dict, acc: float, note: str) -> None:
            f = figs[e]
            for k, v in (("s", res["s"]), ("acc", acc), ("request_med", statistics.median(res["request_s"] or [nan])),
                         ("request_p99", pct(res["request_s"], 99))):
                f.setdefault(k, []).append(v)
            f["prompt_tokens"] = [sum(len(x) + len(y) for x, y in res["ids"])]
            last[e] = res
            print(f"    round {r + 1} {e}: {res['s']:.1f} s scoring, acc {acc:.3f}{note}; load average "
                  f"{os.getloadavg()[0]:.2f} after it", flush=True)

        def run_llamajet(r: int, order: list[int]) -> None:
            srv = Server(model, a.threads, a.ctx, max(8, max(conc)), tmp / "server.log")
            try:
                runs = child([sys.executable] + base + ["--worker", "lm-eval", "--url", srv.url, "--tasks", str(tmp),
                                                        "--concurrent", ",".join(map(str, order))],
                             "lm-eval", tmp / "lm_eval.log", 3600)
            finally:
                srv.close()
            for res in runs:
                if [tuple(x) for x in res["args"]] != reqs:
                    raise SystemExit("score_bench: lm-eval's requests are not the items' (context, choice) pairs")
                e = f"llamajet c={res['concurrent']}"
                res["ids"] = res["sent"]
                for k in ("tok_s", "tok_calls", "total_s", "prompt_tokens", "prefix_cache_hits"):
                    figs[e].setdefault(k, []).append(res[k])
                keep(e, r, res, res["acc"], f"; /tokenize {res['tok_s']:.1f} s ({res['tok_calls']} calls), "
                     f"simple_evaluate {res['total_s']:.1f} s, prefix-cache hits {res['prefix_cache_hits']:.0f}")

        def run_llama_cpp(r: int) -> None:
            res, = child([a.llama_cpp_python] + base + ["--worker", "llama.cpp", "--pairs", str(tmp / "pairs.json")],
                         "llama.cpp", tmp / "llama_cpp.log", 3600)
            figs["llama.cpp"]["label"] = [res["label"]]
            keep("llama.cpp", r, res, accuracy(res["ll"], items), "")

        for r in range(a.rounds):
            steps = [lambda r=r: run_llamajet(r, conc if r % 2 == 0 else conc[::-1])]
            if not a.no_llama_cpp:
                steps.append(lambda r=r: run_llama_cpp(r))
            for step in steps if r % 2 == 0 else steps[::-1]:
                step()
    print(f"after the run: {_machine_load().replace('before the run', 'load')}")

    # ------------------------------------------------------------ the table
    n, nreq = len(items), len(reqs)
    print("\n| engine | items | requests | prompt tokens | s/item | ms/request | one request: median, p99 ms "
          "| accuracy |")
    print("|---|---|---|---|---|---|---|---|")
    for e in engines:
        f = figs[e]
        one = (f"{statistics.median(f['request_med']) * 1000:.1f}, {statistics.median(f['request_p99']) * 1000:.0f}"
               if f["request_med"][0] == f["request_med"][0] else "(concurrent: not timed alone)")
        print(f"| {e} | {n} | {nreq} | {f['prompt_tokens'][0]} | {med([s / n for s in f['s']])} | "
              f"{statistics.median(f['s']) / nreq * 1000:.1f} | {one} | {statistics.median(f['acc']):.3f} |")
    lj = [e for e in engines if e.startswith("llamajet")]
    print("s/item: the scoring requests only (lm-eval's _loglikelihood_tokens; llama.cpp's tokenize + eval + "
          "log-softmax), median over rounds (min-max); ms/request: the median round's scoring time / requests")
    for e in lj:
        f = figs[e]
        print(f"  {e}: lm-eval's /tokenize phase {med([s / n for s in f['tok_s']])} s/item "
              f"({f['tok_calls'][0]} calls, {statistics.median(f['tok_s']) / f['tok_calls'][0] * 1000:.2f} ms each), "
              f"not in s/item; the whole simple_evaluate {med([s / n for s in f['total_s']])} s/item; "
              f"server: {statistics.median(f['prompt_tokens']):.0f} prompt tokens admitted, "
              f"{max(f['prefix_cache_hits']):.0f} from the prefix cache")
    if "llama.cpp" in figs and lj:
        cpp = last["llama.cpp"]
        print(f"  llama.cpp: {figs['llama.cpp']['label'][0]}, logits_all, flash_attn, n_batch 512, "
              f"n_threads = n_threads_batch = {a.threads}")
        for e in lj:
            ratio = statistics.median(figs[e]["s"]) / statistics.median(figs["llama.cpp"]["s"])
            print(f"  {e} / llama.cpp, s/item: {ratio:.2f}x")
        ours = last[lj[0]]
        differ = sum(picked(ours["ll"], i) != picked(cpp["ll"], i) for i in range(n))
        print(f"\naccuracy |{lj[0]} - llama.cpp|: "
              f"{abs(statistics.median(figs[lj[0]]['acc']) - statistics.median(figs['llama.cpp']['acc'])):.3f} "
              f"({differ} of {n} items pick a different choice)")
        same = [i for i in range(nreq) if ours["ids"][i] == cpp["ids"][i]]
        print(f"token ids: {len(same)} of {nreq} requests tokenized identically (llamajet's /tokenize, llama.cpp's "
              f"tokenizer); loglikelihood differences llamajet - llama.cpp over those, in nats:")
        if same:
            d = [ours["ll"][i] - cpp["ll"][i] for i in same]
            per_tok = [abs(x) / len(cpp["ids"][i][1]) for x, i in zip(d, same)]
            ad = [abs(x) for x in d]
            print(f"  per request (summed over its continuation): |diff| median {statistics.median(ad):.4f}, "
                  f"p90 {pct(ad, 90):.4f}, max {max(ad):.4f}; mean signed diff {statistics.mean(d):+.4f}")
            print(f"  per continuation token: |diff| median {statistics.median(per_tok):.4f}, "
                  f"p90 {pct(per_tok, 90):.4f}")
            w = max(same, key=lambda i: abs(ours["ll"][i] - cpp["ll"][i]))
            print(f"  largest: request {w} (item {w // 4}, choice {w % 4}), {reqs[w][0]!r} + {reqs[w][1]!r}: "
                  f"llamajet {ours['ll'][w]:.4f}, llama.cpp {cpp['ll'][w]:.4f}")
            print("  | request | continuation tokens | llamajet | llama.cpp | diff |")
            print("  |---|---|---|---|---|")
            for i in sorted(random.Random(1).sample(same, min(a.show, len(same)))):
                print(f"  | {i} (item {i // 4}, choice {i % 4}) | {len(cpp['ids'][i][1])} | {ours['ll'][i]:.4f} | "
                      f"{cpp['ll'][i]:.4f} | {ours['ll'][i] - cpp['ll'][i]:+.4f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"model": model, "items": n, "threads": a.threads, "figures": figs},
                                           indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
