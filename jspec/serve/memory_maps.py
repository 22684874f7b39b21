"""The process's memory mappings against the kernel's limit (Linux): on XLA:CPU every compiled program holds about
three mappings per kernel it JIT-compiles (code, constants, data), a thousand or more for a small model, and a
process past ``vm.max_map_count`` (65,530 by default) dies inside LLVM ("Cannot allocate memory") rather than
fail cleanly. The server counts them before compiling (``SlotEngine.warm_up``)."""

from __future__ import annotations

import os

MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"
RAISE_IT = "sudo sysctl -w vm.max_map_count=262144"


def max_map_count() -> int | None:
    """The kernel's limit on a process's mappings, None where there is none to read (not Linux)."""
    try:
        with open(MAX_MAP_COUNT) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def maps_in_use() -> int | None:
    """This process's mappings now, None where they cannot be counted."""
    path = f"/proc/{os.getpid()}/maps"
    try:
        with open(path) as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def room_for(programs: int, per_program: float | None, margin: float = 0.9) -> bool:
    """Whether ``programs`` more programs of ``per_program`` mappings each fit under ``margin`` of the limit (True
    where the limit, the count or the per-program figure is unknown)."""
    limit, used = max_map_count(), maps_in_use()
    if limit is None or used is None or per_program is None:
        return True
    return used + programs * per_program <= margin * limit
