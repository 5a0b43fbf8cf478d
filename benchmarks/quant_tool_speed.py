"""How long the calibrated quantizers take, and how much memory they hold:
issue 16's tool targets (GPTQ and AWQ on SmolLM2 at the default calibration,
128 x 512 tokens, within 5 minutes each; GPTQ on a Llama-3.2-1B-shape bf16
checkpoint at 64 x 512 within 20 minutes and peak RSS within 2.5x the
checkpoint's bytes).

    python benchmarks/quant_tool_speed.py --out /tmp/qspeed [--only smollm2-gptq,smollm2-awq,1b-gptq]

Each run is `llamajet quantize` in its own process (so the import, the load,
the calibration forward, the method and the write are all counted), timed
from the spawn to the exit; peak RSS is that process's own (os.wait4's
ru_maxrss). Calibration text: WikiText-2 test after character 600,000 (the
text quant_table.py calibrates on, disjoint from its scored windows). The 1B
checkpoint is random weights of the real shapes (make_random_gguf.py
--mix hf-bf16, written under --out, never into the repository): fair for
time and memory, meaningless as a model. The INT4 runs keep the embedding
and head at int8_g32, as the quality table's rows do.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WIKI = ROOT / ".." / "shared" / "data" / "corpora" / "wikitext-2-raw-test.txt"

RUNS = {  # name -> (source, quantize arguments)
    # SmolLM2's only file is Q4_1: quantizing it to another scheme is a re-quantization
    "smollm2-gptq": ("smollm2", ["--scheme", "int4_sym_g128", "--method", "gptq", "--act-order",
                                 "--embed-scheme", "int8_g32", "--calib-seqs", "128", "--allow-requantize"]),
    "smollm2-awq": ("smollm2", ["--scheme", "int4_sym_g128", "--method", "awq",
                                "--embed-scheme", "int8_g32", "--calib-seqs", "128", "--allow-requantize"]),
    "1b-gptq": ("1b", ["--scheme", "int4_sym_g128", "--method", "gptq", "--act-order",
                       "--embed-scheme", "int8_g32", "--calib-seqs", "64"]),
}


def timed(cmd: list[str], log: Path) -> tuple[int, float, float]:
    """(exit status, wall seconds, peak RSS MiB) of one process."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        _, status, ru = os.wait4(p.pid, 0)
    return os.waitstatus_to_exitcode(status), time.perf_counter() - t0, ru.ru_maxrss / 1024


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="work folder outside the repository")
    ap.add_argument("--only", default=",".join(RUNS))
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    calib = a.out / "calib.txt"
    calib.write_text(WIKI.read_text(encoding="utf-8")[600000:], encoding="utf-8")
    from llamajet.models import default_model_path
    sources = {"smollm2": Path(default_model_path())}
    results = []
    for name in a.only.split(","):
        kind, args = RUNS[name]
        if kind not in sources:
            folder = a.out / "hf-1b-bf16"
            if not (folder / "model.safetensors").exists():
                subprocess.run([sys.executable, str(ROOT / "benchmarks" / "make_random_gguf.py"), str(folder),
                                "--shape", "1b", "--mix", "hf-bf16"], check=True)
            sources[kind] = folder
        src = sources[kind]
        weights = [src] if src.is_file() else [f for f in src.iterdir() if f.suffix == ".safetensors"]
        src_bytes = sum(f.stat().st_size for f in weights)  # SmolLM2's source is one GGUF file
        out = a.out / name
        cmd = [str(Path(sys.executable).parent / "llamajet"), "quantize", str(src), str(out), "--force",
               "--calib", str(calib), *args]
        rc, wall, rss = timed(cmd, a.out / f"{name}.log")
        r = {"run": name, "rc": rc, "wall_s": round(wall, 1), "peak_rss_mib": round(rss),
             "source_mib": round(src_bytes / 2**20), "rss_over_source": round(rss * 2**20 / src_bytes, 2),
             "args": args, "cpus": os.cpu_count()}
        results.append(r)
        print(json.dumps(r), flush=True)
    print("\n| run | wall | peak RSS | source | RSS / source |\n|---|---|---|---|---|")
    for r in results:
        print(f"| {r['run']} | {r['wall_s'] / 60:.1f} min | {r['peak_rss_mib']} MiB | {r['source_mib']} MiB "
              f"| {r['rss_over_source']}x |")
    (a.out / "results.json").write_text(json.dumps(results, indent=1))
    return int(any(r["rc"] != 0 for r in results))


if __name__ == "__main__":
    sys.exit(main())
