"""The server's compiled programs by key, compiled up front or on first use in a thread of their own.

A server has more buckets (prompt widths x prefill batches, occupancy x context lengths, per step program) than
it needs at any one time, and on XLA:CPU every compiled program holds about three memory mappings per kernel: all
of them compiled up front passed the stock ``vm.max_map_count`` of 65,530 (``jspec.serve.memory_maps``). So the
slot engine compiles at warm-up only what serves every request (the widest buckets) and what warm-up itself runs;
a request whose exact bucket is missing runs on the smallest compiled bucket that holds it (a program over more
rows or a longer context gives the same tokens) while this cache compiles the exact one on its own thread, so the
scheduler's thread never waits for a compile. Programs are compiled on demand while the mapping budget has room
for one more; past it, the larger buckets keep serving and a warning says so once.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
import time
from typing import Any, Callable, Hashable, Iterable

from jspec.serve import memory_maps

logger = logging.getLogger("jspec.serve")

Key = Hashable


class ProgramCache:
    """Compiled programs by key.

    lower: key -> the program lowered (``jax.jit(...).lower(...)``), called on the compiling thread; ways_out:
    what the refusal of :meth:`compile_up_front` tells the user to change. Reading (``key in cache``,
    ``cache[key]``, :meth:`keys`) never blocks on a compile.
    """

    def __init__(self, lower: Callable[[Key], Any], ways_out: str):
        self._lower = lower
        self._ways_out = ways_out
        self._compiled: dict[Key, Any] = {}
        self._wanted: queue.Queue[Key | None] = queue.Queue()
        self._asked: set[Key] = set()  # queued, compiling, compiled or refused
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._warned = False
        self._stopping = False
        self.maps_per_program: int | None = None  # memory mappings one compiled program took (CPU)
        self.compiled_on_demand: list[Key] = []  # in the order they finished

    def __contains__(self, key: Key) -> bool:
        return key in self._compiled

    def __getitem__(self, key: Key) -> Any:
        return self._compiled[key]

    def __len__(self) -> int:
        return len(self._compiled)

    def keys(self) -> list[Key]:
        return list(self._compiled)

    def items(self) -> list[tuple[Key, Any]]:
        return list(self._compiled.items())

    def compile_up_front(self, keys: Iterable[Key], later: int = 0) -> None:
        """Compiles ``keys`` now, on every core. The first one alone first: from the mappings it took, refuses
        (ValueError naming the ways out) where all of them and ``later`` more programs would pass the kernel's
        limit, before minutes of compiling end in LLVM's "Cannot allocate memory"."""
        keys = [key for key in dict.fromkeys(keys) if key not in self._compiled]
        if not keys:
            return
        before = memory_maps.maps_in_use()
        first = self._lower(keys[0]).compile()
        after = memory_maps.maps_in_use()
        if before is not None and after is not None:
            self.maps_per_program = max(after - before, 1)
            rest = len(keys) - 1 + later
            if not memory_maps.room_for(rest, self.maps_per_program, margin=0.95):
                raise ValueError(
                    f"this server would compile {rest + 1} programs of about {self.maps_per_program} memory "
                    f"mappings each (XLA:CPU maps every kernel it compiles), {after + rest * self.maps_per_program} "
                    f"in all: above this system's vm.max_map_count={memory_maps.max_map_count()}, where the "
                    f"process would die compiling. Raise it ({memory_maps.RAISE_IT}), or compile fewer programs: "
                    f"{self._ways_out}")
        compiled = {keys[0]: first}
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # XLA compiles without the GIL
            compiled.update(zip(keys[1:], pool.map(lambda key: self._lower(key).compile(), keys[1:])))
        with self._lock:
            self._compiled.update(compiled)
            self._asked.update(compiled)

    def compile_now(self, keys: Iterable[Key]) -> None:
        """Compiles ``keys`` on this thread, one after another (those not compiled yet; one queued for the
        compiling thread meanwhile is compiled there again, and the later copy kept)."""
        for key in keys:
            if key in self._compiled:
                continue
            program = self._lower(key).compile()
            with self._lock:
                self._compiled[key] = program
                self._asked.add(key)

    def request(self, key: Key) -> None:
        """Asks for ``key`` to be compiled on the compiling thread (once; nothing where it is compiled, queued or
        was refused for want of mappings)."""
        with self._lock:
            if key in self._asked:
                return
            self._asked.add(key)
            if self._thread is None:
                self._thread = threading.Thread(target=self._compile_wanted, name="jspec-compile", daemon=True)
                self._thread.start()
        self._wanted.put(key)

    def stop(self) -> None:
        """Ends the compiling thread after the compile in progress (the rest of the queue is dropped: a server
        shutting down does not wait for programs no request will run)."""
        with self._lock:
            thread, self._stopping = self._thread, True
        if thread is not None:
            self._wanted.put(None)
            thread.join()

    def pending(self) -> int:
        """Programs asked for and not yet compiled or refused (queued or compiling)."""
        return self._wanted.unfinished_tasks

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Waits until every requested program is compiled or refused (tests) -> whether it got there in time."""
        end = None if timeout is None else time.monotonic() + timeout
        while self._wanted.unfinished_tasks:
            if end is not None and time.monotonic() > end:
                return False
            time.sleep(0.05)
        return True

    def _compile_wanted(self) -> None:
        while True:
            key = self._wanted.get()
            try:
                if key is None:
                    return
                if self._stopping:  # dropped: stop() is waiting
                    continue
                if not memory_maps.room_for(1, self.maps_per_program):
                    if not self._warned:
                        self._warned = True
                        logger.warning("no room under vm.max_map_count=%s for more programs: requests whose bucket "
                                       "is not compiled run on a larger one (%s to compile every bucket)",
                                       memory_maps.max_map_count(), memory_maps.RAISE_IT)
                    continue
                began = time.perf_counter()
                try:
                    program = self._lower(key).compile()
                except Exception:  # a failed compile leaves the larger buckets serving; never the scheduler's end
                    logger.exception("compiling %s failed; its requests run on a larger bucket", key)
                    continue
                with self._lock:
                    self._compiled[key] = program
                    self.compiled_on_demand.append(key)
                logger.info("compiled %s on first use in %.1f s", key, time.perf_counter() - began)
            finally:
                self._wanted.task_done()
