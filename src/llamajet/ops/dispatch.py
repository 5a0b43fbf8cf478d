"""Kernel-tier choice and thread count: decided once, here and only here.

The tier is the best ISA the CPU and OS support (cpuid + XCR0, read by the
C++ core). ``LLAMAJET_ISA=ref|avx2|avx512|amx`` forces a lower tier so tests can
run every path this machine has; asking for a tier the CPU lacks is an error,
not a silent fallback.
"""

from __future__ import annotations

import math
import os
import warnings
from functools import lru_cache

from llamajet import _core
from llamajet.errors import LlamajetError

ISA_ORDER = ("ref", "avx2", "avx512", "amx")
# Accepted spellings of the override.
_ALIASES = {"scalar": "ref", "ref": "ref", "avx2": "avx2", "avx512": "avx512", "avx-512": "avx512", "amx": "amx"}


def supported_isas() -> list[str]:
    """ISAs this CPU can run, lowest first."""
    return list(_core.supported_isas())


def resolve_isa(requested: str | None = None) -> str:
    """The ISA to use: `requested`, else $LLAMAJET_ISA, else the best supported."""
    name = requested if requested is not None else os.environ.get("LLAMAJET_ISA", "")
    supported = supported_isas()
    if not name:
        return supported[-1]
    isa = _ALIASES.get(name.strip().lower())
    if isa is None:
        raise LlamajetError(f"unknown ISA {name!r} (LLAMAJET_ISA): use one of scalar, avx2, avx512, amx")
    if isa not in supported:
        raise LlamajetError(f"ISA {isa!r} requested but this CPU supports only {', '.join(supported)}")
    return isa


@lru_cache(maxsize=1)
def physical_cores() -> int:
    """Physical cores available to this process (SMT siblings counted once).

    Matmul threads sharing a core compete for the same FMA units, so the
    default thread count is the number of distinct (package, core) pairs
    among the CPUs this process may run on.
    """
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1
    cores = set()
    for cpu in allowed:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{base}/physical_package_id") as f:
                pkg = f.read().strip()
            with open(f"{base}/core_id") as f:
                core = f.read().strip()
            cores.add((pkg, core))
        except OSError:
            cores.add(("?", str(cpu)))
    return max(1, len(cores))


def _cgroup_paths(proc_cgroup: str) -> tuple[str | None, str | None]:
    """(v2 path, v1 cpu-controller path) of this process's cgroup, read from
    /proc/self/cgroup ('0::/a/b' for v2; 'N:cpu,cpuacct:/a/b' for v1)."""
    v2 = v1 = None
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "cpu" in parts[1].split(","):
            v1 = parts[2]
    return v2, v1


def _ancestors(root: str, path: str) -> list[str]:
    """root/path and each folder above it up to root (the tightest quota wins:
    a child cgroup is throttled by every ancestor's quota as well)."""
    parts = [p for p in (path or "/").split("/") if p and p not in (".", "..")]
    return [os.path.join(root, *parts[:i]) for i in range(len(parts), -1, -1)]


def _read_quota_v2(d: str) -> float | None:
    with open(os.path.join(d, "cpu.max")) as f:
        quota, period = f.read().split()[:2]
    return None if quota == "max" else max(int(quota) / int(period), 0.0) or None


def _read_quota_v1(d: str) -> float | None:
    with open(os.path.join(d, "cpu.cfs_quota_us")) as f:
        quota = int(f.read())
    with open(os.path.join(d, "cpu.cfs_period_us")) as f:
        period = int(f.read())
    return quota / period if quota > 0 and period > 0 else None


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """The CPU quota of this process's cgroup in CPUs, None when unlimited or
    unknown: the tightest of its own cgroup's and every ancestor's (v2
    `cpu.max`; v1 `cpu.cfs_quota_us / cpu.cfs_period_us` under the cpu
    controller's mount), the cgroup's path read from /proc/self/cgroup. A
    container limited to 2 CPUs on a 64-core node reports 64 cores
    everywhere else; threads beyond its quota are throttled. (Reading only
    the hierarchy's root missed a process in a child cgroup.)"""
    v2, v1 = _cgroup_paths(proc_cgroup)
    found: list[float] = []
    dirs: list[tuple[str, object]] = [(d, _read_quota_v2) for d in _ancestors(root, v2 or "/")]
    for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        dirs += [(d, _read_quota_v1) for d in _ancestors(os.path.join(root, mount), v1 or "/")]
    for d, read in dirs:
        try:
            q = read(d)
        except (OSError, ValueError, IndexError):
            continue
        if q is not None:
            found.append(q)
    return min(found) if found else None


def usable_cores(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> tuple[int, str]:
    """(usable cores, why): the physical cores in this process's affinity
    mask, capped by ceil(the CPU quota of its cgroup) (1.5 CPUs -> 2)."""
    n = physical_cores()
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        cpus = os.cpu_count() or 1
    why = f"{n} physical core{'s' * (n != 1)} in the affinity mask ({cpus} CPU{'s' * (cpus != 1)})"
    quota = cgroup_cpu_limit(root, proc_cgroup)
    if quota is None:
        return n, why + "; no cgroup CPU quota"
    cap = max(1, math.ceil(quota))
    if cap < n:
        return cap, why + f"; cgroup CPU quota {quota:g} CPUs caps it at {cap}"
    return n, why + f"; cgroup CPU quota {quota:g} CPUs (no tighter)"


def default_threads(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> int:
    """The usable cores (usable_cores)."""
    return usable_cores(root, proc_cgroup)[0]


class ThreadsClampedWarning(UserWarning):
    """n_threads above the usable cores, lowered to them."""


def resolve_threads(requested: int | None, oversubscribe: bool = False, *, root: str = "/sys/fs/cgroup",
                    proc_cgroup: str = "/proc/self/cgroup") -> int:
    """The compute threads to run: `requested`, or the usable cores when None.

    More threads than usable cores never helps and usually hurts a lot (a
    thread the OS must time-slice holds up every op it has work in; with
    claimed chunks far less, but each extra thread still costs a core's
    worth of context switches): so a request above the usable cores is
    lowered to them with a one-line ThreadsClampedWarning, unless
    `oversubscribe` keeps it."""
    usable, why = usable_cores(root, proc_cgroup)
    if requested is None:
        return usable
    if requested > usable and not oversubscribe:
        warnings.warn(f"n_threads={requested} is more than the {usable} usable core{'s' * (usable != 1)} ({why}): "
                      f"running {usable} (oversubscribe=True / --oversubscribe keeps {requested})",
                      ThreadsClampedWarning, stacklevel=3)
        return usable
    return requested
