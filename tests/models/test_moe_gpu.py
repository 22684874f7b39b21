"""On a GPU (skipped elsewhere; scripts/gpu_checks.sh kernels): the experts through tokamax's Triton grouped matmul
equal each expert run on its own rows, and speculation on a mixture-of-experts target equals plain decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.moe import combine
from tests.models.test_moe import MOE, drafters, near_bigram_moe

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("tokens", [2, 64])  # fewer assignments than experts (gathered), and more
def test_tokamax_grouped_experts_equal_a_loop(tokens):
    rng = np.random.default_rng(tokens)
    e, h, i, k = 16, 128, 64, 2
    x = rng.normal(size=(tokens, h)).astype(np.float32)
    experts = rng.integers(0, e, size=(tokens, k)).astype(np.int32)
    weights = rng.uniform(size=(tokens, k)).astype(np.float32)
    gate, up = (rng.normal(size=(e, h, i)) / np.sqrt(h)).astype(np.float32), (rng.normal(size=(e, h, i)) /
                                                                               np.sqrt(h)).astype(np.float32)
    down = (rng.normal(size=(e, i, h)) / np.sqrt(i)).astype(np.float32)
    want = np.zeros_like(x)
    for t in range(tokens):
        for j in range(k):
            g, u = x[t] @ gate[experts[t, j]], x[t] @ up[experts[t, j]]
            want[t] += weights[t, j] * ((g / (1 + np.exp(-g)) * u) @ down[experts[t, j]])
    bf16 = [jnp.asarray(a, jnp.bfloat16) for a in (x, weights)]
    got = jax.jit(combine)(bf16[0], bf16[1], jnp.asarray(experts), *(jnp.asarray(a, jnp.bfloat16)
                                                                     for a in (gate, up, down)))
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0.05, atol=0.05)


def test_speculation_on_a_moe_target_equals_plain_decoding_on_the_gpu():
    import jspec
    from tests import spec_fixtures as fx

    moe_params = near_bigram_moe()
    prompts = [[5, 9, 5, 9, 5, 9, 12], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [7]]
    kwargs = dict(max_batch_size=4, max_seq_len=fx.MAX_SEQ_LEN)
    plain = jspec.SpecEngine(MOE, moe_params, **kwargs).generate(prompts, max_new_tokens=24).token_ids
    drafter, drafter_params = drafters(moe_params)["eagle3-dynamic"]
    out = jspec.SpecEngine(MOE, moe_params, drafter=drafter, drafter_params=drafter_params, **kwargs)
    assert out.generate(prompts, max_new_tokens=24).token_ids == plain
