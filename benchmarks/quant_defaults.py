"""What `llamajet quantize`'s defaults give on the default model (issue 45's table).

    python benchmarks/quant_defaults.py --out /tmp/qdefaults [--windows 20] [--calib-seqs 128]

SmolLM2-135M-Instruct (its Q4_1 GGUF; the float reference is that file
dequantized, reference kernels). Every row quantizes to int4_sym_g128 with
--allow-requantize (the source is Q4_1, so this is re-quantization; it is the
only SmolLM2 file we have, and the float reference is its dequantized values,
so each row's error is the error added to those values) and is scored with the
default kernels (W4A8) on the first --windows windows of 512 tokens of
WikiText-2 test: PPL, PPL / float, KL vs float, and the share of the default
RTN's PPL increase that the row recovers:
    recovered = (PPL(RTN default) - PPL(row)) / (PPL(RTN default) - PPL(float)).

Rows: RTN with the embedding/head at int4 (the old default); RTN (default: the
Q8_0 embedding/head kept); the same at load, LLM(gguf, quantize=...) (must
equal the RTN row: the same bytes); GPTQ without act-order (the old default)
calibrated on TinyShakespeare; GPTQ with its defaults calibrated on
TinyShakespeare (text of another domain, as a user's own often is); GPTQ with
its defaults and no --calib (text the model writes itself, seed 0); optionally
(--in-domain) GPTQ calibrated on WikiText-2 text disjoint from the scored
windows. Quantized folders are written under --out and reused when present
(delete them to re-time). Each row's quantize time is printed; the machine's
load average at start and end says whether it was busy.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "corpora"
SCHEME = "int4_sym_g128"


def rows(shakespeare: Path, in_domain: Path | None):
    r = [("RTN, embedding/head at int4 (old default)", {"embed_scheme": SCHEME}),
         ("RTN (default: embedding/head kept at Q8_0)", {}),
         ("LLM(gguf, quantize=) at load", "load"),
         ("GPTQ --no-act-order, --calib tinyshakespeare (old default)", {"method": "gptq", "act_order": False,
                                                                         "calib": shakespeare}),
         ("GPTQ (defaults), --calib tinyshakespeare", {"method": "gptq", "calib": shakespeare}),
         ("GPTQ (defaults), no --calib (self-written, seed 0)", {"method": "gptq"})]
    if in_domain is not None:
        r.append(("GPTQ (defaults), --calib wikitext-2 (in domain)", {"method": "gptq", "calib": in_domain}))
    return r


def main(argv=None) -> int:
    from llamajet import LLM
    from llamajet.eval.perplexity import corpus_windows, evaluate
    from llamajet.models import default_model_path
    from llamajet.quant.quantize import quantize_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--windows", type=int, default=20)
    ap.add_argument("--calib-seqs", type=int, default=128)
    ap.add_argument("--in-domain", action="store_true", help="add GPTQ calibrated on WikiText-2 (disjoint text)")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()
    src = Path(default_model_path())
    wiki = (DATA / "wikitext-2-raw-test.txt").read_text(encoding="utf-8")
    in_domain = None
    if a.in_domain:
        in_domain = a.out / "wiki-calib.txt"
        in_domain.write_text(wiki[600000:], encoding="utf-8")  # after the scored windows' text
    ctx = 512
    opts = {"max_model_len": ctx, "kv_cache_tokens": ctx, "kv_dtype": "f32", "enable_prefix_caching": False}
    llms = {"float": LLM(src, kernels="reference", quantize="none", **opts)}
    secs = {}
    for i, (name, q) in enumerate(rows(DATA / "tinyshakespeare.txt", in_domain)):
        if q == "load":
            t0 = time.perf_counter()
            llms[name] = LLM(src, quantize=SCHEME, **opts)
            secs[name] = time.perf_counter() - t0
            continue
        folder = a.out / f"row{i}"
        if not (folder / "llamajet.json").is_file():
            t0 = time.perf_counter()
            quantize_model(src, folder, SCHEME, force=True, allow_requantize=True, calib_seqs=a.calib_seqs,
                           calib_len=512, **q)
            (folder / "seconds").write_text(f"{time.perf_counter() - t0:.1f}")
        secs[name] = float((folder / "seconds").read_text())
        llms[name] = LLM(folder, **opts)
        print(f"[{i}] {name}: ready ({secs[name]:.0f} s to quantize)", flush=True)
    windows = corpus_windows(llms["float"].tokenizer, wiki, ctx, a.windows)
    sc = evaluate(llms, windows, "float")
    f = sc["float"].ppl
    base = sc["RTN (default: embedding/head kept at Q8_0)"].ppl
    print(f"\nSmolLM2-135M-Instruct Q4_1 -> {SCHEME}; WikiText-2 test, {len(windows)} windows of {ctx} tokens "
          f"({sc['float'].tokens} scored), default kernels; calibration {a.calib_seqs} x 512 tokens")
    print("| config | PPL | x float | KL vs float | recovered of default RTN's increase | quantize s |")
    print("|---|---|---|---|---|---|")
    for name, s in sc.items():
        rec = "—" if name == "float" else f"{100 * (base - s.ppl) / (base - f):.0f}%"
        qs = f"{secs[name]:.0f}" if name in secs else "—"
        print(f"| {name} | {s.ppl:.2f} | {s.ppl / f:.2f} | {s.kl:.3f} | {rec} | {qs} |")
    load1 = os.getloadavg()
    print(f"\nload average (1 min) at start {load0[0]:.2f}, at end {load1[0]:.2f} on {os.cpu_count()} cores"
          f"{' (busy: quantize times are inflated)' if max(load0[0], load1[0]) > (os.cpu_count() or 1) * 0.75 else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
