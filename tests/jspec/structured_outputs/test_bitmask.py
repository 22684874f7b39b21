"""apply_token_bitmask (the device's mask) equal to llguidance's own numpy reference on random bitmasks."""

import numpy as np
from llguidance.numpy import apply_token_bitmask_inplace

from jspec.structured_outputs.bitmask import apply_token_bitmask, bitmask_words


def test_device_mask_equals_llguidance_reference():
    rng = np.random.default_rng(0)
    batch, nodes, vocab = 3, 4, 100  # 100 = 3 whole words and a partial one
    logits = rng.standard_normal((batch, nodes, vocab)).astype(np.float32)
    bitmask = rng.integers(-2**31, 2**31, size=(batch, nodes + 2, bitmask_words(vocab)), dtype=np.int64)
    bitmask = bitmask.astype(np.int32)  # two extra nodes: a pass over the first N nodes reads the first N rows
    expected = logits.reshape(batch * nodes, vocab).copy()
    apply_token_bitmask_inplace(expected, np.ascontiguousarray(bitmask[:, :nodes]).reshape(batch * nodes, -1))
    got = np.asarray(apply_token_bitmask(logits, bitmask))
    np.testing.assert_array_equal(got, expected.reshape(batch, nodes, vocab))
    assert np.isinf(got).any() and np.isfinite(got).any()
    assert apply_token_bitmask(logits, None) is logits
