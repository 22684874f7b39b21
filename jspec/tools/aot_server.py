"""The server's paged step programs (``jspec.serve.paged``) compiled ahead of time for a TPU or GPU deployment this
machine does not have (``jspec.tools.aot``), over the KV pool ``jspec serve`` would allocate there.

    program = compile_server_step(DEPLOYMENTS["llama3-8b/v5e-1/int8"], "eagle3-chain", variant="logprobs")
    program.memory_bytes_per_device, program.hbm_bytes_per_device

Variants, as the scheduler runs them (``jspec.serve.model_runner``):
- "step": a chunk of ``steps_per_chunk`` steps over a bucket of rows, the API features' leaves untouched (the form
  it runs while no running request asks for log-probabilities or logits processors);
- "logprobs": the same chunk keeping ``num_logprobs`` top log-probabilities a position (``--max-logprobs``);
- "structured": one step under the rows' grammar masks, in two programs: a plain server's target pass then its
  draw under the root's mask, a speculative server's proposal then its verification under a mask a tree node.

The pool: as a server sizes it on a GPU or TPU (``ModelRunner.pool_tokens``), ``kv_cache_memory_fraction`` of the
chip's HBM less the weights one device holds and the program's workspace (its temporaries and new outputs, compiled
once over a pool of one request), over the bytes a token slot takes in every pool (split over tensor parallelism).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jspec.serve import kv_store, paged
from jspec.serve.block_manager import pages_for
from jspec.serve.model_runner import workspace_of
from jspec.sharding import per_device_bytes
from jspec.structured_outputs.bitmask import bitmask_words
from jspec.tools.aot import chip_figures, compile_for
from jspec.tools.aot_programs import Deployment, placed_engine

VARIANTS = ("step", "logprobs", "structured")
NUM_STOP_IDS = 8  # serve_config's default max_stop_ids, a power of two


@dataclasses.dataclass
class ServerProgram:
    """One of the server's step programs compiled for a deployment, with the pool it runs over (token slots) and
    what one device holds: its compiled programs' arguments (weights, the store), outputs and temporaries, the
    largest of them where the variant is two programs."""

    deployment: Deployment
    method: str
    variant: str
    rows: int
    seq_len: int
    pool_tokens: int
    workspace_bytes_per_device: int | None  # what sized the pool (None: the pool was given)
    programs: list  # Compiled, in the order the scheduler calls them
    weight_bytes_per_device: int
    memory_bytes_per_device: int
    hbm_bytes_per_device: int


def _memory_bytes(compiled) -> int:
    stats = compiled.memory_analysis()
    return (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
            + stats.temp_size_in_bytes)


def compile_server_step(deployment: Deployment, method: str, variant: str = "step", rows: int = 8,
                        seq_len: int = 2048, block_size: int = 16, steps_per_chunk: int = 4, num_logprobs: int = 5,
                        max_total_tokens: int | None = None, kv_cache_memory_fraction: float = 0.9) -> ServerProgram:
    """``method`` (``jspec.tools.aot_programs.METHODS``) served on ``deployment``: the ``variant`` (:data:`VARIANTS`)
    of its step program over a bucket of ``rows`` rows at a ``seq_len`` context, pages of ``block_size`` slots,
    compiled for the chip; ``max_total_tokens``: the pool (None: as the server sizes it there)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}: expected one of {VARIANTS}")
    engine = placed_engine(deployment, method, seq_len)
    setup = dataclasses.replace(engine.setup, logprobs=num_logprobs if variant == "logprobs" else None)
    params = (engine.params_t, engine.params_d)
    chips = deployment.chips
    layout = kv_store.paged_layout(*params, setup=setup, num_stop_ids=NUM_STOP_IDS, page_size=block_size,
                                   num_pages=2, max_rows=rows)
    hbm = chip_figures(deployment.chip)["hbm_bytes"]
    compile_at = functools.partial(_compile_programs, setup=setup, params=params, layout=layout, devices=engine.devices,
                                   variant=variant, rows=rows, seq_len=seq_len, steps_per_chunk=steps_per_chunk)
    least, workspace = layout.pages_per_row * block_size, None
    if max_total_tokens is None:  # as ModelRunner.pool_tokens: less the workspace measured over a pool of one request
        workspace = max(workspace_of(program, engine.weight_bytes_per_device + per_device_bytes(store))
                        for program, store in compile_at(least))
        free = kv_cache_memory_fraction * hbm - engine.weight_bytes_per_device - workspace
        per_slot = sum(layout.bytes_per_token(kv_split=chips, group=group) for group in range(layout.num_groups))
        max_total_tokens = (int(free // per_slot) // block_size - 1) * block_size
    if max_total_tokens < least:
        raise ValueError(f"{deployment.name}: a pool of {max_total_tokens} token slots cannot hold one request of "
                         f"{seq_len} (the weights leave too little of the chip's HBM)")
    programs = [program for program, _ in compile_at(max_total_tokens)]
    return ServerProgram(deployment, method, variant, rows, seq_len, max_total_tokens, workspace, programs,
                         engine.weight_bytes_per_device, max(map(_memory_bytes, programs)), hbm)


def _compile_programs(pool_tokens: int, *, setup, params, layout, devices, variant: str, rows: int, seq_len: int,
                      steps_per_chunk: int) -> list[tuple[Any, Any]]:
    """The variant's programs over a pool of ``pool_tokens`` slots -> [(Compiled, the store's shapes)]."""
    num_pages = 1 + pages_for(pool_tokens, layout.page_size)
    # A binding window's pool as large as the full one: the most the server gives it (ModelRunner.window_pool_pages).
    layout = dataclasses.replace(layout, num_pages=num_pages, window_pages=num_pages if layout.window else 0)
    store = kv_store.store_shapes(*params, layout, setup=setup, num_stop_ids=NUM_STOP_IDS)
    rows_args = [jax.ShapeDtypeStruct((rows,), jnp.int32),  # row ids, then their page table
                 jax.ShapeDtypeStruct((rows, layout.num_groups, layout.pages_per_row), jnp.int32)]
    cancel = jax.ShapeDtypeStruct((rows,), jnp.bool_)
    words = bitmask_words(setup.target.vocab_size)
    if variant != "structured":
        step = functools.partial(paged.step_rows, layout=layout, setup=setup, seq_len=seq_len,
                                 write_pages=paged.write_pages(layout, setup, steps_per_chunk),
                                 chunk_steps=steps_per_chunk, api_features=variant != "step")
        args = [*params, store, *rows_args, cancel, jax.ShapeDtypeStruct((), jnp.int32)]
        return [(compile_for(step, args, devices, donate_argnums=(2,)), store)]
    # A structured step's two halves (ModelRunner.masked_step): a plain server's target pass then its draw under the
    # root's mask; a speculative server's proposal then its verification under a mask a tree node.
    if setup.drafter is None:
        first = functools.partial(paged.forward_rows, layout=layout, setup=setup, seq_len=seq_len)
        second, donated = paged.sample_rows, (2,)
    else:
        first = functools.partial(paged.propose_rows, layout=layout, setup=setup, seq_len=seq_len)
        second, donated = paged.verify_rows, ()
    first_half = compile_for(first, [*params, store, *rows_args], devices, donate_argnums=donated)
    outputs = jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                           jax.eval_shape(first, *params, store, *rows_args), first_half.output_shardings)
    handed = [outputs[1]] if setup.drafter is None else list(outputs)  # the forward's store goes on as the store
    nodes = 1 if setup.drafter is None else outputs[1].tokens.shape[1]
    second = functools.partial(second, layout=layout, setup=setup, seq_len=seq_len,
                               write_pages=paged.write_pages(layout, setup, 1))
    bitmask = jax.ShapeDtypeStruct((rows, nodes, words), jnp.int32)
    return [(first_half, store), (compile_for(second, [*params, store, *rows_args, cancel, *handed, bitmask], devices,
                                              donate_argnums=(2,)), store)]


def describe(program: ServerProgram) -> dict[str, Any]:
    """A row of the table: the pool, what one device holds against its HBM."""
    return {"deployment": program.deployment.name, "method": program.method, "variant": program.variant,
            "rows": program.rows, "seq_len": program.seq_len, "pool_tokens": program.pool_tokens,
            "workspace_bytes_per_device": program.workspace_bytes_per_device,
            "programs": len(program.programs), "weight_bytes_per_device": program.weight_bytes_per_device,
            "memory_bytes_per_device": program.memory_bytes_per_device,
            "hbm_bytes_per_device": program.hbm_bytes_per_device,
            "fits": program.memory_bytes_per_device <= program.hbm_bytes_per_device}
