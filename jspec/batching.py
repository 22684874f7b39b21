"""Host-side batching: validate prompts, pad them into buckets (powers of two, and for prompt widths 1.5 times one
too), and cut the outputs back out.

Buckets keep the number of compilations small: batch is padded to the next power of two (at most
max_batch_size), prompt width to the next power of two or 1.5 times one (at least 16, at most max_seq_len: the
prefill's cost grows with the padded width, and half-steps cap the padding at a third instead of a half; the
bundled model's HumanEval prompts of 129 to 186 tokens prefill at 192 instead of 256), the stop-id list to
the next power of two, and the sequence buffers (token slots, KV cache) to the next power of two that holds
prompt width + max_new_tokens (at most max_seq_len): attention reads the whole cache buffer, so a request
for 100 tokens must not pay for max_seq_len = 2048. Padding rows are finished after their first token and cost
only masked compute.

The server pads its prompts with the same :func:`prompt_bucket` (compiling one admission per width of
:func:`prompt_buckets`), and steps its slots at occupancy and context buckets from :func:`compile_buckets`.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from jspec.config import check_token_ids

MIN_PROMPT_BUCKET = 16
MIN_SEQ_BUCKET = 256  # the server's shortest context: below it, a shorter one saves less than its programs cost


def next_power_of_two(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def prompt_bucket(n: int, max_width: int, *, half_steps: bool = True) -> int:
    """The padded width of a prompt of n tokens: the smallest power of two, or (``half_steps``) 1.5 times a power
    of two, that is >= max(n, MIN_PROMPT_BUCKET); at most max_width. The engine compiles a width when a call first
    needs it, so it pads less at half steps; the server compiles every width at start-up, so it takes powers of
    two only (half as many programs)."""
    power = next_power_of_two(n, MIN_PROMPT_BUCKET)
    half_step = 3 * power // 4
    return min(half_step if half_steps and half_step >= max(n, MIN_PROMPT_BUCKET) else power, max_width)


def prompt_buckets(max_width: int, *, half_steps: bool = True) -> tuple[int, ...]:
    """Every width :func:`prompt_bucket` pads a prompt of 1 to max_width tokens to, ascending."""
    widths = [prompt_bucket(1, max_width, half_steps=half_steps)]
    while widths[-1] < max_width:
        widths.append(prompt_bucket(widths[-1] + 1, max_width, half_steps=half_steps))
    return tuple(widths)


def compile_buckets(name: str, given: Sequence[int] | None, *, first: int, last: int,
                    last_name: str) -> tuple[int, ...]:
    """Sizes a server compiles one program for each of (occupancy, context length): ``given`` checked (ascending
    integers ending at ``last``, named ``last_name`` in the message), or the default: powers of two from ``first``
    below ``last``, then ``last``."""
    if given is None:
        buckets, size = [], first
        while size < last:
            buckets.append(size)
            size *= 2
        return tuple(buckets) + (last,)
    buckets = tuple(given)
    if (not buckets or list(buckets) != sorted(set(buckets)) or buckets[-1] != last or buckets[0] < 1
            or any(not isinstance(b, int) for b in buckets)):
        raise ValueError(f"{name}={given!r}: expected ascending integers ending at {last_name}={last}")
    return buckets


class PaddedBatch(NamedTuple):
    prompt_ids: np.ndarray      # i32[B_bucket, P_bucket] right-padded with 0
    prompt_lens: np.ndarray     # i32[B_bucket]
    max_new_tokens: np.ndarray  # i32[B_bucket]
    stop_ids: np.ndarray        # i32[B_bucket, K_bucket] padded with -1
    batch_size: int             # real rows
    seq_len: int                # S_bucket: token slots per sequence this request needs, bucketed


def validate_prompts(prompts: Sequence[Sequence[int]], *, vocab_size: int, max_batch_size: int,
                     max_seq_len: int, max_new_tokens: int) -> None:
    """Raises ValueError naming the first bad value: batch size, empty prompt, bad id, too long a prompt."""
    if len(prompts) == 0:
        raise ValueError("prompts is empty: expected at least one prompt")
    if len(prompts) > max_batch_size:
        raise ValueError(f"batch of {len(prompts)} prompts exceeds max_batch_size={max_batch_size}")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty: expected at least one token")
        check_token_ids(prompt, vocab_size, f"prompt {i}")
        if len(prompt) + max_new_tokens > max_seq_len:
            raise ValueError(f"prompt {i} has {len(prompt)} tokens; with max_new_tokens={max_new_tokens} that "
                             f"exceeds max_seq_len={max_seq_len}")


def pad_batch(prompts: Sequence[Sequence[int]], *, max_new_tokens: int, stop_ids: Sequence[int],
              max_batch_size: int, max_seq_len: int, row_multiple: int = 1) -> PaddedBatch:
    """Right-pads validated prompts into bucketed arrays (see the module docstring); the rows are a multiple of
    ``row_multiple`` (the data-parallel size: every data shard gets as many rows)."""
    batch = len(prompts)
    rows = min(next_power_of_two(batch), max_batch_size)
    rows = -(-rows // row_multiple) * row_multiple
    width = prompt_bucket(max(len(p) for p in prompts), max_seq_len)
    prompt_ids = np.zeros((rows, width), np.int32)
    prompt_lens = np.ones((rows,), np.int32)
    for i, prompt in enumerate(prompts):
        prompt_ids[i, :len(prompt)] = prompt
        prompt_lens[i] = len(prompt)
    new_tokens = np.ones((rows,), np.int32)  # padding rows stop after their first token
    new_tokens[:batch] = max_new_tokens
    unique_stop = sorted(set(int(t) for t in stop_ids))
    stops = np.full((rows, next_power_of_two(len(unique_stop))), -1, np.int32)
    stops[:, :len(unique_stop)] = unique_stop
    seq_len = min(next_power_of_two(width + max_new_tokens), max_seq_len)
    return PaddedBatch(prompt_ids, prompt_lens, new_tokens, stops, batch, seq_len)


def unpad_outputs(tokens: np.ndarray, prompt_lens: np.ndarray, num_generated: np.ndarray,
                  batch_size: int) -> list[list[int]]:
    """The new tokens of each real row: tokens[b, prompt_len : prompt_len + num_generated]."""
    return [tokens[b, prompt_lens[b]:prompt_lens[b] + num_generated[b]].tolist() for b in range(batch_size)]
