"""Was the machine busy while a benchmark's workers ran? The CPU time that
other processes used meanwhile: /proc/stat's busy time less the workers' own
(os.times of this process and its waited-for children). A load average would
count the workers' own threads and call every 2-thread run on 2 cores busy."""

from __future__ import annotations

import os
import subprocess
import time


def busy_cpus() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat:
    user, nice, system, irq, softirq and steal, a hypervisor's other guests
    being a busy machine too; guest time is inside user already)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / os.sysconf("SC_CLK_TCK")


class Others:
    """Runs workers and adds up what the rest of the machine used while they ran."""

    def __init__(self) -> None:
        self.cpu = 0.0  # other processes' CPU seconds while workers ran
        self.capacity = 0.0  # the workers' wall seconds x the machine's CPUs

    def run(self, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        """subprocess.run(cmd, capture_output=True, text=True, **kw), counted."""
        ru0, b0, t0 = os.times(), busy_cpus(), time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, **kw)
        ru1, b1, t1 = os.times(), busy_cpus(), time.perf_counter()
        own = sum(getattr(ru1, f) - getattr(ru0, f) for f in ("user", "system", "children_user", "children_system"))
        self.cpu += max(0.0, (b1 - b0) - own)
        self.capacity += (t1 - t0) * (os.cpu_count() or 1)
        return out

    def share(self) -> float:
        """The share of the machine that other processes used while workers ran."""
        return self.cpu / self.capacity if self.capacity else 0.0

    def line(self, busy_above: float = 0.05) -> str:
        s = self.share()
        return (f"other processes used {s:.1%} of the machine while the workers ran "
                f"({'busy machine' if s > busy_above else 'quiet'})")
