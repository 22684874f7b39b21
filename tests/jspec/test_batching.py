"""Host-side batching (jspec.batching): bucket sizes by brute force, padding values, pad -> unpad round trip, and
validation messages that name the bad value."""

import numpy as np
import pytest

from jspec.batching import pad_batch, prompt_bucket, prompt_buckets, unpad_outputs, validate_prompts


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum), by counting up."""
    size = 1
    while size < max(n, minimum):
        size *= 2
    return size


def width_bucket(n: int, minimum: int = 16) -> int:
    """The smallest of 16, 24, 32, 48, 64, 96, ... (powers of two and 1.5 times them) >= max(n, minimum), by
    counting up."""
    sizes = sorted({2 ** k for k in range(1, 16)} | {3 * 2 ** k for k in range(1, 15)})
    return next(size for size in sizes if size >= max(n, minimum))


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 100, length).tolist() for length in lengths]


@pytest.mark.parametrize("lengths, max_new_tokens, stop_ids, max_batch_size, max_seq_len", [
    ([1], 1, [], 8, 64),
    ([3], 5, [2], 8, 64),
    ([15, 1], 16, [7, 2, 7], 8, 64),
    ([16, 3, 1], 20, [0, 1, 2, 3, 4], 4, 128),
    ([17, 1, 3, 15, 16], 10, [9], 8, 2048),
    ([127, 3], 128, [5, 6, 7], 2, 2048),
    ([513], 100, [1, 2], 8, 2048),
    ([513, 127, 17], 50, [3], 3, 600),      # prompt and sequence buckets capped at max_seq_len (not a power of 2)
    ([17], 10, [], 1, 27),                  # prompt bucket 24 (a half-step), sequence bucket 64 capped at 27
    ([25], 2, [], 1, 27),                   # prompt bucket 32 capped at 27 = 25 + 2
    ([129, 186, 100], 128, [2], 4, 2048),   # 192: HumanEval prompts of the bundled model
])
def test_pad_batch_buckets_and_padding(lengths, max_new_tokens, stop_ids, max_batch_size, max_seq_len):
    prompts = prompts_of(lengths)
    validate_prompts(prompts, vocab_size=100, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                     max_new_tokens=max_new_tokens)
    padded = pad_batch(prompts, max_new_tokens=max_new_tokens, stop_ids=stop_ids, max_batch_size=max_batch_size,
                       max_seq_len=max_seq_len)
    rows = min(bucket(len(prompts)), max_batch_size)
    width = min(width_bucket(max(lengths)), max_seq_len)
    unique_stops = sorted(set(stop_ids))
    assert padded.batch_size == len(prompts)
    assert padded.prompt_ids.shape == (rows, width) and padded.prompt_ids.dtype == np.int32
    assert padded.seq_len == min(bucket(width + max_new_tokens), max_seq_len)
    assert padded.stop_ids.shape == (rows, bucket(len(unique_stops)))
    for b in range(rows):
        if b < len(prompts):
            want = prompts[b] + [0] * (width - lengths[b])
            want_len, want_new = lengths[b], max_new_tokens
        else:  # padding row: one token of prompt 0, finished after its first token
            want, want_len, want_new = [0] * width, 1, 1
        np.testing.assert_array_equal(padded.prompt_ids[b], want, err_msg=f"row {b}")
        assert padded.prompt_lens[b] == want_len and padded.max_new_tokens[b] == want_new, f"row {b}"
        # every row stops on the same ids, once each, -1 padded to the bucket
        stops = padded.stop_ids[b]
        np.testing.assert_array_equal(stops, unique_stops + [-1] * (len(stops) - len(unique_stops)))


@pytest.mark.parametrize("lengths", [[1], [3, 17, 1], [127, 16, 15, 513, 1]])
def test_pad_then_unpad_returns_the_generated_tokens(lengths):
    rng = np.random.default_rng(len(lengths))
    prompts = prompts_of(lengths, seed=1)
    max_new_tokens = 9
    padded = pad_batch(prompts, max_new_tokens=max_new_tokens, stop_ids=[5], max_batch_size=8, max_seq_len=1024)
    rows, width = padded.prompt_ids.shape
    # what generate returns: prompt, then num_generated new tokens, then whatever the loop left behind
    tokens = np.full((rows, padded.seq_len), -3, np.int32)
    tokens[:, :width] = padded.prompt_ids
    generated = [rng.integers(100, 200, rng.integers(0, max_new_tokens + 1)).tolist() for _ in range(rows)]
    num_generated = np.array([len(g) for g in generated], np.int32)
    for b in range(rows):
        start = padded.prompt_lens[b]
        tokens[b, start:start + len(generated[b])] = generated[b]
    out = unpad_outputs(tokens, padded.prompt_lens, num_generated, padded.batch_size)
    assert out == generated[:len(prompts)]
    assert all(isinstance(t, int) for row in out for t in row)


def test_unpad_outputs_by_hand():
    tokens = np.array([[1, 2, 3, 4, 5, 6],
                       [7, 8, 9, 10, 11, 12],
                       [0, 0, 0, 0, 0, 0]])
    assert unpad_outputs(tokens, np.array([2, 1, 1]), np.array([3, 0, 4]), 2) == [[3, 4, 5], []]


LIMITS = {"vocab_size": 100, "max_batch_size": 4, "max_seq_len": 16, "max_new_tokens": 6}


def test_validate_accepts_the_boundaries():
    validate_prompts([[0, 99] + [1] * 8, [5], [1], [2]], **LIMITS)  # 10 + 6 = max_seq_len; ids 0 and vocab - 1


@pytest.mark.parametrize("prompts, message", [
    ([], "prompts is empty"),
    ([[1]] * 5, "batch of 5 prompts exceeds max_batch_size=4"),
    ([[1], []], "prompt 1 is empty"),
    ([[1], [2], [1.5, 2.0]], "prompt 2 holds float64 values"),
    ([[1, 100]], r"prompt 0 has token id 100, outside the vocabulary \[0, 100\)"),
    ([[3], [4, -1, 7]], r"prompt 1 has token id -1, outside the vocabulary \[0, 100\)"),
    ([[1], [1] * 11], "prompt 1 has 11 tokens; with max_new_tokens=6 that exceeds max_seq_len=16"),
])
def test_validate_names_the_bad_value(prompts, message):
    with pytest.raises(ValueError, match=message):
        validate_prompts(prompts, **LIMITS)


def test_prompt_buckets_at_half_steps_for_the_engine_and_powers_of_two_for_the_server():
    assert prompt_buckets(256) == (16, 24, 32, 48, 64, 96, 128, 192, 256)
    assert prompt_buckets(256, half_steps=False) == (16, 32, 64, 128, 256)
    assert prompt_buckets(200, half_steps=False) == (16, 32, 64, 128, 200)
    for n in (1, 16, 17, 25, 33, 129, 186, 193, 256):
        assert prompt_bucket(n, 256) in prompt_buckets(256) and prompt_bucket(n, 256) >= n
        assert prompt_bucket(n, 256, half_steps=False) in prompt_buckets(256, half_steps=False)
    assert prompt_bucket(186, 1024) == 192 and prompt_bucket(186, 1024, half_steps=False) == 256
