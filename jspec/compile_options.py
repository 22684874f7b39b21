"""The XLA options each generation program is compiled with, and the ``jax.jit`` that applies them per setup.

On XLA:CPU, YNNPACK fusions (XLA's default) run the bundled model's one-token matmuls well and its multi-token
ones badly. Measured on this project's 2-core AVX2 CPU (JAX 0.10.2), float32, in-loop ``generate`` on HumanEval
prompts 100 and 103, 128 new tokens, 7 interleaved rounds each, fastest round:

==================================  ==============  ==============
program                             YNN fusions     without
==================================  ==============  ==============
plain decoding (1 token a step)     3.46 / 3.31 ms  4.05 / 3.96 ms  per step
ngram+eagle3 chain of 11 (12 / 8)   12.3 / 11.2 ms  10.7 / 9.7 ms   per step
==================================  ==============  ==============

and seven MLP blocks of its shape alone: 1.08 ms for 1 token either way, 3.1 ms for 12 tokens with them and
1.9-2.1 ms without. So a program that verifies several tokens a step compiles without them, and plain decoding
(and the server's plain steps) with XLA's defaults: each program with the options it runs fastest with, the
baseline included. Other backends get XLA's defaults. ``GenerateSetup.compiler_options`` overrides the choice.

Float32 programs on a GPU or TPU trace under ``jax.default_matmul_precision("highest")``: JAX's default there
may run float32 matmuls at reduced precision (TF32 on NVIDIA GPUs, bf16 passes on TPUs), and a verify pass of
several tokens and a one-token decode step that round differently can pick different greedy tokens, which would
break the float32 promise that speculative output equals plain decoding's. (The test suite sets the same precision
globally, tests/conftest.py; a user's program did not get it.) A CPU computes float32 matmuls in float32 either way.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

# Multi-token programs on XLA:CPU: no YNNPACK fusions (an empty list of fusion kinds).
CPU_MULTI_TOKEN_OPTIONS: dict[str, str] = {"xla_cpu_experimental_ynn_fusion_type": ""}


@functools.cache
def accepted_by_xla(options: tuple[tuple[str, str], ...]) -> bool:
    """Whether this jaxlib's compiler takes ``options`` (an option this version does not know is an error at
    compile time; the engine then keeps XLA's defaults rather than fail)."""
    try:
        jax.jit(lambda x: x + 1, compiler_options=dict(options)).lower(jnp.zeros((), jnp.int32)).compile()
    except Exception:  # noqa: BLE001 - any refusal means: not this version's option
        return False
    return True


def program_options(setup: Any, *, speculate: bool = True) -> dict[str, str]:
    """The XLA options of a program stepping ``setup`` (a ``GenerateSetup``): its own ``compiler_options`` when
    given; else, on a CPU backend, :data:`CPU_MULTI_TOKEN_OPTIONS` for speculative steps (a drafter, speculate)
    and XLA's defaults for one-token steps."""
    if setup.compiler_options is not None:
        return dict(setup.compiler_options)
    if setup.drafter is None or not speculate or _platform(setup) != "cpu":
        return {}
    options = tuple(sorted(CPU_MULTI_TOKEN_OPTIONS.items()))
    return dict(options) if accepted_by_xla(options) else {}


def matmul_precision(setup: Any) -> str | None:
    """The matmul precision a program of ``setup`` traces under: "highest" for float32 off a CPU, else None
    (JAX's default)."""
    return "highest" if setup.dtype == "float32" and _platform(setup) != "cpu" else None


def _platform(setup: Any) -> str:
    if setup.mesh is not None:
        return setup.mesh.devices.flat[0].platform
    return jax.default_backend()


class setup_jit:  # noqa: N801 - used as a decorator, like jax.jit
    """``jax.jit(fun, **jit_kwargs)`` compiled with :func:`program_options` of the call's ``setup=`` (and
    ``speculate=``, where ``fun`` takes it) and traced under its :func:`matmul_precision`: one ``jax.jit`` per
    distinct set of options and precision, each with its own cache.
    Calls and ``.lower`` behave as jax.jit's; called inside another trace it is a plain nested jit (JAX takes
    compiler options at the top level only)."""

    def __init__(self, fun: Callable, **jit_kwargs: Any):
        self._fun, self._jit_kwargs = fun, jit_kwargs
        self._jitted: dict[tuple[tuple[str, str], ...], Any] = {}
        functools.update_wrapper(self, fun)

    def _for(self, args: tuple, kwargs: dict[str, Any]):
        # Inside another trace (a caller's jit or make_jaxpr) the program is the caller's: options are its to set.
        traced = any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(args))
        options = {} if traced else program_options(kwargs["setup"], speculate=kwargs.get("speculate", True))
        precision = None if traced else matmul_precision(kwargs["setup"])
        key = (tuple(sorted(options.items())), precision)
        if key not in self._jitted:
            self._jitted[key] = jax.jit(self._with_precision(precision), compiler_options=options or None,
                                        **self._jit_kwargs)
        return self._jitted[key]

    def _with_precision(self, precision: str | None) -> Callable:
        if precision is None:
            return self._fun

        @functools.wraps(self._fun)
        def traced(*args: Any, **kwargs: Any) -> Any:
            with jax.default_matmul_precision(precision):
                return self._fun(*args, **kwargs)

        return traced

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._for(args, kwargs)(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any):
        return self._for(args, kwargs).lower(*args, **kwargs)
