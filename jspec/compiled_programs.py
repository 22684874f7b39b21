"""Compiled programs shared by every ``SpecEngine`` in the process, keyed by what determines a program: the jitted
function, its static arguments (the ``GenerateSetup``: model configs, drafter, shapes derived from them) and each
argument's shape, dtype and sharding. Two engines over the same configuration and bucket run one compiled
program, whatever weights they hold (weights are arguments).

A bounded LRU: on XLA:CPU every compiled program holds about three memory mappings per kernel
(``jspec.serve.memory_maps``), so a process that kept every program it ever compiled would end at
``vm.max_map_count``; an engine keeps the programs it uses alive itself, this cache only lets the next engine find
them.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable

import jax

MAX_PROGRAMS = 32

_programs: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
_lock = threading.Lock()


def _signature(args: tuple) -> tuple:
    """What of ``args`` a compiled program depends on: their tree and each leaf's shape, dtype and sharding."""
    leaves, tree = jax.tree.flatten(args)
    return tree, tuple((tuple(leaf.shape), str(leaf.dtype), getattr(leaf, "sharding", None),
                        bool(getattr(leaf, "weak_type", False))) for leaf in leaves)


def compiled(fun: Callable, args: tuple, **static: Any) -> Any:
    """``fun.lower(*args, **static).compile()``, or the program an earlier call with the same function, static
    arguments (hashable) and argument signature compiled."""
    key = (fun, tuple(sorted(static.items())), _signature(args))
    with _lock:
        program = _programs.get(key)
        if program is not None:
            _programs.move_to_end(key)
            return program
    program = fun.lower(*args, **static).compile()
    with _lock:
        _programs[key] = program
        while len(_programs) > MAX_PROGRAMS:
            _programs.popitem(last=False)
    return program


def clear() -> None:
    """Forgets every shared program (engines keep theirs)."""
    with _lock:
        _programs.clear()
