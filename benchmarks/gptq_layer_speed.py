"""Where a GPTQ calibration spends its time at Llama-3.2-1B widths, for A/B runs
across revisions (run it on each and compare; docs/quantization.md has the
numbers of the last change).

    python benchmarks/gptq_layer_speed.py matrices          # gptq_quantize alone, random 1B shapes
    python benchmarks/gptq_layer_speed.py layers --out DIR  # the calibration of a 2-layer model

`matrices`: gate/up stacked (16384 x 2048) and down (2048 x 8192), random
weights and a Hessian of random inputs with channel scales over ~3 decades;
prints each call's seconds and its output error tr(ΔW H ΔWᵀ) (what GPTQ
minimizes: equal errors mean equal quality whatever the codes).
`layers`: a random-weight bf16 folder of the 1B's widths with --layers layers
(make_random_gguf.write_hf; written under --out, never into the repository),
calibrated by quant/calibrate.sequential with GPTQ act-order int4_sym_g128
over --seqs x 512 tokens of WikiText-2 test after character 600,000 (the
quantize benchmarks' text), each layer timed, then cProfile's top entries.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WIKI = ROOT / ".." / "shared" / "data" / "corpora" / "wikitext-2-raw-test.txt"


def matrices(scheme: str) -> None:
    from llamajet.formats.schemes import get_scheme
    from llamajet.quant.gptq import gptq_quantize

    sch, rng = get_scheme(scheme), np.random.default_rng(0)
    for name, (n, k) in {"gate/up": (16384, 2048), "down": (2048, 8192)}.items():
        x = rng.standard_normal((4096, k), dtype=np.float32) * np.exp(rng.standard_normal(k)).astype(np.float32)
        h = 2.0 * (x.T @ x).astype(np.float64)
        w = rng.standard_normal((n, k), dtype=np.float32) * np.float32(0.02)
        for act_order in (True, False):
            t = time.perf_counter()
            q = gptq_quantize(w, h, sch, act_order=act_order, search=True)[0]
            dt = time.perf_counter() - t
            d = w - np.asarray(q, np.float64)
            print(f"{name:8s} {n}x{k} act_order={act_order!s:5s} {dt:6.2f} s  "
                  f"tr(dW H dW^T) = {np.einsum('nk,nk->', d @ h, d):.6e}", flush=True)


def layers(out: Path, n_layers: int, seqs: int) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import make_random_gguf as mk

    from llamajet.loaders import load_model
    from llamajet.quant import quantize as qz
    from llamajet.quant.calibrate import calibration_windows, sequential

    folder = out / f"hf-1b-widths-{n_layers}l"
    if not (folder / "model.safetensors").exists():
        shape = list(mk.SHAPES["1b"])
        shape[1] = n_layers
        mk.SHAPES["1b-widths"] = tuple(shape)
        mk.write_hf(folder, "1b-widths")
    model = load_model(folder)
    tok = qz._source_tokenizer(model, folder)
    windows = calibration_windows(tok, WIKI.read_text(encoding="utf-8")[600000:], seqs, 512)
    method = qz._method("gptq", qz.check_scheme("int4_sym_g128"), model, True, True)
    t0 = time.perf_counter()
    pr = cProfile.Profile()
    pr.enable()
    sequential(model, windows, method, lambda i, n: print(f"layer {i}/{n} at {time.perf_counter() - t0:.1f} s",
                                                          flush=True))
    pr.disable()
    total = time.perf_counter() - t0
    print(f"{total:.1f} s, {total / n_layers:.1f} s a layer ({len(windows)} x 512 tokens)")
    pstats.Stats(pr).sort_stats("tottime").print_stats(15)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("matrices", "layers"))
    ap.add_argument("--scheme", default="int4_sym_g128")
    ap.add_argument("--out", type=Path, help="work folder outside the repository (layers)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seqs", type=int, default=64)
    a = ap.parse_args(argv)
    if a.what == "matrices":
        matrices(a.scheme)
    else:
        if a.out is None:
            ap.error("layers needs --out DIR")
        a.out.mkdir(parents=True, exist_ok=True)
        layers(a.out, a.layers, a.seqs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
