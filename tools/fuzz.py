"""make fuzz / make fuzz-long: every fuzz target (tests/fuzz/targets.py) under atheris on an ASan build.

    .venv/bin/python tools/fuzz.py [--runs 2000] [--targets gguf,server] [--compiler auto|clang++|g++]

The extension is built with sanitizers first (tools/sanitize.sh's build
directory, ``-DLLAMAJET_SANITIZE``):

* clang (Debian's ``clang``): ``fuzzer-no-link,address,undefined``, so libFuzzer's
  coverage reaches the C++ paths as well as the Python ones, with atheris's
  ``asan_with_fuzzer.so`` preloaded as the runtime;
* gcc when clang is absent (CI machines without it): ``address,undefined``
  with gcc's libasan preloaded; the guidance is then Python coverage only,
  and the run says so.

Each target starts from its seeds (tests/fuzz/corpus/<target>/) and a working
corpus under build/fuzz/corpus/<target>/ that persists between runs, so a
long campaign continues where it stopped. A finding is any crash, sanitizer
report, uncaught Python exception (the targets raise on anything but
llamajet's own errors), a single allocation over the memory limit, or an
input that takes more than 2 s (``-timeout=2``); its input lands in
build/fuzz/artifacts/ and the run fails. Counts per target are printed and
written to build/fuzz/summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = Path(sys.executable)
TIMEOUT_S = 2          # a hang is any input over 2 s (the definition)
RSS_LIMIT_MB = 6144    # ASan's shadow and quarantine included; also the largest single allocation allowed


def _targets() -> list[str]:
    sys.path.insert(0, str(ROOT / "tests" / "fuzz"))
    import targets

    return list(targets.TARGETS)


def build(compiler: str) -> tuple[Path, list[str], str]:
    """(the sanitizer build's _core .so, LD_PRELOAD entries, a description)."""
    if compiler == "auto":
        compiler = "clang++" if shutil.which("clang++") else "g++"
    clang = compiler.startswith("clang")
    sanitizers = "fuzzer-no-link,address,undefined" if clang else "address,undefined"
    # the very build tools/sanitize.sh makes (same directory, same flags), so make test compiles it once
    out = ROOT / "build" / f"sanitize-{compiler}"
    cfg = ["cmake", "-S", str(ROOT), "-B", str(out), "-DCMAKE_BUILD_TYPE=Debug", f"-DCMAKE_CXX_COMPILER={compiler}",
           f"-DPython_EXECUTABLE={PY}", f"-DLLAMAJET_SANITIZE={sanitizers}"]
    log = out.with_suffix(".build.log")
    with open(log, "w") as f:
        for cmd in (cfg, ["cmake", "--build", str(out), f"-j{os.cpu_count() or 1}"]):
            if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode != 0:
                sys.exit(f"fuzz: the {compiler} build failed; see {log}")
    so = next(out.glob("_core*.so"))
    if clang:
        import atheris

        runtime = str(Path(atheris.path()) / "asan_with_fuzzer.so")
    else:
        runtime = subprocess.run([compiler, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    stdcxx = subprocess.run([compiler, "-print-file-name=libstdc++.so.6"], capture_output=True, text=True).stdout.strip()
    what = (f"{compiler} {sanitizers}: C++ and Python coverage" if clang else
            f"{compiler} {sanitizers}: NO coverage guidance (gcc's libasan provides the coverage hooks atheris needs, "
            "so inputs are mutations of the seeds only; install clang for guided runs)")
    return so, [runtime, stdcxx], what


def run_target(name: str, runs: int, env: dict, max_time: int | None) -> dict:
    seeds = ROOT / "tests" / "fuzz" / "corpus" / name
    work = ROOT / "build" / "fuzz" / "corpus" / name
    arts = ROOT / "build" / "fuzz" / "artifacts"
    work.mkdir(parents=True, exist_ok=True)
    arts.mkdir(parents=True, exist_ok=True)
    cmd = [str(PY), str(ROOT / "tests" / "fuzz" / "fuzz.py"), name, f"-runs={runs}", f"-timeout={TIMEOUT_S}",
           f"-rss_limit_mb={RSS_LIMIT_MB}", f"-artifact_prefix={arts}/{name}-", "-print_final_stats=1",
           str(work), str(seeds)]
    if max_time:
        cmd.insert(4, f"-max_total_time={max_time}")
    t0 = time.time()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    secs = time.time() - t0
    log = ROOT / "build" / "fuzz" / f"{name}.log"
    log.write_text(r.stdout + r.stderr)
    m = re.findall(r"stat::number_of_executed_units:\s*(\d+)", r.stderr)
    executed = int(m[-1]) if m else 0
    cov = re.findall(r"cov: (\d+) ft: (\d+) corp: (\d+)", r.stderr)
    finding = r.returncode != 0 or re.search(r"ERROR: (AddressSanitizer|libFuzzer|UndefinedBehavior)|runtime error:",
                                             r.stderr)
    return {"target": name, "inputs": executed, "seconds": round(secs, 1), "rc": r.returncode,
            "coverage": int(cov[-1][0]) if cov else 0, "features": int(cov[-1][1]) if cov else 0,
            "corpus": int(cov[-1][2]) if cov else 0, "finding": bool(finding), "log": str(log.relative_to(ROOT))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2000, help="inputs per target (libFuzzer -runs)")
    ap.add_argument("--max-time", type=int, default=None, help="seconds per target at most (-max_total_time)")
    ap.add_argument("--targets", default="", help="comma-separated subset (default: all), each optionally name=inputs")
    ap.add_argument("--summary", default="build/fuzz/summary.json", help="where the counts are written")
    ap.add_argument("--compiler", default="auto", help="clang++, g++, or auto (clang++ when present)")
    a = ap.parse_args()
    names = _targets()
    runs = dict.fromkeys(names, a.runs)
    if a.targets:  # "gguf,server" or "gguf=60000,server=100000"
        want = dict((t.split("=")[0], int(t.split("=")[1]) if "=" in t else a.runs) for t in a.targets.split(","))
        unknown = sorted(set(want) - set(names))
        if unknown:
            sys.exit(f"fuzz: unknown targets {unknown}; known: {names}")
        names, runs = list(want), want
    so, preload, what = build(a.compiler)
    env = dict(os.environ, LLAMAJET_CORE_SO=str(so), LD_PRELOAD=" ".join(preload),
               # short malloc stacks and a smaller quarantine: python allocates
               # constantly, and full 30-frame unwinds on each made runs 5x slower
               ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:allocator_may_return_null=1:malloc_context_size=4:"
                            "quarantine_size_mb=64",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1", PYTHONHASHSEED="0")
    print(f"fuzz: {what}; {a.runs if not a.targets else runs} inputs per target, timeout {TIMEOUT_S} s, rss limit {RSS_LIMIT_MB} MB", flush=True)
    rows = []
    for n in names:
        row = run_target(n, runs[n], env, a.max_time)
        rows.append(row)
        flag = "FINDING, see " + row["log"] if row["finding"] else "ok"
        print(f"  {n:18s} {row['inputs']:>8d} inputs {row['seconds']:>7.1f} s  cov {row['coverage']:>6d}  "
              f"corpus {row['corpus']:>5d}  {flag}", flush=True)
    total = sum(r["inputs"] for r in rows)
    summary = {"build": what, "runs_per_target": runs, "timeout_s": TIMEOUT_S, "total_inputs": total, "targets": rows}
    (ROOT / a.summary).write_text(json.dumps(summary, indent=1))
    bad = [r["target"] for r in rows if r["finding"] or r["inputs"] < 1]
    print(f"fuzz: {total} inputs in all; " + (f"FINDINGS in {bad} (inputs under build/fuzz/artifacts/)" if bad
                                              else "0 crashes, hangs or sanitizer reports"))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
