"""jspec/serve/program_cache.py without JAX: a stopped cache drops what is queued (a server shutting down does not
wait for programs no request will run) and finishes the compile in progress; a structured step runs on a compiled
stand-in while its own programs compile."""

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


def _masked_runner(compiled: list[tuple]):
    """A ModelRunner as far as choosing a masked step's bucket reads it: a speculative server with a short chain,
    row buckets (4, 8), length buckets (64, 128), ``compiled`` keys compiled; requested and synchronously compiled
    keys recorded."""
    from jspec.serve.model_runner import ModelRunner

    class Programs(ProgramCache):
        def __init__(self):
            super().__init__(lambda key: None, ways_out="")
            self._compiled = {key: object() for key in compiled}
            self.asked, self.now = [], []

        def request(self, key):
            self.asked.append(key)

        def compile_now(self, keys):
            keys = list(keys)
            self.now += keys
            self._compiled.update({key: object() for key in keys})

    runner = ModelRunner.__new__(ModelRunner)
    runner.speculative, runner.short_nodes = True, 3
    runner.row_buckets, runner.seq_buckets = (4, 8), (64, 128)
    runner.programs = Programs()
    return runner


def test_a_structured_step_runs_on_a_compiled_stand_in_while_its_own_compiles():
    """Its own programs where compiled; else a larger compiled bucket of its program, else of another masked
    program (a lean one only for a lean step), its own asked for off the scheduler's thread; with none compiled,
    its own compiled there and then."""
    from jspec.serve.adapt import FULL, PLAIN, SHORT

    own = _masked_runner([("forward", 4, 64), ("masked", PLAIN, 4, 64, True)])
    assert own.masked_bucket(PLAIN, 4, 64, True) == (PLAIN, 4, 64, True) and own.programs.asked == []
    larger = _masked_runner([("forward", 8, 128), ("forward", 8, 64), ("masked", PLAIN, 8, 128, True),
                             ("masked", PLAIN, 8, 64, False)])
    assert larger.masked_bucket(PLAIN, 4, 64, True) == (PLAIN, 8, 64, False)  # the smallest that holds it
    assert larger.programs.asked == [("forward", 4, 64), ("masked", PLAIN, 4, 64, True)]
    assert larger.programs.now == []
    other = _masked_runner([("propose", 8, 128), ("masked", SHORT, 8, 128, False), ("masked", FULL, 8, 128, True)])
    assert other.masked_bucket(PLAIN, 4, 64, True) == (SHORT, 8, 128, False)
    assert other.masked_bucket(PLAIN, 4, 64, False) == (SHORT, 8, 128, False)  # not the lean FULL
    missing_proposal = _masked_runner([("masked", FULL, 8, 128, False)])  # its verify pass alone does not serve
    assert missing_proposal.masked_bucket(FULL, 4, 64, False) == (FULL, 4, 64, False)
    assert missing_proposal.programs.now == [("propose", 4, 64), ("masked", FULL, 4, 64, False)]
    lean_only = _masked_runner([("forward", 8, 128), ("masked", PLAIN, 8, 128, True)])
    assert lean_only.masked_bucket(PLAIN, 4, 64, False) == (PLAIN, 4, 64, False)
    assert lean_only.programs.now == [("forward", 4, 64), ("masked", PLAIN, 4, 64, False)]
