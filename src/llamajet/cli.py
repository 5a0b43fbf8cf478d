"""The ``llamajet`` command: generate | chat | serve | info | quantize | eval | bench | graph.

Flags mirror the API: --model is LLM(path), sampling flags are
SamplingParams fields, and the runtime flags (--threads, --isa,
--max-model-len, --kernels, --kv-dtype, --fuse/--no-fuse, ...) are made from
RuntimeConfig's fields (options.py), the ones LLM(path, **options) takes.
"""

from __future__ import annotations

import argparse
import platform
import sys
import warnings

from llamajet.errors import LlamajetError
from llamajet.options import add_runtime_args, runtime_config


def _add_model_args(p: argparse.ArgumentParser, **runtime) -> None:
    p.add_argument("--model", "-m", default=None,
                   help="HF folder, .gguf file or a llamajet saved folder (default: SmolLM2-135M-Instruct Q4_1, "
                        "installed from PyPI)")
    add_runtime_args(p, **runtime)


def _add_sampling_args(p: argparse.ArgumentParser, temperature: float) -> None:
    p.add_argument("--max-tokens", "-n", type=int, default=128, help="new tokens at most")
    p.add_argument("--temperature", type=float, default=temperature, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of this total probability")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this fraction of the top one's "
                                                             "probability")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="above 1 discourages repeated tokens")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampler: the same seed repeats a reply "
                                                          "(default: a fresh one each run)")


def _params(a):
    from llamajet.engine.sampling import SamplingParams

    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k,
                          top_p=a.top_p, min_p=a.min_p, repetition_penalty=a.repetition_penalty,
                          seed=a.seed)


def _llm(a):
    from llamajet.api import LLM

    return LLM(a.model, runtime_config(a))


