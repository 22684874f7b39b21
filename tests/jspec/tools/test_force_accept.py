"""JSPEC_FORCE_ACCEPT is read by the tools only; the library takes forced acceptance as an argument."""

import pytest

from jspec.tools.force_accept import force_accept_from_env


def test_force_accept_env(monkeypatch):
    monkeypatch.delenv("JSPEC_FORCE_ACCEPT", raising=False)
    assert force_accept_from_env() is None
    monkeypatch.setenv("JSPEC_FORCE_ACCEPT", "3")
    assert force_accept_from_env() == 3
    for bad in ("many", "-1"):
        monkeypatch.setenv("JSPEC_FORCE_ACCEPT", bad)
        with pytest.raises(ValueError, match=f"JSPEC_FORCE_ACCEPT='{bad}'"):
            force_accept_from_env()


def test_the_library_ignores_the_environment(monkeypatch):
    """An environment variable must not change a library call: from_pretrained forces acceptance only when asked."""
    import jspec

    monkeypatch.setenv("JSPEC_FORCE_ACCEPT", "3")
    target = jspec.bundled_model()
    engine = jspec.SpecEngine.from_pretrained(target, drafter="ngram", max_batch_size=1, max_seq_len=64)
    assert engine.setup.force_accept is None
    forced = jspec.SpecEngine.from_pretrained(target, drafter="ngram", max_batch_size=1, max_seq_len=64,
                                              force_accept=2)
    assert forced.setup.force_accept == 2
