"""The memory this process may still take: the host's available RAM, capped by its cgroup's memory limit.

In a container started with a memory limit (`docker run --memory`, a Kubernetes `resources.limits.memory`)
/proc/meminfo still shows the host's RAM; the kernel kills the process when its cgroup's charge reaches
the limit. So the CPU KV budget (a quarter of what is available) reads the limit too: cgroup v2's
`memory.max` or cgroup v1's `memory/memory.limit_in_bytes`, of the process's own cgroup and each of its
ancestors (a container sees its own at the mount's root), the tightest one. What the cgroup has charged
counts against it, less the page cache the kernel reclaims before it kills anything (the active and
inactive file pages: a container's first start charges it the libraries and model files it reads, ~0.5
GB here, which the kubelet's working set, usage less inactive_file, would still count). Shared memory
and tmpfs sit on the anon lists: they count.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"
# cgroup v1 writes "no limit" as 2**63 - 1 rounded down to a page; any value from 2**60 up is none
NO_LIMIT = 1 << 60


@dataclass(frozen=True)
class CgroupLimit:
    """The tightest memory limit over the process's cgroups: where it is set, the bytes it allows, and the
    bytes it leaves (the limit less the working set charged there)."""

    path: str
    limit: int
    headroom: int


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _bytes(text: str | None) -> int | None:
    """A limit file's value; None for "max", a huge v1 value, or anything unreadable."""
    if text is None or not text.isdigit():
        return None
    value = int(text)
    return value if value < NO_LIMIT else None


def _stat(folder: str, keys: tuple[str, ...]) -> int:
    """The sum of `keys`' values in the folder's memory.stat."""
    total = 0
    for line in (_read(os.path.join(folder, "memory.stat")) or "").splitlines():
        name, _, value = line.partition(" ")
        if name in keys and value.isdigit():
            total += int(value)
    return total


def _own_paths(proc_cgroup: str) -> tuple[str, str]:
    """This process's cgroup v2 path and cgroup v1 memory path from /proc/self/cgroup ("/" when absent)."""
    v2 = v1 = "/"
    for line in (_read(proc_cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2] or "/"
        elif "memory" in parts[1].split(","):
            v1 = parts[2] or "/"
    return v2, v1


def _folders(mount: str, path: str) -> list[str]:
    """`mount`/`path` and every folder above it up to `mount` itself, those that exist."""
    parts = [p for p in path.split("/") if p and p not in (".", "..")]
    folders = [os.path.join(mount, *parts[:i]) for i in range(len(parts), -1, -1)]
    return [f for f in folders if os.path.isdir(f)]


def cgroup_memory_limit(root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> CgroupLimit | None:
    """The tightest memory limit over this process's cgroup and its ancestors, cgroup v2 (at `root`, or at
    `root`/unified on a hybrid host) and v1 (`root`/memory); None where no level sets one."""
    v2_path, v1_path = _own_paths(proc_cgroup)
    # (folder, limit file, usage file, the page cache's keys in memory.stat)
    levels = [
        (f, "memory.max", "memory.current", ("active_file", "inactive_file"))
        for m in (root, os.path.join(root, "unified"))
        for f in _folders(m, v2_path)
    ]
    levels += [
        (f, "memory.limit_in_bytes", "memory.usage_in_bytes", ("total_active_file", "total_inactive_file"))
        for f in _folders(os.path.join(root, "memory"), v1_path)
    ]
    best: CgroupLimit | None = None
    for folder, limit_file, usage_file, cache_keys in levels:
        limit = _bytes(_read(os.path.join(folder, limit_file)))
        if limit is None:
            continue
        used = _bytes(_read(os.path.join(folder, usage_file))) or 0
        working_set = max(0, used - _stat(folder, cache_keys))
        headroom = max(0, limit - working_set)
        if best is None or headroom < best.headroom:
            best = CgroupLimit(folder, limit, headroom)
    return best


def available_memory(root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> tuple[int, CgroupLimit | None]:
    """Bytes this process may still allocate: the host's available RAM (psutil), or less where a cgroup
    limit leaves less; with that limit (None: the host's RAM decides)."""
    import psutil

    host = int(psutil.virtual_memory().available)
    limit = cgroup_memory_limit(root, proc_cgroup)
    if limit is not None and limit.headroom < host:
        return limit.headroom, limit
    return host, None
