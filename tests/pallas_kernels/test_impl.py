"""impl="auto" picks a kernel's compiled form only on a backend whose compiler is known to accept it (the aot
tier's list), else its jnp reference, saying so once."""

import logging
import os
import re

import jax
import pytest

from pallas_kernels import impl as impl_module
from pallas_kernels.impl import COMPILED_FORMS, Impl, resolve_impl

KERNELS = ("tree_build", "tree_verify", "tree_attention", "paged_tree_attention")


@pytest.fixture
def backend(monkeypatch):
    def use(name):
        monkeypatch.setattr(jax, "default_backend", lambda: name)
        impl_module._say_reference_once.cache_clear()
    yield use
    impl_module._say_reference_once.cache_clear()


@pytest.mark.parametrize("platform,form", [("tpu", Impl.TPU), ("gpu", Impl.PALLAS)])
def test_auto_runs_every_compiled_form(backend, platform, form):
    backend(platform)
    assert {kernel: resolve_impl("auto", kernel) for kernel in KERNELS} == dict.fromkeys(KERNELS, form)


def test_auto_keeps_the_reference_where_no_form_compiles_and_says_so_once(backend, caplog, monkeypatch):
    backend("gpu")
    monkeypatch.setitem(COMPILED_FORMS, "gpu", frozenset({"tree_attention", "paged_tree_attention"}))
    with caplog.at_level(logging.WARNING, logger="pallas_kernels"):
        assert resolve_impl("auto", "tree_attention") is Impl.PALLAS
        assert resolve_impl("auto", "tree_build") is Impl.REFERENCE
        assert resolve_impl("auto", "tree_build") is Impl.REFERENCE
        assert resolve_impl("auto", "tree_verify") is Impl.REFERENCE
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2 and "tree_build" in lines[0] and "jnp reference" in lines[0], lines
    assert resolve_impl("pallas", "tree_build") is Impl.PALLAS  # a named form is the caller's choice


def test_auto_off_an_accelerator_is_the_reference(backend):
    backend("cpu")
    assert all(resolve_impl("auto", kernel) is Impl.REFERENCE for kernel in KERNELS)


def test_every_form_auto_runs_is_compiled_by_the_aot_tier():
    """COMPILED_FORMS is what tests/aot compiles: each kernel has its compile test there, on a TPU and an H100."""
    text = open(os.path.join(os.path.dirname(__file__), "..", "aot", "test_kernels.py")).read()
    tested = set(re.findall(r"^def test_(\w+)_compiles", text, re.M))
    by_kernel = {"tree_build": {"tree_from_parents", "build_dynamic_tree"},
                 "tree_verify": {"verify_tree_greedy", "verify_tree_sampling"},
                 "tree_attention": {"tree_attention"}, "paged_tree_attention": {"paged_tree_attention"}}
    assert set(by_kernel) == set(KERNELS)
    assert all(by_kernel[kernel] <= tested for forms in COMPILED_FORMS.values() for kernel in forms), tested
    assert re.search(r'^EVERY_CASE = \("v5e", "h100"\)', text, re.M)


def test_a_bad_impl_is_refused_naming_it():
    with pytest.raises(ValueError, match="impl='triton'"):
        resolve_impl("triton", "tree_build")
