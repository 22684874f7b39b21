"""Committing a step's tokens (jspec.commit) against a per-sequence numpy loop: stop tokens, the max_new_tokens
budget, done rows, the output buffer and the step statistics."""

import jax.numpy as jnp
import numpy as np
import pytest

from jspec.commit import commit_tokens, count_to_commit
from jspec.state import DecodeState

SENTINEL = -7  # token slots nothing should write


def make_state(tokens, seq_len, num_generated, done, num_steps, accepted_hist) -> DecodeState:
    batch = len(seq_len)
    return DecodeState(tokens=jnp.asarray(tokens, jnp.int32), seq_len=jnp.asarray(seq_len, jnp.int32), cache=None,
                       num_generated=jnp.asarray(num_generated, jnp.int32), done=jnp.asarray(done, bool),
                       num_steps=jnp.asarray(num_steps, jnp.int32),
                       accepted_hist=jnp.asarray(accepted_hist, jnp.int32).reshape(batch, -1),
                       step=jnp.zeros((), jnp.int32))


def commit_reference(state: DecodeState, new_tokens, num_new, max_new_tokens, stop_ids, counts_as_step):
    """One sequence at a time, one token at a time: -> (n, hit_stop, tokens, seq_len, num_generated, done,
    num_steps, accepted_hist) as numpy."""
    tokens, seq_len = np.array(state.tokens), np.array(state.seq_len)
    num_generated, done = np.array(state.num_generated), np.array(state.done)
    num_steps, hist = np.array(state.num_steps), np.array(state.accepted_hist)
    batch = len(seq_len)
    n, hit_stop = np.zeros(batch, np.int32), np.zeros(batch, bool)
    for b in range(batch):
        was_done = done[b]
        stops = {int(s) for s in stop_ids[b] if s >= 0}
        if not was_done:
            for i in range(num_new[b]):
                if num_generated[b] + n[b] >= max_new_tokens[b]:
                    break
                tokens[b, seq_len[b] + n[b]] = new_tokens[b, i]
                n[b] += 1
                if int(new_tokens[b, i]) in stops:
                    hit_stop[b] = True
                    break
        seq_len[b] += n[b]
        num_generated[b] += n[b]
        done[b] = was_done or hit_stop[b] or num_generated[b] >= max_new_tokens[b]
        if counts_as_step and not was_done:
            num_steps[b] += 1
            if n[b] > 0:
                hist[b, n[b] - 1] += 1
    return n, hit_stop, tokens, seq_len, num_generated, done, num_steps, hist


def check_against_reference(state, new_tokens, num_new, max_new_tokens, stop_ids, counts_as_step):
    args = (jnp.asarray(new_tokens, jnp.int32), jnp.asarray(num_new, jnp.int32),
            jnp.asarray(max_new_tokens, jnp.int32), jnp.asarray(stop_ids, jnp.int32))
    want = commit_reference(state, new_tokens, num_new, max_new_tokens, stop_ids, counts_as_step)
    n, hit_stop = count_to_commit(args[0], args[1], state, args[2], args[3])
    np.testing.assert_array_equal(n, want[0])
    np.testing.assert_array_equal(hit_stop, want[1])
    got_state, got_n = commit_tokens(state, *args, counts_as_step=counts_as_step)
    np.testing.assert_array_equal(got_n, want[0])
    for name, value in zip(["tokens", "seq_len", "num_generated", "done", "num_steps", "accepted_hist"], want[2:]):
        np.testing.assert_array_equal(getattr(got_state, name), value, err_msg=name)
    return got_state, got_n


# Hand-picked rows, N = 5 proposed tokens; stop ids {2, 4}; max_new_tokens 10 unless the row says otherwise.
#   (new_tokens, num_new, num_generated, done, max_new_tokens) -> (n, hit_stop, done after)
CASES = [
    ([5, 2, 7, 8, 9], 4, 0, False, 10, 2, True, True),    # stop in the middle: kept, cut after it
    ([5, 6, 7, 2, 9], 3, 0, False, 10, 3, False, False),  # stop beyond num_new: ignored
    ([5, 6, 7, 8, 9], 5, 8, False, 10, 2, False, True),   # budget of 2 cuts
    ([2, 6, 7, 8, 9], 5, 3, True, 10, 0, False, True),    # done: nothing, even a stop token
    ([4, 6, 7, 8, 9], 5, 0, False, 10, 1, True, True),    # stop token first
    ([5, 6, 2, 8, 9], 5, 8, False, 10, 2, False, True),   # budget cuts before the stop token
    ([5, 2, 7, 8, 9], 5, 8, False, 10, 2, True, True),    # stop token is the last the budget allows
    ([5, 6, 4, 2, 9], 5, 0, False, 10, 3, True, True),    # two stops: the first cuts
    ([5, 6, 7, 8, 9], 5, 0, False, 10, 5, False, False),  # all five
    ([5, 6, 7, 8, 9], 1, 9, False, 10, 1, False, True),   # one token fills the budget exactly
]


