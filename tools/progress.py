"""Shows a long install as it goes: `cmd 2>&1 | python3 tools/progress.py LOG`.

Every line of the command goes to LOG; the screen gets the lines a person
wants to follow (pip's packages, CMake's configure, one line per compiled
file, errors), each with the seconds since the start, and a line naming the
last step whenever nothing was shown for HEARTBEAT_S seconds (unpacking a big
wheel, a long compile), so an install is never silent for long. The exit
status is the caller's (`set -o pipefail`): on failure the Makefile prints
LOG's tail.

Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import re
import sys
import threading
import time

HEARTBEAT_S = 10.0

SHOW = re.compile(
    r"^\s*\[\d+/\d+\] "                      # ninja: one line per compiled / linked file
    r"|^\s*\[ *\d+%\] "                      # make generator: CMake's percentage
    r"|^(Collecting|Successfully installed|Installing collected packages|Building wheels? for|Building editable for|Saved)"
    r"|^\s*Downloading \S+ \("               # a download with its size
    r"|^\*\*\* "                             # scikit-build-core's steps (configure, build, install)
    r"|^-- (The CXX compiler|Build files have been written|llamajet)"
    r"|(?i:\berror\b|fatal|warning: )"
)
# pip's own -v chatter that matches the patterns above but says nothing to a person
HIDE = re.compile(r"^\s*(Created temporary directory|Ignoring|Skipping|Requirement already satisfied)"
                  r"|WARNING: Location '.*' is ignored")


def shorten(line: str, width: int = 150) -> str:
    # ninja's lines name the object file; the source is what a reader knows
    m = re.match(r"^\s*(\[\d+/\d+\]) Building CXX object .*?/([^/]+)\.o$", line)
    if m:
        return f"{m.group(1)} compiling {m.group(2)}"
    return line if len(line) <= width else line[: width - 3] + "..."


def main() -> int:
    log = open(sys.argv[1], "w", buffering=1) if len(sys.argv) > 1 else None
    t0 = time.monotonic()
    state = {"shown": t0, "last": "starting", "done": False}
    lock = threading.Lock()

    def emit(text: str) -> None:
        with lock:
            print(f"  [{time.monotonic() - t0:5.0f}s] {text}", flush=True)
            state["shown"] = time.monotonic()

    def heartbeat() -> None:
        while not state["done"]:
            time.sleep(1.0)
            if not state["done"] and time.monotonic() - state["shown"] >= HEARTBEAT_S:
                emit(f"... still working (last: {shorten(state['last'], 100)})")

    threading.Thread(target=heartbeat, daemon=True).start()
    for raw in sys.stdin:
        line = raw.rstrip("\n")
        if log:
            log.write(raw)
        if not line.strip():
            continue
        state["last"] = line.strip()
        if SHOW.search(line) and not HIDE.search(line):
            emit(shorten(line.strip()))
    state["done"] = True
    return 0


if __name__ == "__main__":
    sys.exit(main())
