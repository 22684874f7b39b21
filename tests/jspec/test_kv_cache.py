"""Committing the accepted path's K/V (jspec.kv_cache.commit_path) against a numpy loop over rows and path nodes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.kv_cache import commit_path
from models.attention import KVCache


def random_paths(rng, batch: int, num_nodes: int, width: int) -> np.ndarray:
    """i32[B, width]: root 0, then increasing node ids in [1, num_nodes), -1 padded. Row 0 accepts nothing,
    row 1 a full path ending at the last node; the rest are random."""
    paths = np.full((batch, width), -1, np.int32)
    paths[:, 0] = 0
    for b in range(batch):
        if b == 0:
            accepted = []
        elif b == 1:
            accepted = list(range(num_nodes - width + 1, num_nodes))
        else:
            count = rng.integers(0, width)
            accepted = sorted(rng.choice(np.arange(1, num_nodes), size=count, replace=False))
        paths[b, 1:1 + len(accepted)] = accepted
    return paths


def random_cache(rng, layers: int, batch: int, slots: int, heads: int, dim: int, filled: np.ndarray) -> KVCache:
    """Per layer; slots past filled[b] hold NaN so that reading them shows."""
    def one():
        x = rng.normal(size=(batch, slots, heads, dim)).astype(np.float32)
        x[np.arange(slots)[None, :] >= filled[:, None]] = np.nan
        return jnp.asarray(x)
    return KVCache(tuple(one() for _ in range(layers)), tuple(one() for _ in range(layers)))


@pytest.mark.parametrize("layers, batch, slots, num_nodes, width", [(1, 3, 17, 4, 3), (2, 6, 40, 9, 4),
                                                                     (3, 5, 33, 16, 6)])
def test_commit_path_matches_numpy_loop(layers, batch, slots, num_nodes, width):
    rng = np.random.default_rng(slots)
    cache_len = rng.integers(0, slots - num_nodes + 1, batch).astype(np.int32)
    cache_len[0], cache_len[-1] = 0, slots - num_nodes  # first slot, last room
    paths = random_paths(rng, batch, num_nodes, width)
    cache = random_cache(rng, layers, batch, slots, 2, 4, filled=cache_len + num_nodes)
    got = jax.jit(commit_path)(cache, jnp.asarray(paths), jnp.asarray(cache_len))
    assert got.per_layer and len(got.k) == len(got.v) == layers
    for before, after in zip(cache.k + cache.v, got.k + got.v):
        before, after = np.asarray(before), np.asarray(after)
        assert after.shape == before.shape
        for b in range(batch):
            path = [node for node in paths[b] if node >= 0]
            start = cache_len[b]
            np.testing.assert_array_equal(after[b, :start], before[b, :start])  # committed: untouched
            for i, node in enumerate(path):  # path node i now at slot cache_len + i
                np.testing.assert_array_equal(after[b, start + i], before[b, start + node])
            np.testing.assert_array_equal(after[b, start + width:], before[b, start + width:])  # NaN stays


def test_stacked_cache_is_refused():
    cache = KVCache.zeros(2, 1, 8, 1, 4, jnp.float32)
    with pytest.raises(ValueError, match="per-layer"):
        commit_path(cache, jnp.zeros((1, 2), jnp.int32), jnp.zeros((1,), jnp.int32))