def cmd_generate(a) -> int:
    params = _params(a)  # validate flags before loading the model
    llm = _llm(a)
    llm.engine.runner.reset_thread_stats()
    echo = sys.stdout.isatty() if a.echo is None else a.echo
    if echo:  # the prompt, then its continuation (dimmed on a terminal)
        dim = sys.stdout.isatty()
        sys.stdout.write(("\033[2m" if dim else "") + a.prompt + ("\033[0m" if dim else ""))
    for ev in llm.stream(a.prompt, params):
        sys.stdout.write(ev.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if a.stats:
        s = llm.engine.last_stats
        pre = s.prompt_tokens / s.prefill_s if s.prefill_s else float("nan")
        dec = s.decode_tokens / s.decode_s if s.decode_s else float("nan")
        print(f"[llamajet] isa={llm.isa} threads={llm.n_threads} prompt={s.prompt_tokens} tok "
              f"prefill={pre:.1f} tok/s  decode={s.decode_tokens} tok at {dec:.1f} tok/s  "
              f"{busy_note(llm.engine.runner.thread_stats())}", file=sys.stderr)
        st = llm.engine.stats
        if st.spec_drafts:  # speculative decoding: how much of what was proposed was kept
            print(f"[llamajet] speculative: {st.spec_accepted_tokens} of {st.spec_draft_tokens} proposed tokens "
                  f"accepted ({100 * st.spec_accepted_tokens / max(st.spec_draft_tokens, 1):.0f}%), "
                  f"{1 + st.spec_accepted_tokens / st.spec_drafts:.2f} tokens per verifying step", file=sys.stderr)
    return 0


def busy_note(t: dict) -> str:
    """thread_idle_fraction in words: on a quiet machine threads wait a few
    percent of a step (the ends of ops); far more means other programs held
    the cores (or more threads than cores)."""
    idle = t["thread_idle_fraction"]
    busy = t["steps"] > 0 and max(t.get("busy_steps") or [0]) > t["steps"] / 2  # preempted in most steps
    note = f"thread_idle_fraction={idle:.2f}"
    if idle > 0.25 or busy:
        note += " (the machine was busy: other programs held the cores part of the time)"
    return note


CHAT_HELP = """commands:
  /clear     forget the conversation (the --system prompt stays)
  /history   show the conversation so far
  /help      this list
  /exit      quit (also /quit, /bye, Ctrl-D, or Ctrl-C twice at an empty prompt)
keys: Ctrl-C stops a reply and keeps the conversation; arrows edit the line and recall earlier ones"""


def cmd_chat(a) -> int:
    import re
    import signal
    import threading

    try:
        import readline  # noqa: F401  (importing it gives input() line editing and history)
    except ImportError:  # (not on every platform)
        pass
    params = _params(a)
    llm = _llm(a)
    system = [{"role": "system", "content": a.system}] if a.system else []
    messages: list[dict] = list(system)
    print(f"llamajet chat — {llm.path.name} ({llm.isa}, {llm.n_threads} threads). Ctrl-C stops a reply; "
          "/help lists commands; Ctrl-D or /exit quits.", file=sys.stderr)
    interrupted = False
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            break
        except KeyboardInterrupt:  # at the prompt: twice in a row quits
            print(file=sys.stderr)
            if interrupted:
                break
            interrupted = True
            print("(Ctrl-C again, Ctrl-D or /exit to quit)", file=sys.stderr)
            continue
        interrupted = False
        cmd = line.strip()
        if not cmd:
            continue
        if cmd in ("/exit", "/quit", "/bye"):
            break
        if cmd == "/help":
            print(CHAT_HELP)
            continue
        if cmd == "/clear":
            messages = list(system)
            print("(conversation cleared)", file=sys.stderr)
            continue
        if cmd == "/history":
            for m in messages:
                print(f"[{m['role']}] {m['content']}")
            continue
        if re.fullmatch(r"/[A-Za-z]+", cmd):
            print(f"unknown command {cmd}: /help lists them", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        # Ctrl-C during a reply sets a flag, read between tokens: a KeyboardInterrupt raised inside a step
        # could leave the engine half-updated; the stream's close then frees the sequence.
        stop = threading.Event()
        previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
        reply, finish = [], None
        try:
            stream = llm.engine.stream(llm.chat_ids(messages), params)
            try:
                for ev in stream:
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
                    reply.append(ev.text)
                    finish = ev.finish_reason or finish
                    if stop.is_set():
                        finish = "interrupted"
                        break
            finally:
                stream.close()
        except LlamajetError as e:  # e.g. the conversation outgrew the context
            print(f"\nerror: {e} (/clear starts over)", file=sys.stderr)
            messages.pop()
            continue
        finally:
            signal.signal(signal.SIGINT, previous)
        sys.stdout.write("\n")
        sys.stdout.flush()
        if finish == "interrupted":
            print("[interrupted]", file=sys.stderr)
        elif finish == "length":
            print(f"[cut at --max-tokens {params.max_tokens}]", file=sys.stderr)
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def cmd_info(a) -> int:
    import importlib.metadata as md

    from llamajet import ops

    feats = ops.cpu_features()
    print(f"cpu:        {feats.pop('brand').strip()}")
    print("features:   " + " ".join(k for k, v in feats.items() if v))
    print(f"isas:       {', '.join(ops.supported_isas())}")
    print(f"isa chosen: {ops.resolve_isa(a.isa)}")
    usable, why = ops.usable_cores()
    print(f"threads:    {usable} usable core{'s' * (usable != 1)}: {why}")
    print(f"python:     {platform.python_version()}")
    for pkg in ("llamajet", "numpy", "tokenizers", "gguf", "jinja2"):
        try:
            print(f"{pkg + ':':12s}{md.version(pkg)}")
        except md.PackageNotFoundError:
            print(f"{pkg + ':':12s}not installed")
    try:
        from llamajet.models import default_model_path

        print(f"default model: {default_model_path()}")
    except LlamajetError as e:
        print(f"default model: {e}")
    if a.model is not None:
        _print_memory(_llm(a))
    return 0


def _print_memory(llm) -> None:
    """Where a loaded model's memory goes: the weights as the kernels read
    them (by storage type), the KV pool, the activation arena, and the rest
    of this process's resident set (code, Python, tokenizer, page tables)."""
    from collections import Counter

    r = llm.engine.runner
    by_type, n_by_type = Counter(), Counter()
    for w in r.weights.values():
        by_type[w.dtype] += w.data.nbytes
        n_by_type[w.dtype] += 1
    weights = sum(by_type.values())
    mib = 2**20
    with open("/proc/self/status") as f:
        rss = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
    print(f"model:      {llm.model.source} ({llm.model.config.name or llm.model.config.architecture})")
    print(f"weights:    {weights / mib:9.1f} MiB  " +
          ", ".join(f"{t} {b / mib:.1f} MiB x{n_by_type[t]}" for t, b in by_type.most_common()))
    print(f"kv pool:    {r.kv_pool_bytes / mib:9.1f} MiB  {r.num_blocks * r.block_size} tokens "
          f"({r.num_blocks} blocks of {r.block_size}, {r.kv_dtype}), context {r.max_model_len}")
    print(f"arena:      {r.plan.arena_bytes / mib:9.1f} MiB  activations of a {r.max_tokens}-token step")
    other = rss - weights - r.kv_pool_bytes - r.plan.arena_bytes
    print(f"other:      {other / mib:9.1f} MiB  (resident set {rss / mib:.1f} MiB, less the above)")


def cmd_quantize(a) -> int:
    from llamajet.quant.quantize import quantize_model

    def progress(done: int, total: int, unit: str | None = None) -> None:
        unit = unit or ("step" if a.method == "qat" else "layer")
        print(f"\r{a.method}: {unit} {done}/{total}", end="" if done < total else "\n", file=sys.stderr, flush=True)

    if a.calib is None and (a.method != "rtn" or a.bias_correction):
        print(f"{a.method}: no --calib: calibrating on {a.calib_seqs} windows of {a.calib_len} tokens the model "
              f"writes itself (seed {a.calib_seed})", file=sys.stderr, flush=True)
    print(quantize_model(a.input, a.output, a.scheme, force=a.force, method=a.method, calib=a.calib,
                         calib_seqs=a.calib_seqs, calib_len=a.calib_len, act_order=a.act_order, embed_scheme=a.embed_scheme,
                         scale_search=a.scale_search, bias_correction=a.bias_correction, report=a.report,
                         qat_steps=a.qat_steps, qat_lr=a.qat_lr, qat_len=a.qat_len,
                         allow_requantize=a.allow_requantize, calib_seed=a.calib_seed,
                         progress=progress).format())
    if a.report:
        print(f"  report:  {a.report}/report.md (per-layer errors, plots)")
    return 0


def cmd_bench(a) -> int:
    if a.batch is None:  # single stream: prefill 128 / 512, decode 128, peak RSS
        from llamajet.eval.bench_latency import run

        print(run(a.model, runtime_config(a), a.rounds, a.vs_llama_cpp, a.corpus, a.json, a.vs_no_fuse,
                  progress=lambda line: print(line, flush=True)))
        return 0
    from llamajet.eval.bench import main as bench_main

    return bench_main(a)


def cmd_serve(a) -> int:
    import os

    from llamajet.server.app import ServerSettings
    from llamajet.server.run import serve

    cfg = runtime_config(a)  # flags checked before the port opens
    settings = ServerSettings(
        model_name=a.served_model_name or _default_model_name(a.model),
        api_key=a.api_key or os.environ.get("LLAMAJET_API_KEY") or None,
        max_queued_requests=a.max_queued_requests, max_body_bytes=a.max_body_bytes,
        drain_timeout=a.drain_timeout, responses_max_count=a.responses_max_count,
        responses_max_bytes=a.responses_max_mib << 20, ui=not a.no_ui)

    def load():
        from llamajet.api import LLM

        return LLM(a.model, cfg)

    return serve(settings, load, host=a.host, port=a.port, log_level=a.log_level)


def _at_least_1(v: str) -> int:
    import argparse

    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r} is not an integer")
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: must be at least 1")
    return n


def _default_model_name(path: str | None) -> str:
    from pathlib import Path

    if path is None:
        return "SmolLM2-135M-Instruct"
    p = Path(path)
    return p.stem if p.suffix == ".gguf" else p.name


def cmd_eval(a) -> int:
    from llamajet.eval.quality import main as eval_main

    return eval_main(a)


def cmd_graph(a) -> int:
    """The step graph as ModelRunner builds it (engine/runner.py compile_graph), planned for one phase."""
    from llamajet import ops
    from llamajet.engine.runner import compile_graph
    from llamajet.graph.dot import to_dot
    from llamajet.graph.planner import plan_memory
    from llamajet.graph.show import describe, summary
    from llamajet.loaders import load_model
    from llamajet.models import default_model_path

    if a.tokens < 1:
        raise LlamajetError(f"--tokens {a.tokens}: a prefill step has at least 1 token")
    path = a.model or default_model_path()
    model = load_model(path)
    cfg = runtime_config(a).for_model(model.config)  # LLM's defaults
    isa = ops.resolve_isa(cfg.isa)
    symbols = {"T": 1 if a.phase == "decode" else a.tokens, "O": 1}
    style = dict(act_int8=cfg.act_int8, kv_dtype=cfg.kv_dtype)
    print(f"llamajet graph: {path}, phase {a.phase} (T={symbols['T']}, O={symbols['O']}), isa {isa}, "
          f"kernels {cfg.kernels}")
    unfused = []

    def before(g):  # the graph before the passes in one line, the listing after them
        unfused.append(len(g.nodes))
        if cfg.fuse:
            print(f"before passes: {summary(g, plan_memory(g, symbols))}")

    compiled = compile_graph(model, cfg, before)
    graph, log = compiled.graph, compiled.fusion_log
    if cfg.fuse:
        print("passes:" + "".join(f"\n  {line}" for line in log) if log else "passes: no rewrites")
    plan = plan_memory(graph, symbols)
    if cfg.fuse:
        print(f"after passes:  {summary(graph, plan)}")
    # A region: work that ends where the threads wait for an op's last chunk
    # (runtime/executor.cpp): one per op, except that a step whose every
    # sequence is one attention run (decode) runs kv_write + attention as one.
    ops_ = [n.op for n in graph.nodes]
    pairs = sum(1 for x, y in zip(ops_, ops_[1:]) if (x, y) == ("kv_write", "attention"))
    was = f"{unfused[0]} unfused, " if cfg.fuse else ""
    print(f"regions per step: {was}{len(ops_)} as run; decode steps {len(ops_) - pairs} "
          f"(each layer's kv_write and attention as one)")
    print()
    print(describe(graph, plan, isa, **style))
    if a.dot:
        with open(a.dot, "w") as f:
            f.write(to_dot(graph, plan, isa, **style))
        print(f"wrote {a.dot}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from llamajet import __version__

    ap = argparse.ArgumentParser(prog="llamajet", description="LLaMA-3 inference on CPUs")
    ap.add_argument("--version", action="version", version=f"llamajet {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="continue a prompt")
    _add_model_args(g)
    _add_sampling_args(g, temperature=0.0)
    g.add_argument("--stats", action="store_true", help="print prefill/decode speed to stderr")
    g.add_argument("--echo", action=argparse.BooleanOptionalAction, default=None,
                   help="print the prompt before its continuation (default: on a terminal, dimmed)")
    g.add_argument("prompt")
    g.set_defaults(fn=cmd_generate)
    c = sub.add_parser("chat", help="multi-turn chat (streams the reply)")
    _add_model_args(c)
    _add_sampling_args(c, temperature=0.7)
    c.add_argument("--system", default=None, help="system prompt")
    c.set_defaults(fn=cmd_chat)
    i = sub.add_parser("info", help="CPU features, chosen ISA, threads, versions; with --model, where its memory goes")
    i.add_argument("--isa", default=None)
    _add_model_args(i, skip=("isa",))
    i.set_defaults(fn=cmd_info)
    q = sub.add_parser("quantize", help="convert a checkpoint into llamajet's saved (mmap-ready) format")
    q.add_argument("input", help="HF folder, .gguf file, or a llamajet saved folder")
    q.add_argument("output", help="folder to write (llamajet.json, model.safetensors, tokenizer)")
    q.add_argument("--scheme", "-s", required=True,
                   help="a scheme name (int4_sym_g32, int4_asym_g32, int8_g32, int8_g128, int8_pc, ...) or 'keep': "
                        "GGUF Q4_0/Q4_1/Q8_0 repacked without loss, float matrices left as they are")
    q.add_argument("--force", action="store_true", help="write into a non-empty output folder")
    q.add_argument("--method", default="rtn", choices=("rtn", "gptq", "awq", "awq-gptq", "smoothquant", "qat"),
                   help="rtn: round to nearest; gptq: error-compensated against calibration inputs; awq: "
                        "activation-aware input scales and clipping; awq-gptq: AWQ's scales, then GPTQ "
                        "(act-order); smoothquant: activation range moved into "
                        "the weights, for W8A8 (int8_pc); qat: fine-tuned through fake quantization, distilled "
                        "from the float model (PyTorch); all but rtn calibrate on --calib FILE, or without it on "
                        "text the model writes itself")
    q.add_argument("--calib", default=None, metavar="FILE",
                   help="calibration text (not the text you evaluate on); without it the calibrated methods "
                        "calibrate on text the model writes itself, seeded (--calib-seed)")
    q.add_argument("--calib-seed", type=int, default=0, help="seed of the self-written calibration text")
    q.add_argument("--calib-seqs", type=int, default=128, help="calibration windows (default: 128)")
    q.add_argument("--calib-len", type=int, default=512, help="tokens per calibration window (default: 512)")
    q.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=True,
                   help="GPTQ: quantize columns by decreasing salience (default: on; --no-act-order for "
                        "column order)")
    q.add_argument("--scale-search", action=argparse.BooleanOptionalAction, default=True,
                   help="GPTQ: each group's range shrunk by the factor of least rounding error (default: on)")
    q.add_argument("--embed-scheme", default=None, metavar="NAME",
                   help="scheme of the token embedding and output head (default: --scheme when it has 8 bits; "
                        "under a 4-bit scheme they keep their source type when it is quantized, else int8_g32)")
    q.add_argument("--allow-requantize", action="store_true",
                   help="round again weights that are already quantized (GGUF blocks, a saved scheme); "
                        "without it such a conversion is refused, as it loses quality")
    q.add_argument("--bias-correction", action="store_true",
                   help="give each decoder matrix the bias that cancels its mean output shift on the "
                        "calibration inputs (any method; needs --calib)")
    q.add_argument("--report", default=None, metavar="DIR",
                   help="write per-layer weight and output errors (JSON, markdown, PNG plots) to DIR; "
                        "output errors need --calib")
    q.add_argument("--qat-steps", type=int, default=120,
                   help="QAT: optimizer steps, one window each (default: 120, ~10 min for SmolLM2 on 2 cores)")
    q.add_argument("--qat-lr", type=float, default=1e-4, help="QAT: peak learning rate (default: 1e-4)")
    q.add_argument("--qat-len", type=int, default=256, help="QAT: tokens per training window (default: 256)")
    q.set_defaults(fn=cmd_quantize)
    b = sub.add_parser("bench", help="single-stream prefill/decode speed (optionally beside llama.cpp); "
                                     "with --batch, throughput at several batch sizes and KV use")
    # the bench sizes the context, the step and the KV pool itself
    _add_model_args(b, skip=("max_num_seqs", "kv_cache_tokens", "enable_prefix_caching", "max_tokens_per_step"))
    b.add_argument("--vs-llama-cpp", action="store_true",
                   help="also run llama-cpp-python on the same GGUF, same threads, alternating rounds")
    b.add_argument("--vs-no-fuse", action="store_true",
                   help="also run llamajet without the fusion passes, alternating rounds")
    b.add_argument("--rounds", type=int, default=3, help="rounds per engine (single-stream) or per batch size (--batch)")
    b.add_argument("--batch", default=None, help="concurrent sequences, comma-separated, e.g. 1,4,16,64")
    b.add_argument("--prompt-tokens", type=int, default=64, help="prompt length of every sequence")
    b.add_argument("--max-tokens", "-n", type=int, default=128, help="tokens generated per sequence")
    b.add_argument("--corpus", default=None,
                   help="text the prompts are cut from (default: seeded draws from the model's vocabulary)")
    b.add_argument("--json", default=None, help="also write the results to this JSON file")
    b.set_defaults(fn=cmd_bench)
    ev = sub.add_parser("eval", help="perplexity, KL and top-1 vs the float model, size and speed of several "
                                     "configurations on the same windows of a text")
    _add_model_args(ev, only=("n_threads", "isa", "kernels", "kv_dtype", "fuse"))
    ev.add_argument("--speed", action=argparse.BooleanOptionalAction, default=True,
                    help="also time single-stream prefill and decode of every configuration (default: on; "
                         "prompts from the text after the scored windows)")
    ev.add_argument("--report", default=None, metavar="DIR",
                    help="also write per-layer weight and output errors of every configuration (JSON, markdown, "
                         "PNG plots) to DIR")
    ev.add_argument("--text", required=True, help="the evaluation text (a UTF-8 file)")
    ev.add_argument("--scheme", default=None, help="schemes to quantize to at load, comma-separated")
    ev.add_argument("--saved", action="append", default=None, metavar="DIR",
                    help="a folder written by `llamajet quantize` (repeatable)")
    ev.add_argument("--ctx", type=int, default=512, help="tokens per window (default: 512)")
    ev.add_argument("--windows", type=int, default=20, help="windows scored (default: 20)")
    ev.add_argument("--json", default=None, help="also write the results as JSON")
    ev.set_defaults(fn=cmd_eval)
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions, streaming, "
                                      "structured output, tools, /metrics, /health, /ready)")
    _add_model_args(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in a container)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--served-model-name", default=None,
                    help="the model name clients send (default: the file or folder name)")
    sv.add_argument("--api-key", default=None,
                    help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on /v1 routes (or set "
                         "LLAMAJET_API_KEY)")
    sv.add_argument("--max-queued-requests", type=int, default=256,
                    help="requests waiting for admission before new ones get 429 (default: 256)")
    sv.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger request bodies get 413 "
                                                                         "(default: 4 MiB)")
    sv.add_argument("--drain-timeout", type=float, default=30.0,
                    help="seconds in-flight requests get after SIGTERM before they are ended (default: 30)")
    sv.add_argument("--responses-max-count", type=_at_least_1, default=1000,
                    help="stored /v1/responses kept for previous_response_id (oldest evicted; default: 1000)")
    sv.add_argument("--responses-max-mib", type=_at_least_1, default=256,
                    help="... and at most this many MiB of them (default: 256)")
    sv.add_argument("--no-ui", action="store_true", help="no chat page at / (default: a chat page in the browser "
                                                            "at http://HOST:PORT/)")
    sv.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    sv.set_defaults(fn=cmd_serve)
    gr = sub.add_parser("graph", help="the step graph after the fusion passes: each node's kernel and arena "
                                      "slot, arena size vs the naive sum of activations")
    gr.add_argument("--phase", choices=("decode", "prefill"), default="decode",
                    help="decode: 1 token per step; prefill: --tokens per step")
    gr.add_argument("--tokens", type=int, default=512, help="tokens of a prefill step")
    gr.add_argument("--dot", default=None, metavar="FILE", help="also write the graph as Graphviz DOT")
    _add_model_args(gr, skip=("kv_prefault", "enable_prefix_caching", "max_num_seqs", "max_tokens_per_step",
                              "kv_cache_tokens", "block_size", "n_threads"))
    gr.set_defaults(fn=cmd_graph)
    for p in sub.choices.values():
        p.formatter_class = _DefaultsFormatter
    return ap


class _DefaultsFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, unless it says it already."""

    def _get_help_string(self, action):
        h = action.help or ""
        if ("default" in h or action.default in (None, argparse.SUPPRESS) or not action.option_strings
                or isinstance(action, (argparse._StoreTrueAction, argparse._HelpAction, argparse._VersionAction))):
            return h
        d = action.default
        shown = "on" if d is True else "off" if d is False else "%(default)s"
        return f"{h} (default: {shown})" if h else f"default: {shown}"


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"llamajet: warning: {message}\n"


def main(argv: list[str] | None = None) -> int:
    warnings.formatwarning = _one_line_warning  # the CLI's warnings are for its user, not a traceback
    a = build_parser().parse_args(argv)
    try:
        return a.fn(a)
    except LlamajetError as e:
        print(f"llamajet: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
