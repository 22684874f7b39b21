"""Why the test session drops JAX's caches when a process holds many mappings (tests/conftest.py): a process that
keeps compiled XLA:CPU programs alive past ``vm.max_map_count`` dies inside LLVM while compiling the next one.
XLA:CPU maps about three regions per kernel it JIT-compiles; at the stock limit (65,530) this script prints about
80 programs of some 730 mappings each, then LLVM logs "Cannot allocate memory" and the process ends with
SIGSEGV (exit 139), not with a Python error. (Measured with JAX 0.10.2 on x86_64.)

    python -m tests.map_count_reproduction
"""

import jax
import jax.numpy as jnp

from jspec.serve.memory_maps import max_map_count, maps_in_use


def program(i: int):
    def f(x):
        for j in range(120):  # a sort and a reduction per round: many kernels that do not fuse together
            x = jnp.sort(x * (i + j + 1.0))[::-1] + jnp.sum(x) / (j + 2)
        return x
    return jax.jit(f)


def main() -> None:
    x = jnp.arange(64, dtype=jnp.float32)
    kept = []
    for i in range(100_000):
        kept.append(program(i).lower(x).compile())
        if i % 10 == 0:
            print(f"{i} programs kept, {maps_in_use()} mappings of vm.max_map_count={max_map_count()}", flush=True)


if __name__ == "__main__":
    main()
