"""The default KV pool on a device (``ModelRunner.pool_tokens``): ``kv_cache_memory_fraction`` of its memory holds the
weights, the pool and what the largest programs need beside them, read from their compiled memory analysis. Run on
this CPU under a device's memory figures (``device_memory`` replaced): the programs are compiled for the CPU, whose
memory analysis the GPU and TPU compilers' share."""

from __future__ import annotations

import jax
import pytest

from jspec.serve import model_runner
from jspec.serve.block_manager import BlockManager
from jspec.serve.kv_cache_coordinator import KVCacheCoordinator
from jspec.serve.slots import SlotEngine
from tests import spec_fixtures as fx

pytestmark = pytest.mark.aot
LIMIT = 96 << 20  # bytes: a device holding some 2,000 of the tiny model's token slots at most


def weight_bytes(engine) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves((engine.params, engine.drafter_params)))


def total_bytes(compiled) -> int:
    """What one call holds: its arguments (weights, the store, the rows'), new outputs and temporaries."""
    stats = compiled.memory_analysis()
    return (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
            + stats.temp_size_in_bytes)


def test_the_default_pool_leaves_the_largest_programs_their_workspace(monkeypatch):
    engine = fx.spec_engine(fx.near_bigram_target(), fx.random_head(), "chain")
    slots = SlotEngine(engine, max_seq_len=64, adapt=False, block_size=8, max_num_seqs=4, max_logprobs=5)
    runner, weights = slots.runner, weight_bytes(engine)
    monkeypatch.setattr(model_runner, "device_memory", lambda: {"bytes_limit": LIMIT, "bytes_in_use": weights})
    layout, tokens = runner.plan(None)
    runner.allocate(KVCacheCoordinator(BlockManager(layout.num_pages, slots.block_size)))
    budget = slots.kv_cache_memory_fraction * LIMIT
    assert tokens > 1000, tokens
    keys = runner.profiled_keys()
    assert [key[0] for key in keys] == ["step", "prefill", "score"], keys
    held = [total_bytes(runner.lower(key).compile()) for key in keys]
    # every program fits the budget, and the pool takes what the largest leaves (less a page's rounding)
    assert max(held) <= budget, (held, budget)
    assert max(held) > budget - 2 * layout.page_size * layout.bytes_per_token(), (held, budget)
    # the old default pool, the fraction less the weights alone, would have left the programs too little
    per_slot = layout.bytes_per_token()
    old_tokens = int((budget - weights) // per_slot)
    assert max(held) + (old_tokens - tokens) * per_slot > budget

def test_off_a_device_the_pool_is_the_cpu_default():
    assert model_runner.device_memory() is None