@pytest.mark.parametrize("counts_as_step", [True, False])
def test_hand_picked_rows(counts_as_step):
    batch, width, slots = len(CASES), 5, 32
    new_tokens = np.array([c[0] for c in CASES], np.int32)
    num_new = np.array([c[1] for c in CASES], np.int32)
    max_new = np.array([c[4] for c in CASES], np.int32)
    stop_ids = np.tile(np.array([[2, 4, -1, -1]], np.int32), (batch, 1))
    seq_len = np.arange(batch, dtype=np.int32) + 3
    tokens = np.full((batch, slots), SENTINEL, np.int32)
    hist = np.arange(batch * width, dtype=np.int32).reshape(batch, width)
    state = make_state(tokens, seq_len, [c[2] for c in CASES], [c[3] for c in CASES], np.full(batch, 4), hist)
    got, n = commit_tokens(state, jnp.asarray(new_tokens), jnp.asarray(num_new), jnp.asarray(max_new),
                           jnp.asarray(stop_ids), counts_as_step=counts_as_step)
    want_n = np.array([c[5] for c in CASES])
    np.testing.assert_array_equal(n, want_n)
    _, hit_stop = count_to_commit(jnp.asarray(new_tokens), jnp.asarray(num_new), state, jnp.asarray(max_new),
                                  jnp.asarray(stop_ids))
    np.testing.assert_array_equal(hit_stop, [c[6] for c in CASES])
    np.testing.assert_array_equal(got.done, [c[7] for c in CASES])
    np.testing.assert_array_equal(got.seq_len, seq_len + want_n)
    np.testing.assert_array_equal(got.num_generated, np.array([c[2] for c in CASES]) + want_n)
    for b in range(batch):  # the first n tokens at seq_len.., nothing else written
        want_row = np.full(slots, SENTINEL)
        want_row[seq_len[b]:seq_len[b] + want_n[b]] = new_tokens[b, :want_n[b]]
        np.testing.assert_array_equal(got.tokens[b], want_row, err_msg=f"row {b}")
    active = ~np.array([c[3] for c in CASES])
    if counts_as_step:  # a step for every row not done before; histogram bucket n - 1 where n > 0
        np.testing.assert_array_equal(got.num_steps, 4 + active)
        want_hist = hist.copy()
        for b in range(batch):
            if active[b] and want_n[b] > 0:
                want_hist[b, want_n[b] - 1] += 1
        np.testing.assert_array_equal(got.accepted_hist, want_hist)
    else:
        np.testing.assert_array_equal(got.num_steps, np.full(batch, 4))
        np.testing.assert_array_equal(got.accepted_hist, hist)
    check_against_reference(state, new_tokens, num_new, max_new, stop_ids, counts_as_step)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("counts_as_step", [True, False])
def test_random_rows_match_reference(seed, counts_as_step):
    """Many random rows at once: a small vocabulary so that stop tokens are frequent, budgets near the end."""
    rng = np.random.default_rng(seed)
    batch, width, slots, vocab = 256, 1 + seed, 24, 6
    new_tokens = rng.integers(0, vocab, (batch, width))
    num_new = rng.integers(0, width + 1, batch)
    max_new = rng.integers(1, 12, batch)
    done = rng.random(batch) < 0.2
    num_generated = np.where(done, rng.integers(0, 12, batch), rng.integers(0, max_new + 1))
    stop_ids = np.where(rng.random((batch, 3)) < 0.4, -1, rng.integers(0, vocab, (batch, 3)))
    seq_len = rng.integers(1, slots - width + 1, batch)
    tokens = np.full((batch, slots), SENTINEL)
    state = make_state(tokens, seq_len, num_generated, done, rng.integers(0, 5, batch),
                       rng.integers(0, 5, (batch, width)))
    got, n = check_against_reference(state, new_tokens, num_new, max_new, stop_ids, counts_as_step)
    # the random rows hit every branch
    assert np.any(got.done & ~state.done & (n < num_new))       # cut by a stop token or the budget
    assert np.any(~got.done & (n == num_new) & (n > 0))          # committed everything
    assert np.any(np.asarray(state.done) & np.any(new_tokens[:, :, None] == stop_ids[:, None], axis=(1, 2)))
