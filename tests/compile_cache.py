"""The test session's persistent compilation cache (set up in tests/conftest.py), switched off where a test checks
the command line's own."""

import contextlib

import jax
import pytest


@contextlib.contextmanager
def session_compile_cache_off():
    """JAX with no persistent compilation cache, in this process and the processes it starts, within the block:
    for the tests of the command line's own cache under $JSPEC_HOME (which leaves a cache the user set up alone)."""
    from jax.experimental.compilation_cache import compilation_cache

    previous = jax.config.jax_compilation_cache_dir
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
        jax.config.update("jax_compilation_cache_dir", None)
        compilation_cache.reset_cache()
        try:
            yield
        finally:
            jax.config.update("jax_compilation_cache_dir", previous)
            compilation_cache.reset_cache()

