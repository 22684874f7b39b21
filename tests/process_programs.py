"""Frees the compiled programs of what tests dropped, in this process."""

from __future__ import annotations

import gc

import jax

from jspec import compiled_programs


def release() -> None:
    """Drops JAX's compilation caches, jspec's shared programs and FastAPI's cached endpoint callables, then
    collects: a stopped server's programs stay mapped while any of them holds on. FastAPI's caches (an
    ``lru_cache`` keyed by each endpoint) keep every app a test served alive, and with it the app's slot engine
    and its programs (some 4,000 mappings for a stopped test server); a server process builds one app, a test
    session dozens. Programs compiled since are compiled again on next use: a module's tests that check nothing
    compiles while serving must not follow a release in that module."""
    from fastapi.dependencies import models

    jax.clear_caches()
    compiled_programs.clear()
    for value in vars(models).values():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()
    gc.collect()
