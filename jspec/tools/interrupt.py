"""Ctrl-C for the command line: within :func:`exit_on_interrupt`, SIGINT ends the process at once with
``jspec: interrupted`` and exit code 130, after the cleanups registered with :func:`on_interrupt`."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Callable, Iterator

_interrupt_cleanups: list[Callable[[], None]] = []
_exiting = threading.Lock()


def _exit_interrupted() -> None:
    """Runs the registered cleanups, flushes what was printed, says so on stderr, and ends the process: exit 130.

    ``os._exit`` rather than KeyboardInterrupt: an exception can land inside a JAX/XLA callback (where it is
    swallowed and the run goes on) or wait behind a jitted call blocking in C++, and interpreter shutdown with XLA
    threads still running has crashed. A JAX program cannot be cancelled cleanly anyway."""
    if not _exiting.acquire(blocking=False):
        return  # the other path (signal handler or watcher thread) is already exiting
    for cleanup in reversed(_interrupt_cleanups):
        with contextlib.suppress(Exception):  # exiting regardless
            cleanup()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # e.g. a reentrant flush from the handler, or a closed pipe
            stream.flush()
    os.write(2, b"\njspec: interrupted\n")
    os._exit(130)


def _watch_for_interrupt(read_fd: int) -> None:
    """Reads the signal numbers CPython writes to its wakeup fd, so that SIGINT exits even while the main thread is
    in C++ (compiling, or waiting for a jitted call), where the Python signal handler runs only once that code
    checks for signals. A second SIGINT exits without waiting for the first one's cleanups."""
    interrupts = 0
    while True:
        data = os.read(read_fd, 64)
        if not data:
            return  # the write end was closed: exit_on_interrupt is done
        interrupts += data.count(signal.SIGINT)
        if interrupts > 1:
            os._exit(130)
        if interrupts:
            _exit_interrupted()


@contextlib.contextmanager
def exit_on_interrupt() -> Iterator[None]:
    """Within this block, SIGINT (Ctrl-C) calls :func:`_exit_interrupted`: from the Python signal handler when the
    main thread runs Python, and from a watcher thread woken by ``signal.set_wakeup_fd`` when it does not.
    Restores the previous handler on exit. Outside the main thread (where signals cannot be handled) it does
    nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous_handler = signal.signal(signal.SIGINT, lambda signum, frame: _exit_interrupted())
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    watcher = threading.Thread(target=_watch_for_interrupt, args=(read_fd,), name="jspec-interrupt", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        signal.signal(signal.SIGINT, previous_handler)
        os.close(write_fd)
        watcher.join()
        os.close(read_fd)


@contextlib.contextmanager
def on_interrupt(cleanup: Callable[[], None]) -> Iterator[None]:
    """Within this block, an interrupt runs ``cleanup()`` before the process exits."""
    _interrupt_cleanups.append(cleanup)
    try:
        yield
    finally:
        _interrupt_cleanups.remove(cleanup)
