"""Load test: N concurrent streaming chat clients against `llamajet serve`
(and, with --vs-llama-server, llama.cpp's own `llama-server` on the same
GGUF with the same client), on loopback, for a fixed time.

    python benchmarks/serve_load.py                       # 64 clients, 60 s, the default model
    python benchmarks/serve_load.py --long 4              # 4 of the clients send 2,000-token prompts
    python benchmarks/serve_load.py --vs-bench --vs-llama-server /tmp/llama-server/bin/llama-server

Method (the same for every engine):
- each server runs in its own process, started fresh, waited on until ready
  (a warm-up request not counted); the client runs in another process and
  reports its own CPU time (on a small machine it competes with the server);
- every request has a distinct prompt (a different WikiText-2 window after
  the chat template's fixed prefix: no two share more than that prefix),
  `max_tokens` 128, `ignore_eos`, `stream`; every client sends its next
  request as soon as the last one ended, until --duration has passed, then
  the run waits for the requests in flight (bounded) and stops by itself;
- a request counts as completed when it answered 200, its usage chunk
  (stream_options.include_usage) says max_tokens were generated, no chunk
  carried more than one token's text (content chunks <= tokens: a token
  whose text is empty, e.g. half a UTF-8 character, sends none), and it
  ended with finish_reason "length" and `data: [DONE]`; anything else
  admitted is malformed; non-200 answers are failed (a 429 is reported
  apart: refused);
- output tok/s = generated tokens (usage) of all requests / wall time;
  TTFT = request sent -> first content chunk; ITL = gaps between content
  chunks of one request; p50/p90/p99 over all of them;
- after the run, /metrics gives llamajet's preemptions and KV blocks in use
  (must be 0).
--vs-bench runs `llamajet bench --batch N` at the same prompt and output
lengths in its own process (decode tok/s of its decode-only steps, and its
output tok/s over prefill + decode).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def default_model() -> str:
    from llamajet.models import default_model_path

    return str(default_model_path())


def corpus_windows(n: int, words: int, offset: int = 0) -> list[str]:
    from llamajet.eval.perplexity import DEFAULT_CORPUS

    text = Path(DEFAULT_CORPUS).read_text(encoding="utf-8").split()
    out = []
    for i in range(n):
        start = (offset + i * words) % max(len(text) - words, 1)
        out.append(" ".join(text[start:start + words]))
    return out


# ------------------------------------------------------------------ client (its own process)


async def _client_main(a) -> dict:
    import httpx

    prompts_short = corpus_windows(4096, a.prompt_words)
    prompts_long = []
    if a.long:  # windows cut to exactly --long-tokens tokens of the model's vocabulary
        from llamajet.gguf_meta import Reader
        from llamajet.tokenizer import tokenizer_from_gguf

        tok = tokenizer_from_gguf(Reader(a.gguf))
        for t in corpus_windows(64, 2 * a.long_tokens, offset=10 ** 6):
            prompts_long.append(tok.decode(tok.encode(t, add_special_tokens=False)[: a.long_tokens]))
    deadline = time.perf_counter() + a.duration
    ttft, itl, records = [], [], []
    counter = {"next": 0, "next_long": 0}
    limits = httpx.Limits(max_connections=a.clients + 8, max_keepalive_connections=a.clients + 8)

    async def one(client, long: bool):
        if long:
            i = counter["next_long"]
            counter["next_long"] += 1
            text = prompts_long[i % len(prompts_long)]
        else:
            i = counter["next"]
            counter["next"] += 1
            text = prompts_short[i % len(prompts_short)]
        body = {"model": a.model_name, "messages": [{"role": "user", "content": f"Continue this text: {text}"}],
                "max_tokens": a.max_tokens, "ignore_eos": True, "stream": True, "temperature": 0,
                "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        rec = {"status": None, "tokens": 0, "chunks": 0, "done": False, "finish": None, "long": long}
        last = None
        try:
            async with client.stream("POST", a.url + "/v1/chat/completions", json=body) as r:
                rec["status"] = r.status_code
                if r.status_code != 200:
                    rec["body"] = (await r.aread()).decode(errors="replace")[:300]
                    return rec
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        rec["done"] = True
                        break
                    chunk = json.loads(data)
                    if chunk.get("usage"):
                        rec["tokens"] = chunk["usage"]["completion_tokens"]
                    for ch in chunk.get("choices") or []:
                        if (ch.get("delta") or {}).get("content"):
                            now = time.perf_counter()
                            if last is None:
                                ttft.append(now - t0)
                            else:
                                itl.append(now - last)
                            last = now
                            rec["chunks"] += 1
                        if ch.get("finish_reason"):
                            rec["finish"] = ch["finish_reason"]
        except (httpx.HTTPError, ValueError) as e:
            rec["error"] = repr(e)
        return rec

    async def worker(client, k):
        long = k < a.long
        while time.perf_counter() < deadline:
            records.append(await one(client, long))

    t_start = time.perf_counter()
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    async with httpx.AsyncClient(timeout=httpx.Timeout(a.request_timeout), limits=limits) as client:
        await asyncio.gather(*(worker(client, k) for k in range(a.clients)))
    wall = time.perf_counter() - t_start
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    ok = [r for r in records if r["status"] == 200]
    # complete: the usage says max_tokens were generated, and no chunk carried several tokens' text
    complete = [r for r in ok if r["done"] and r["finish"] == "length" and r["tokens"] == a.max_tokens
                and r["chunks"] <= r["tokens"]]

    def pct(xs, q):
        if not xs:
            return float("nan")
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]

    return {
        "requests": len(records), "completed": len(complete), "admitted": len(ok),
        "malformed": len(ok) - len(complete), "refused_429": sum(r["status"] == 429 for r in records),
        "failed": sum(r["status"] not in (200, 429) for r in records),
        "long_requests": sum(r["long"] for r in records),
        "output_tokens": sum(r["tokens"] for r in records), "wall_s": wall,
        "output_tps": sum(r["tokens"] for r in records) / wall,
        "ttft_p50": pct(ttft, 50), "ttft_p90": pct(ttft, 90), "ttft_p99": pct(ttft, 99),
        "itl_p50": pct(itl, 50), "itl_p90": pct(itl, 90), "itl_p99": pct(itl, 99),
        "client_cpu_s": (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime),
        "errors": [r.get("error") or r.get("body") for r in records if r.get("error") or r.get("body")][:3],
        "statuses": {str(k): sum(r["status"] == k for r in records) for k in {r["status"] for r in records}},
    }


def run_client(url: str, model_name: str, a) -> dict:
    cmd = [sys.executable, __file__, "--client", url, "--model-name", model_name, "--clients", str(a.clients),
           "--duration", str(a.duration), "--max-tokens", str(a.max_tokens), "--long", str(a.long),
           "--prompt-words", str(a.prompt_words), "--long-tokens", str(a.long_tokens), "--gguf", a.model,
           "--request-timeout", str(a.request_timeout)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=a.duration + a.request_timeout + 120)
    if out.returncode != 0:
        raise SystemExit(f"client failed: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ servers


def wait_ready(url: str, proc, path: str, timeout: float = 300) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("server did not become ready")


def metrics(url: str) -> dict[str, float]:
    import httpx

    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def warm(url: str, model_name: str) -> None:
    import httpx

    httpx.post(url + "/v1/chat/completions", timeout=120,
               json={"model": model_name, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 4})


def run_llamajet(a, ctx: int) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    kv = a.clients * ctx
    cmd = [sys.executable, "-m", "llamajet.cli", "serve", "--model", a.model, "--port", str(port),
           "--served-model-name", "m", "--max-num-seqs", str(a.clients), "--max-model-len", str(ctx),
           "--kv-cache-tokens", str(kv), "--max-queued-requests", str(4 * a.clients), "--log-level", "warning"]
    if a.threads:
        cmd += ["--threads", str(a.threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(url, proc, "/ready")
        warm(url, "m")
        res = run_client(url, "m", a)
        m = metrics(url)
        res["preemptions"] = m.get("llamajet:num_preemptions_total", float("nan"))
        res["kv_usage_after"] = m.get("llamajet:kv_cache_usage_perc", float("nan"))
        res["running_after"] = m.get("llamajet:num_requests_running", float("nan"))
        res["prefix_hit_tokens"] = m.get("llamajet:prefix_cache_hits_total", float("nan"))
        rss = _rss_mib(proc.pid)
        res["server_rss_mib"] = rss
        return res
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_llama_server(a, binary: str, ctx: int) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    slots = a.llama_server_slots
    cmd = [binary, "-m", a.model, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
           "-c", str(slots * ctx), "-t", str(a.threads or os.cpu_count()), "--jinja", "--metrics"]
    cmd += a.llama_server_args.split() if a.llama_server_args else []
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(url, proc, "/health")
        warm(url, "m")
        res = run_client(url, "m", a)
        res["server_rss_mib"] = _rss_mib(proc.pid)
        return res
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def run_bench(a, prompt_tokens: int) -> dict:
    out = Path(f"/tmp/serve_load_bench_{os.getpid()}.json")
    cmd = [sys.executable, "-m", "llamajet.cli", "bench", "--model", a.model, "--batch", str(a.clients),
           "--prompt-tokens", str(prompt_tokens), "--max-tokens", str(a.max_tokens), "--rounds", "1",
           "--json", str(out)]
    if a.threads:
        cmd += ["--threads", str(a.threads)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=3600)
    data = json.loads(out.read_text())
    out.unlink()
    r = data["results"][0] if "results" in data else data[0]
    total_s = r["decode_s"] + r["prefill_s"]
    return {"decode_tps": r["decode_tokens"] / r["decode_s"],
            "output_tps": (r["decode_tokens"] + r["batch"]) / total_s, "prompt_tokens": prompt_tokens}


def prompt_tokens_of(a) -> int:
    """Mean chat-formatted prompt length of the short requests."""
    from llamajet.tokenizer import tokenizer_from_gguf
    from llamajet.gguf_meta import Reader

    tok = tokenizer_from_gguf(Reader(a.model))
    lens = [len(tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Continue this text: {t}"}]),
                           add_special_tokens=False)) for t in corpus_windows(64, a.prompt_words)]
    return int(round(statistics.mean(lens)))


def table(rows: list[tuple[str, dict]]) -> str:
    cols = ["requests", "completed", "malformed", "failed", "refused_429", "output_tps", "ttft_p50", "ttft_p90",
            "ttft_p99", "itl_p50", "itl_p90", "itl_p99", "preemptions", "kv_usage_after", "client_cpu_s",
            "server_rss_mib"]
    head = "| run | " + " | ".join(cols) + " |"
    lines = [head, "|" + "---|" * (len(cols) + 1)]
    for name, r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            if isinstance(v, float):
                v = f"{v * 1000:.0f} ms" if c.startswith(("ttft", "itl")) else f"{v:.1f}"
            cells.append(str(v))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF (default: the default model)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--long", type=int, default=0, help="clients that send 2,000-token prompts")
    ap.add_argument("--prompt-words", type=int, default=40)
    ap.add_argument("--long-tokens", type=int, default=2000, help="tokens of a long prompt")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--vs-bench", action="store_true", help="also run `llamajet bench --batch N`")
    ap.add_argument("--vs-llama-server", default=None, metavar="BINARY",
                    help="also run llama.cpp's llama-server (benchmarks/build_llama_server.sh builds it)")
    ap.add_argument("--llama-server-slots", type=int, default=16)
    ap.add_argument("--llama-server-args", default="", help="extra llama-server flags")
    ap.add_argument("--json", default=None)
    # the client process
    ap.add_argument("--client", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-name", default="m", help=argparse.SUPPRESS)
    ap.add_argument("--gguf", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.client:
        a.url = a.client
        print(json.dumps(asyncio.run(_client_main(a))))
        return 0
    a.model = a.model or default_model()
    ctx = a.long_tokens + a.max_tokens + 128 if a.long else 512 + a.max_tokens
    rows = []
    r = run_llamajet(a, ctx)
    rows.append((f"llamajet serve, {a.clients} clients" + (f", {a.long} long" if a.long else ""), r))
    print(table(rows), flush=True)
    results = {"llamajet": r}
    if a.vs_bench:
        pt = prompt_tokens_of(a)
        b = run_bench(a, pt)
        results["bench"] = b
        print(f"\nllamajet bench --batch {a.clients} --prompt-tokens {pt} --max-tokens {a.max_tokens}: "
              f"decode {b['decode_tps']:.1f} tok/s, output (prefill + decode) {b['output_tps']:.1f} tok/s; "
              f"serve / bench: {r['output_tps'] / b['decode_tps']:.2f}x of decode, "
              f"{r['output_tps'] / b['output_tps']:.2f}x of output")
    if a.vs_llama_server:
        s = run_llama_server(a, a.vs_llama_server, ctx)
        results["llama_server"] = s
        rows.append((f"llama-server, {a.llama_server_slots} slots", s))
        print("\n" + table(rows))
        print(f"\nllamajet / llama-server output tok/s: {r['output_tps'] / s['output_tps']:.2f}x")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
