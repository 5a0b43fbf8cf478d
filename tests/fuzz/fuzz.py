"""One fuzz target under atheris: ``python tests/fuzz/fuzz.py TARGET [libFuzzer flags] [corpus dirs]``.

tools/fuzz.py runs this with the sanitizer build of the extension preloaded
(LLAMAJET_CORE_SO, LD_PRELOAD) and libFuzzer's flags; run it by hand the same
way to replay a crash: ``python tests/fuzz/fuzz.py gguf build/fuzz/artifacts/gguf-crash-...``.
llamajet's Python (and the gguf reader it uses) is instrumented for coverage;
with the clang build the C++ core reports its own edges (fuzzer-no-link).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import sancore  # noqa: E402

sancore.use_core_from_env()

import atheris  # noqa: E402

# The modules the targets reach, imported first and then instrumented in place
# (instrument_imports() misses llamajet's modules under the editable install's
# redirecting finder; instrument_all() takes minutes under ASan's malloc).
import jinja2.sandbox  # noqa: E402,F401  (chat templates: the sandbox is what hostile templates probe)
import llamajet.formats.saved  # noqa: E402,F401
import llamajet.gguf_meta  # noqa: E402,F401
import llamajet.loaders  # noqa: E402,F401
import llamajet.server.app  # noqa: E402,F401
import llamajet.server.grammar  # noqa: E402,F401
import llamajet.server.protocol  # noqa: E402,F401
import llamajet.server.tools  # noqa: E402,F401
import llamajet.tokenizer  # noqa: E402,F401
import llamajet.tokenizer.chat  # noqa: E402,F401
import targets  # noqa: E402

COVERED = ("llamajet", "gguf", "jinja2", "targets")


def _instrument_modules(prefixes: tuple[str, ...]) -> int:
    """Instrument every function and method defined in the loaded modules named
    by `prefixes` (nested functions ride along in their parent's code)."""
    import inspect
    import types

    done = 0
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.split(".")[0] in prefixes:
            continue
        for obj in list(vars(mod).values()):
            funcs = [obj] if inspect.isfunction(obj) else (
                [v for v in vars(obj).values() if inspect.isfunction(v)] +
                [v.__func__ for v in vars(obj).values() if isinstance(v, (staticmethod, classmethod))]
                if inspect.isclass(obj) else [])
            for f in funcs:
                if isinstance(f, types.FunctionType) and f.__module__ == name and not getattr(f, "_lj_cov", False):
                    try:
                        atheris.instrument_func(f)
                        f._lj_cov = True
                        done += 1
                    except Exception:  # a function atheris cannot patch stays uninstrumented
                        pass
    return done


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in targets.TARGETS:
        sys.exit(f"usage: fuzz.py TARGET [libFuzzer flags] [corpus dirs]; targets: {', '.join(targets.TARGETS)}")
    name = sys.argv.pop(1)
    target = targets.TARGETS[name]
    # One pass over the seeds first: it imports what the target loads lazily
    # (and builds the server's app and model once, outside -timeout), so the
    # instrumentation below reaches those modules too.
    for seed in sorted((targets.CORPUS / name).iterdir()):
        try:
            target(seed.read_bytes())
        except Exception:  # the fuzzing proper reports it
            pass
    n = _instrument_modules(COVERED)
    print(f"fuzz.py: {n} functions instrumented in {', '.join(COVERED)}", file=sys.stderr)

    def one(data: bytes) -> None:
        target(data)

    atheris.Setup(sys.argv, one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
