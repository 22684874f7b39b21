"""EAGLE-3's training-time test against drafting itself: step j of the unrolled head at index p must compute
what the head computes at depth j + 1 of a chain drafted, with its KV cache, after the real context 0..p."""

import jax
import jax.numpy as jnp
import numpy as np

from jspec.train.eagle3_head import target_features
from jspec.train.ttt import ttt_logits, ttt_loss, ttt_mask
from models.attention import KVCache
from models.eagle3 import Eagle3Head, init_eagle3_params
from models.llama import init_params
from tests.spec_fixtures import HEAD, TARGET

UNROLL, WIDTH = 3, 8


def _setup():
    params_t = init_params(TARGET, jax.random.key(0))
    head = init_eagle3_params(HEAD, jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (2, WIDTH), 0, TARGET.vocab_size)
    features, logits = target_features(params_t, tokens, target=TARGET)
    return params_t, head, tokens, features, logits


def _drafted_chain(head, embedding, tokens, features, root: int, depth: int) -> list[np.ndarray]:
    """Logits of the chain rooted after slot ``root``, drafted as Eagle3Drafter does: the real pairs
    (t_{q+1}, f_q) for q <= root in the cache (positions q), then one node per depth d >= 1 reading
    (t_{root+d+1}, the previous node's pre-norm output) at position root + d."""
    model = Eagle3Head(HEAD)
    batch = tokens.shape[0]
    cache = KVCache.zeros(1, batch, WIDTH + depth, HEAD.layer.num_kv_heads, HEAD.layer.head_dim, jnp.float32)
    context = jnp.take(embedding, tokens[:, 1:root + 2], axis=0)
    positions = jnp.broadcast_to(jnp.arange(root + 1), (batch, root + 1))
    out = model.apply({"params": head}, context, features[:, :root + 1], positions, cache,
                      jnp.zeros((batch,), jnp.int32))
    chain, cache, hidden = [out.logits[:, -1]], out.cache, out.hidden[:, -1:]
    for d in range(1, depth):
        embeds = jnp.take(embedding, tokens[:, root + d + 1:root + d + 2], axis=0)
        out = model.apply({"params": head}, embeds, hidden, jnp.full((batch, 1), root + d), cache,
                          jnp.full((batch,), root + d, jnp.int32))
        chain.append(out.logits[:, 0])
        cache, hidden = out.cache, out.hidden
    return [np.asarray(x) for x in chain]


def test_ttt_steps_equal_drafting_a_chain_with_the_kv_cache():
    params_t, head, tokens, features, _ = _setup()
    embedding = params_t["embed_tokens"]["embedding"]
    logits, inputs = ttt_logits(head, HEAD, embedding, tokens, features, UNROLL)
    checked = 0
    roots = range(0, WIDTH - 1, 2)  # each root is a new shape to compile for the step-by-step reference
    for root in roots:
        depth = min(UNROLL, WIDTH - 1 - root)  # node at depth d reads t_{root+d+1}: it must exist
        for step, want in enumerate(_drafted_chain(head, embedding, tokens, features, root, depth)):
            np.testing.assert_allclose(np.asarray(logits[step][:, root]), want, atol=2e-4, rtol=1e-4,
                                       err_msg=f"root {root}, step {step}")
            np.testing.assert_array_equal(np.asarray(inputs[step][:, root]), np.asarray(tokens[:, root + step + 1]))
            checked += 1
    assert checked == sum(min(UNROLL, WIDTH - 1 - r) for r in roots)


def test_ttt_mask_is_causal_context_plus_own_chain():
    mask = ttt_mask(3, 2, 4)
    np.testing.assert_array_equal(mask[:, :3], np.tril(np.ones((3, 3), bool)))
    for block in (1, 2):
        np.testing.assert_array_equal(mask[:, 3 * block:3 * block + 3], np.eye(3, dtype=bool))
    assert not mask[:, 9:].any()


def test_ttt_loss_weights_steps_by_decay_and_masks_past_the_end():
    params_t, head, tokens, features, target_logits = _setup()
    embedding = params_t["embed_tokens"]["embedding"]
    probs = jax.nn.softmax(target_logits, axis=-1)
    lengths = jnp.array([WIDTH, 7])
    metrics = ttt_loss(head, HEAD, embedding, tokens, features, probs, lengths, unroll=UNROLL, decay=0.8)
    weights = 0.8 ** np.arange(UNROLL)
    np.testing.assert_allclose(float(metrics.loss), np.sum(weights * np.asarray(metrics.step_loss)) / weights.sum(),
                               rtol=1e-6)
    # by hand: step j at index p is valid iff p + j + 1 < length; its label is P_{p+j+1}
    logits, _ = ttt_logits(head, HEAD, embedding, tokens, features, UNROLL)
    for step in range(UNROLL):
        ce, hits, count = 0.0, 0, 0
        for row, length in enumerate((WIDTH, 7)):
            for p in range(WIDTH):
                if p + step + 1 >= length:
                    continue
                label = np.asarray(probs[row, p + step + 1])
                log_q = np.asarray(jax.nn.log_softmax(logits[step][row, p]))
                ce += -np.sum(label * log_q)
                hits += int(np.argmax(log_q) == np.argmax(label))
                count += 1
        np.testing.assert_allclose(float(metrics.step_loss[step]), ce / count, rtol=1e-5)
        np.testing.assert_allclose(float(metrics.accuracy[step]), hits / count, rtol=1e-6)
    # garbage past a row's end changes nothing
    noisy = tokens.at[1, 7:].set(5)
    again = ttt_loss(head, HEAD, embedding, noisy, features, probs.at[1, 7:].set(0.0), lengths, unroll=UNROLL,
                     decay=0.8)
    np.testing.assert_allclose(np.asarray(again.step_loss), np.asarray(metrics.step_loss), rtol=1e-5)
