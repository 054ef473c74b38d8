"""How much memory the machine has left: stores and caches that take memory up front check against it."""

from __future__ import annotations

from pathlib import Path


def available_memory_bytes(root: str = "/") -> int | None:
    """Memory this process can still get without swapping or passing its container's limit: the smaller of
    Linux's ``MemAvailable`` and what the cgroup's memory limit leaves (cgroup v2 or v1); None where the system
    tells neither. ``root``: where to find ``proc/`` and ``sys/`` (tests point it at fake files)."""
    def read(path):
        try:
            return (Path(root) / path).read_text()
        except OSError:
            return None

    found = []
    meminfo = read("proc/meminfo") or ""
    found += [int(line.split()[1]) * 1024 for line in meminfo.splitlines() if line.startswith("MemAvailable:")]
    for limit_file, usage_file in (("sys/fs/cgroup/memory.max", "sys/fs/cgroup/memory.current"),
                                   ("sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = read(limit_file), read(usage_file)
        if limit and usage and limit.strip().isdigit() and int(limit) < 2**60:  # "max" / huge: no limit
            found.append(max(0, int(limit) - int(usage)))
    return min(found) if found else None
