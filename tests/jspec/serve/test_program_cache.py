"""jspec/serve/program_cache.py without JAX: a stopped cache drops what is queued (a server shutting down does not
wait for programs no request will run) and finishes the compile in progress."""

import threading
import time

from jspec.serve.program_cache import ProgramCache


class _Lowered:
    def __init__(self, key, started, release):
        self.key, self.started, self.release = key, started, release

    def compile(self):
        self.started.set()
        assert self.release.wait(10)
        return f"program {self.key}"


def test_stop_finishes_the_compile_in_progress_and_drops_the_queue():
    started, release, lowered = threading.Event(), threading.Event(), []

    def lower(key):
        lowered.append(key)
        return _Lowered(key, started, release)

    cache = ProgramCache(lower, ways_out="")
    for key in ("a", "b", "c"):
        cache.request(key)
    assert started.wait(10)  # "a" is compiling; "b" and "c" wait in the queue
    stopper = threading.Thread(target=cache.stop)
    stopper.start()
    deadline = time.monotonic() + 10
    while not cache._stopping and time.monotonic() < deadline:  # stop() has begun before "a" finishes
        time.sleep(0.01)
    release.set()
    stopper.join(10)
    assert not stopper.is_alive()
    assert lowered == ["a"] and cache.keys() == ["a"] and cache.pending() == 0
