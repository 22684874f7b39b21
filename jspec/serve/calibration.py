"""The model runner's warm-up and calibration: every compiled program run once before serving, and the timed chunks
the cost table is measured from (``jspec.serve.adapt.measure_costs``), over rows of a calibration prompt the runner
admits and frees itself. ``runner``: a :class:`jspec.serve.model_runner.ModelRunner` (its programs, store, page
tables and block manager)."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jspec.batching import prompt_bucket
from jspec.config import SamplingParams
from jspec.serve.adapt import TimedChunk
from jspec.serve.plans import PrefillPlan

Runner = Any  # a jspec.serve.model_runner.ModelRunner (which imports this module)


def first_runs(runner: Runner, prompt: list[int]) -> None:
    """Runs every compiled program once before serving (but the cost table's): on a CPU the first run of a
    program costs several times the next ones (its buffers and kernels are set up then), which would fall on
    the first requests of each bucket. Prefills run on padding rows; each step program runs one step over rows
    of ``prompt`` as the cost table's, so its loop body, both sides of its verify and sampling paths, and the
    drafter's run."""
    for key in runner.programs.keys():
        if key[0] in ("prefill", "prefill_cached"):
            runner.store, out = runner.programs[key](runner.engine.params, runner.engine.drafter_params, runner.store,
                                                   *runner.example(key))
            jax.block_until_ready(out)
    # With load adaptation the cost table's warm runs are the first runs at the longest context.
    for seq_len in runner.seq_buckets[:-1] if runner.adapt else runner.seq_buckets:
        chunk = calibration_chunks(runner, prompt, rotate=True, seq_len=seq_len)
        for program, rows in runner.step_programs():
            if ("step", program, rows, seq_len) in runner.programs:
                chunk(program, rows, 1, True)
        chunk.release()


def calibration_budget(runner: Runner, seq_len: int) -> int:
    """New tokens a calibration row may take at context ``seq_len``: three chunks at full acceptance."""
    return max(1, min(seq_len // 2, 3 * runner.steps_per_chunk * runner.setup.tokens_per_step))


def calibration_width(runner: Runner, prompt: Sequence[int], seq_len: int) -> int:
    """The prompt width bucket of :func:`calibration_chunks` at context ``seq_len``."""
    length = min(len(prompt), seq_len - calibration_budget(runner, seq_len), runner.widths[-1])
    return prompt_bucket(length, runner.max_prompt_width, half_steps=False)


def calibration_chunks(runner: Runner, prompt: Sequence[int], rotate: bool = False,
                       seq_len: int | None = None) -> Callable[[str, int, int, bool], TimedChunk]:
    """The timed chunks ``adapt.measure_costs`` calls: each runs one chunk at context ``seq_len`` (default: the
    longest bucket; a verify pass's cost grows with the context more than a plain step's) over ``rows`` rows
    admitted with ``prompt`` (greedy, a budget of three chunks at full acceptance): those of the chunk before
    where it had as many rows, as sampled, and their budget holds this chunk's steps, else admitted afresh.
    ``.release()`` frees the rows and their pages, after the last chunk; with ``sampled``, row 0 samples
    (temperature 0.8). With ``rotate``, row r > 0 gets the prompt rotated by 37 r tokens and row 0 distinct
    random tokens, which no lookup drafter matches: under load some row always drafts with the drafter's model
    and some row always needs the whole verify pass, and a step costs what its costliest row makes it
    (``jspec.step``'s and the hybrid drafter's ``lax.cond`` skip work only where every row can)."""
    seq_len = runner.seq_buckets[-1] if seq_len is None else seq_len
    budget = calibration_budget(runner, seq_len)
    prompt = list(prompt)[:min(seq_len - budget, runner.widths[-1])]  # a chunked-prefill server has no wider
    vocab = runner.engine.config.vocab_size
    unmatched = np.random.default_rng(0).permutation(vocab)[:len(prompt)].tolist() if len(prompt) <= vocab \
        else prompt
    width = prompt_bucket(len(prompt), runner.max_prompt_width, half_steps=False)
    params = SamplingParams(max_new_tokens=budget)
    drawn = SamplingParams(max_new_tokens=budget, temperature=0.8)

    def text(row: int) -> list[int]:
        if not rotate:
            return prompt
        if row == 0:
            return unmatched
        turn = (37 * row) % len(prompt)
        return prompt[turn:] + prompt[:turn]

    held: list[tuple[int, list[int], list[int] | None]] = []  # the rows admitted last, their pages in each group
    admitted = {"as": None, "steps_left": 0}  # (rows, sampled) they were admitted for, full steps left

    def release() -> None:
        for row, pages, window_pages in held:
            runner.blocks.free(pages, window_pages)
            runner.clear_table(row)
        held.clear()
        admitted["as"] = None

    def admit(rows: int, sampled: bool) -> None:
        release()
        for row in range(rows):
            slots = runner.lookahead(len(prompt), len(prompt) + budget)
            allocation = runner.blocks.allocate([], slots)
            if allocation is None:
                break
            if not runner.blocks.advance(allocation.pages, allocation.window_pages, len(prompt) - 1, slots):
                runner.blocks.free(allocation.pages, allocation.window_pages)
                break
            held.append((row, allocation.pages, allocation.window_pages))
            runner.set_table(row, allocation.pages, allocation.window_pages)
        for part in runner.prefill_parts("prefill", [row for row, _, _ in held], width):
            runner.prefill(PrefillPlan(tuple((text(row), drawn if sampled and row == 0 else params) for row in part),
                                     width, tuple(part)))
        admitted.update({"as": (rows, sampled), "steps_left": 3 * runner.steps_per_chunk})

    def timed_chunk(program: str, rows: int, steps: int, sampled: bool) -> TimedChunk:
        # Rows admitted for the same occupancy and sampling run chunks until their budget (three chunks at
        # full acceptance) could run out: one prefill serves several programs' chunks.
        if admitted["as"] != (rows, sampled) or admitted["steps_left"] < steps:
            admit(rows, sampled)
        admitted["steps_left"] -= steps
        arrays = runner.step_arrays([], rows)
        ids = np.full((rows,), runner.layout.null_row, np.int32)
        ids[:len(held)] = [row for row, _, _ in held]
        arrays = (runner.place(ids), runner.place(runner.tables[ids]), arrays[2])
        jax.block_until_ready(runner.store)
        start = time.perf_counter()
        out = runner.run_step(program, rows, seq_len, arrays, steps)
        out = jax.device_get(out)
        seconds = time.perf_counter() - start
        ran = runner.steps_ran(out.step)
        gained = int(out.num_generated[:len(held)].sum()) - len(held)
        return TimedChunk(seconds, ran, gained, int(out.num_steps[:len(held)].sum()),
                          tuple(int(n) for n in out.accepted_hist[:len(held)].sum(axis=0)))

    timed_chunk.release = release
    return timed_chunk
