"""A bf16 Hugging Face folder (Llama-3.2-1B shape, random weights): llamajet
beside transformers, and the float-activation path beside the default one.

    python benchmarks/float_folder.py [--dir /tmp/lj-real] [--rounds 3]

Each engine in its own process (peak RSS its own), rounds alternating,
greedy, the same random prompt ids (a new prompt every round: nothing is
reused). Prints prefill (128-token prompt) and decode (64 new tokens) tok/s,
peak RSS, llamajet's weight bytes per token over the read bandwidth measured
in the same run (the decode floor), and kernels='a16' decode against the
default on the same int4_asym_g32 weights. The int8_g128 row: int8 with one
scale per 128 (weights and activations), a quarter of int8_g32's per-group
rescaling work in the AMX prefill, in the same processes' rounds as the
default and transformers.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_random_gguf  # noqa: E402

PROMPT, NEW = 128, 64


def _rss():
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) / 1024 for ln in f if ln.startswith("VmHWM:"))


def _worker(conn, engine, folder, options):
    import numpy as np

    if engine == "transformers":
        import torch
        import transformers

        torch.set_num_threads(2)
        m = transformers.LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.bfloat16).eval()

        def gen(ids, n):
            with torch.no_grad():
                t = time.perf_counter()
                m.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
                return time.perf_counter() - t
        weight_bytes = 0
    else:
        from llamajet import LLM, SamplingParams

        llm = LLM(folder, max_model_len=1024, enable_prefix_caching=False, max_num_seqs=1, **options)

        def gen(ids, n):
            t = time.perf_counter()
            llm.generate([ids], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            return time.perf_counter() - t
        weight_bytes = sum(w.data.nbytes for w in llm.engine.runner.weights.values())
    conn.send(weight_bytes)
    while True:
        seed = conn.recv()
        if seed is None:
            conn.send(_rss())
            return
        ids = np.random.default_rng(seed).integers(1000, 100000, PROMPT).tolist()
        t1 = gen(ids, 1)
        ids = np.random.default_rng(seed + 1000).integers(1000, 100000, PROMPT).tolist()
        tn = gen(ids, 1 + NEW)
        conn.send((PROMPT / t1, NEW / (tn - t1)))


def main(argv=None) -> int:
    from llamajet import _core, ops

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    d = a.dir or Path(tempfile.gettempdir()) / "llamajet-real-scale"
    folder = d / "1b-hf-bf16"
    if not (folder / "model.safetensors").exists():
        make_random_gguf.write_hf(folder, "1b")
    engines = [("llamajet (default: int8_g32 at load)", "llamajet", {}),
               ("transformers bf16", "transformers", {}),
               ("llamajet int8_g128", "llamajet", {"quantize": "int8_g128"}),
               ("llamajet int4_asym_g32 fast", "llamajet", {"quantize": "int4_asym_g32"}),
               ("llamajet int4_asym_g32 a16", "llamajet", {"quantize": "int4_asym_g32", "kernels": "a16"})]
    bw = _core.read_bandwidth(1 << 30, ops.default_threads())  # bytes/s, in the same run
    ctx = mp.get_context("spawn")
    rows = []
    for pair in (engines[:3], engines[3:]):
        conns, procs, wb = [], [], []
        for name, eng, opt in pair:
            p, c = ctx.Pipe()
            pr = ctx.Process(target=_worker, args=(c, eng, str(folder), opt), daemon=True)
            pr.start()
            conns.append(p)
            procs.append(pr)
            wb.append(p.recv())
        figs = [[] for _ in pair]
        for r in range(a.rounds + 1):
            order = list(range(len(pair)))[:: 1 if r % 2 == 0 else -1]
            for i in order:
                conns[i].send(r)
                res = conns[i].recv()
                if r:  # round 0 warms up
                    figs[i].append(res)
        for i, (name, eng, opt) in enumerate(pair):
            conns[i].send(None)
            rss = conns[i].recv()
            procs[i].join()
            pre = statistics.median(f[0] for f in figs[i])
            dec = statistics.median(f[1] for f in figs[i])
            rows.append((name, pre, dec, rss, wb[i]))
    print(f"{'engine':40s} {'prefill 128':>12s} {'decode':>8s} {'peak RSS':>9s} {'weights':>9s} {'floor':>7s}")
    for name, pre, dec, rss, w in rows:
        floor = f"{dec / (bw / w):6.0%}" if w else "    -"
        print(f"{name:40s} {pre:12.1f} {dec:8.1f} {rss:7.0f}Mi {w / 2**20:7.0f}Mi {floor}")
    print(f"read bandwidth {bw / 1e9:.1f} GB/s; floor = decode / (bandwidth / weight bytes per token)")
    print(f"prefill vs transformers: {rows[0][1] / rows[1][1]:.2f}x (int8_g128: {rows[2][1] / rows[1][1]:.2f}x); "
          f"a16 / fast decode on int4: {rows[4][2] / rows[3][2]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
