"""The host's own resources: RAM (and the cgroup limit below it), the cores this process may use, the cache folder.

Standard library only (psutil when asked for memory)."""

from __future__ import annotations

import os
from pathlib import Path

# The memory controller's limit as a container sees its own cgroup (v2, then v1); "max" or a v1 value near 2**63
# (page-rounded) means none.
CGROUP_MEMORY_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def cgroup_memory_files() -> list[str]:
    """Where this process's memory limits may be: its own cgroup and (v2) every ancestor, from /proc/self/cgroup
    (a Slurm job step's cgroup, a systemd scope), then the container's root files."""
    out: list[str] = []
    try:
        entries = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        entries = []
    for entry in entries:
        parts = entry.split(":", 2)
        if len(parts) != 3:
            continue
        controllers, path = parts[1], parts[2].strip("/")
        if controllers == "":  # v2: a limit on any ancestor applies too
            names = path.split("/") if path else []
            out += [f"/sys/fs/cgroup/{'/'.join(names[:i])}/memory.max".replace("//", "/") for i in range(len(names), 0, -1)]
        elif "memory" in controllers.split(","):
            out.append(f"/sys/fs/cgroup/memory/{path}/memory.limit_in_bytes".replace("//", "/"))
    return out + [p for p in CGROUP_MEMORY_LIMITS if p not in out]


def host_memory() -> tuple[int, str]:
    """Bytes of RAM this host's processes may use together, and where the figure came from: the lowest cgroup
    memory limit below the host's RAM (a container, a Slurm job with memory cgroups), else the RAM.
    The planner once credited every CPU rank with the whole host RAM, whatever the container allowed."""
    import psutil

    total, source = int(psutil.virtual_memory().total), "host RAM"
    for path in cgroup_memory_files():
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total, source = int(text), f"cgroup limit {path}"
    return total, source


def cpu_cores() -> int:
    """The cores this process may run on (its affinity: a container's or taskset's share, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cache_path() -> Path:
    """This project's cache folder (QWEN3_RESEARCH_CACHE, else $XDG_CACHE_HOME/qwen3_research), not created."""
    return Path(os.environ.get("QWEN3_RESEARCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "qwen3_research"))


def cache_dir() -> Path:
    """This project's cache folder (``cache_path``), created."""
    path = cache_path()
    path.mkdir(parents=True, exist_ok=True)
    return path
