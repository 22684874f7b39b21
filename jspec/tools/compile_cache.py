"""JAX's persistent compilation cache for the command line, under ``$JSPEC_HOME/compile-cache``: a second identical
call loads its compiled programs instead of compiling them again."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

def jspec_home() -> str:
    """$JSPEC_HOME, default ~/.cache/jspec: the command line's compile cache and demo model live there."""
    return os.environ.get("JSPEC_HOME", os.path.join(os.path.expanduser("~"), ".cache", "jspec"))


def compile_cache_dir() -> str:
    return os.path.join(jspec_home(), "compile-cache")


# Every program is cached however fast it compiled or small it is: on CPU most take well under JAX's default
# threshold of 1 s each, and they add up to several seconds per call.
_CACHE_SETTINGS = {"jax_persistent_cache_min_compile_time_secs": 0.0,
                   "jax_persistent_cache_min_entry_size_bytes": -1}


@contextlib.contextmanager
def persistent_compile_cache(directory: str | None) -> Iterator[None]:
    """Within this block JAX reads and writes compiled programs under ``directory`` (None: leaves JAX as it is).

    A cache directory the user gave JAX (JAX_COMPILATION_CACHE_DIR) is left as it is, with JAX's own settings.
    The previous settings are restored afterwards, so that ``main`` called in-process leaves no cache switched on.
    """
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    if directory is None or jax.config.jax_compilation_cache_dir is not None:
        yield
        return
    settings = {"jax_compilation_cache_dir": directory, **_CACHE_SETTINGS}
    previous = {name: getattr(jax.config, name) for name in settings}
    for name, value in settings.items():
        jax.config.update(name, value)
    try:
        yield
    finally:
        for name, value in previous.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()  # JAX keeps the cache it opened on the first compile until reset
