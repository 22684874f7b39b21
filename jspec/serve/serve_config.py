"""A server's configuration, checked and derived once from ``SlotEngine``'s arguments (vLLM's scheduler and cache
configs in one): the scheduler and the model runner both read it."""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import jax

from jspec.batching import MIN_SEQ_BUCKET, compile_buckets, next_power_of_two, prompt_buckets
from jspec.config import SpecConfig
from jspec.generate_setup import GenerateSetup
from jspec.logprobs import check_num_logprobs
from jspec.serve import paged
from jspec.step import short_draft_nodes

logger = logging.getLogger("jspec.serve")

DEFAULT_BATCHED_TOKENS = 2048  # --max-num-batched-tokens, as vLLM's for online serving
SHORT_MIN_SHARE = 4  # the short program at occupancy buckets of at least max_num_seqs / SHORT_MIN_SHARE rows
PRECOMPILE = ("needed", "all")  # SlotEngine(precompile=...), jspec serve --precompile


def default_async_scheduling() -> bool:
    """On where a device runs the steps beside the host (a GPU or TPU); off on a CPU, whose cores the host's work and
    the steps share, so overlapping them moves no work off the critical path (docs/benchmarks.md measured it)."""
    return jax.default_backend() != "cpu"


def default_short_draft_len(spec: SpecConfig | None) -> int | None:
    """The short program's drafts where none is asked for: a quarter of a chain's (at least one), so its verify
    pass is a few tokens wide; None where the drafter's tree ``spec`` is not a chain of at least two drafts."""
    if spec is None:
        return None
    draft_len = max(1, spec.max_depth // 4)
    return draft_len if short_draft_nodes(spec, draft_len) is not None else None


def checked_short_draft_len(short_draft_len: int | None, spec: SpecConfig | None) -> int | None:
    """``SlotEngine``'s short_draft_len as the drafts its short program verifies (the drafter's tree: ``spec``),
    None for no short program: None picks :func:`default_short_draft_len`, 0 none; else it must cut the chain."""
    if short_draft_len is None:
        return default_short_draft_len(spec)
    if isinstance(short_draft_len, bool) or not isinstance(short_draft_len, int) or short_draft_len < 0:
        raise ValueError(f"short_draft_len={short_draft_len!r}: expected an integer >= 0 (0: no short program)")
    if short_draft_len == 0 or spec is None:
        return None
    if short_draft_nodes(spec, short_draft_len) is None:
        raise ValueError(f"short_draft_len={short_draft_len}: expected 0 or fewer drafts than the drafter's chain "
                         f"(tree {spec.tree!r} of depth {spec.max_depth}; only a chain can be cut)")
    return short_draft_len


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """What :func:`serve_config` checked and derived (its arguments say what each means)."""

    max_seq_len: int
    max_queue: int
    steps_per_chunk: int
    adapt: bool                # load adaptation, with a drafter
    short_draft_len: int | None
    short_nodes: tuple | None  # the short program's tree (``jspec.step.short_draft_nodes``); None: no short program
    num_stop_ids: int          # stop ids per row: max_stop_ids up to a power of two
    block_size: int
    max_total_tokens: int | None
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_memory_fraction: float
    prefix_caching: bool       # enable_prefix_caching, where the drafter continues from a cached prefix
    drop_last_hit: bool        # a prefix hit's last page is computed again (``paged.recomputes_last_hit``)
    row_buckets: tuple[int, ...]
    short_row_buckets: tuple[int, ...]  # the occupancy buckets with a short program
    seq_buckets: tuple[int, ...]
    async_scheduling: bool
    max_prompt_width: int      # max_seq_len - 1: a prompt leaves room for one new token
    widths: tuple[int, ...]    # the prompt width buckets (none wider than a prefill piece)
    piece_width: int | None    # chunked prefill's piece: the widest whole-page width bucket within
                               # max_num_batched_tokens; None: every prompt fits one prefill call
    precompile: str
    warm_up_structured_outputs: bool
    speculative: bool
    eos_token_ids: tuple[int, ...]


def serve_config(engine, *, max_seq_len: int | None = None, max_queue: int = 256, steps_per_chunk: int = 4,
                 adapt: bool = True, short_draft_len: int | None = None, max_stop_ids: int = 8, block_size: int = 16,
                 max_total_tokens: int | None = None, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, kv_cache_memory_fraction: float = 0.9,
                 enable_prefix_caching: bool = True, row_buckets: Sequence[int] | None = None,
                 seq_buckets: Sequence[int] | None = None, async_scheduling: bool | None = None,
                 max_logprobs: int | None = None, logits_processors: bool = False,
                 warm_up_structured_outputs: bool = False, logprobs_mode: str = "raw_logprobs",
                 precompile: str = "needed") -> tuple[ServeConfig, GenerateSetup]:
    """A server's configuration over ``engine`` -> (it, the setup its programs run: the engine's at max_seq_len,
    with the server's log-probabilities and logits processors); ValueError naming the first bad value.

    engine: the offline engine (its weights, drafter and setup are reused as placed); max_seq_len: the longest
    request (prompt + max_tokens), at most the engine's; max_queue: waiting requests before 503; steps_per_chunk:
    K, the steps one chunk runs at most (the streaming and admission granularity); adapt: choose per chunk between
    speculative and plain steps (:mod:`jspec.serve.adapt`); short_draft_len: with adapt, a chain drafter's
    speculative steps may also verify only its first short_draft_len drafts (a third program the adapter
    chooses, for high occupancy; ``default_short_draft_len``), 0: never; max_stop_ids: stop token ids per request (EOS
    included); block_size: token slots per page; max_total_tokens: the KV pool in token slots (default: on a GPU or TPU,
    ``kv_cache_memory_fraction`` of the device memory less what is in use and the largest programs' workspace
    (``ModelRunner.pool_tokens``), over the bytes one slot takes; elsewhere
    ``model_runner.CPU_MAX_TOTAL_TOKENS``); enable_prefix_caching: reuse the pages of committed tokens a request's
    prompt starts with (vLLM's automatic prefix caching; for plain decoding and every drafter that continues from a
    cached prefix, ``paged.continues_from_cache``: all but MTP, for which it is ignored with a warning);
    max_num_seqs: requests running at once (default: the engine's max_batch_size); max_num_batched_tokens: prompt
    tokens prefilled between two chunks (default 2048, as vLLM's): a prompt whose uncached rest is longer is
    prefilled in pieces of whole pages between chunks of the running rows (chunked prefill), except with MTP,
    whose prompts are prefilled whole (at least max_seq_len - 1; default max(2048, that)); row_buckets:
    the occupancy buckets a chunk may step (ascending, the last one max_num_seqs; default: powers of two, then
    max_num_seqs), one compiled chunk program per bucket and step program (vLLM's cudagraph capture sizes play
    this part); async_scheduling: dispatch each chunk before reading the one before back where that wastes
    nothing foreseeable (module docstring; None: ``default_async_scheduling()``);
    seq_buckets: likewise the context lengths a chunk may run at (the last one max_seq_len; default:
    powers of two from 256, then max_seq_len): a chunk runs at the smallest one holding prompt + max_tokens of
    every request in its rows; max_logprobs: None (requests cannot ask for logprobs), or K: every program records
    each committed token's log-probability and the K most likely tokens at its position (``jspec.logprobs``; vLLM's
    ``--max-logprobs``), and a request may ask for up to K; logprobs_mode: vLLM's "raw_logprobs" or
    "processed_logprobs" (``jspec.logprobs.recorded_logits``); logits_processors: requests may use the penalties,
    logit_bias, banned ids and min_tokens (``jspec.logits_processors``: per-row arrays in every program, the
    processing itself skipped in a step where no row uses them). Structured outputs (a request's grammar) run
    their own programs (a step's proposal and its verify pass apart, the host masking the tree between them):
    compiled at the first structured request of a bucket, or in :meth:`warm_up` with warm_up_structured_outputs.
    precompile: "needed" (warm-up compiles the widest buckets and what it runs itself; other buckets compile on
    first use, off the scheduler's thread, while a larger compiled bucket serves their requests; module
    docstring) or "all" (every bucket at warm-up).
    """
    max_seq_len = engine.setup.max_seq_len if max_seq_len is None else max_seq_len
    max_num_seqs = engine.max_batch_size if max_num_seqs is None else max_num_seqs
    chunks_prefill = paged.continues_from_cache(engine.setup)
    if max_num_batched_tokens is None:
        max_num_batched_tokens = DEFAULT_BATCHED_TOKENS if chunks_prefill else max(DEFAULT_BATCHED_TOKENS,
                                                                                   max_seq_len - 1)
    for name, value, low in (("max_queue", max_queue, 0), ("steps_per_chunk", steps_per_chunk, 1),
                             ("max_stop_ids", max_stop_ids, 1), ("block_size", block_size, 1),
                             ("max_num_seqs", max_num_seqs, 1),
                             ("max_total_tokens", 1 if max_total_tokens is None else max_total_tokens, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r}: expected an integer >= {low}")
    if not isinstance(max_seq_len, int) or not 2 <= max_seq_len <= engine.setup.max_seq_len:
        raise ValueError(f"max_seq_len={max_seq_len!r}: expected an integer in [2, "
                         f"{engine.setup.max_seq_len}] (the engine's max_seq_len)")
    # Chunked prefill cuts a prompt into pieces of whole pages; a drafter that recomputes a cached prefix's
    # last page (EAGLE-3) redoes one page per piece, so a piece needs two.
    least = (2 if paged.recomputes_last_hit(engine.setup) else 1) * block_size
    if not chunks_prefill:
        least = max_seq_len - 1  # MTP: a prompt is prefilled whole
    if (not isinstance(max_num_batched_tokens, int) or isinstance(max_num_batched_tokens, bool)
            or max_num_batched_tokens < min(least, max_seq_len - 1)):
        what = ("the longest prompt, max_seq_len - 1: this drafter's prompts are prefilled whole"
                if not chunks_prefill else f"two pages of --block-size {block_size}: a prefill piece"
                if least == 2 * block_size else f"one page of --block-size {block_size}: a prefill piece")
        raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens!r}: expected an integer >= "
                         f"{min(least, max_seq_len - 1)} ({what})")
    if async_scheduling is None:
        async_scheduling = default_async_scheduling()
    if not isinstance(async_scheduling, bool):
        raise ValueError(f"async_scheduling={async_scheduling!r}: expected a bool or None")
    if not 0.0 < kv_cache_memory_fraction <= 1.0:
        raise ValueError(f"kv_cache_memory_fraction={kv_cache_memory_fraction!r}: expected a number in (0, 1]")
    if engine.data_parallel_size != 1:
        raise ValueError(f"data_parallel_size={engine.data_parallel_size}: the server runs one replica; "
                         f"use tensor parallelism (-tp), or one server per data-parallel group")
    check_num_logprobs(max_logprobs, engine.config.vocab_size)
    if precompile not in PRECOMPILE:
        raise ValueError(f"precompile={precompile!r}: expected one of {PRECOMPILE}")
    setup = dataclasses.replace(engine.setup.with_max_seq_len(max_seq_len), logprobs=max_logprobs,
                                logprobs_mode=logprobs_mode, logits_processors=bool(logits_processors))
    num_stop_ids = next_power_of_two(max_stop_ids)
    speculative = setup.drafter is not None
    adapt = adapt and speculative
    short_draft_len = checked_short_draft_len(short_draft_len, setup.spec) if adapt else None
    short_nodes = None if short_draft_len is None else short_draft_nodes(setup.spec, short_draft_len)
    eos_token_ids = tuple(engine.eos_token_ids)
    max_prompt_width = max_seq_len - 1  # a prompt leaves room for one new token
    widths = prompt_buckets(max_prompt_width, half_steps=False)
    # Chunked prefill: an uncached prompt rest longer than max_num_batched_tokens is prefilled in pieces of
    # ``piece_width`` tokens (the widest whole-page width bucket that fits), between chunks of the running
    # rows; None: every prompt fits one prefill call.
    piece_width = None
    if max_num_batched_tokens < max_prompt_width:
        fitting = [w for w in widths if w <= max_num_batched_tokens and w % block_size == 0]
        if not fitting or fitting[-1] < least:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens}: no prefill piece of whole pages "
                             f"(--block-size {block_size}) and at least {least} tokens fits in it")
        piece_width = fitting[-1]
        widths = tuple(w for w in widths if w <= piece_width)
    row_buckets = compile_buckets("row_buckets", row_buckets, first=1, last=max_num_seqs, last_name="max_num_seqs")
    # The short program only where a verify pass is wide enough to cost more than it saves: the busiest
    # buckets (few rows leave a step bound by memory, where the whole chain's pass costs about a plain step).
    short_row_buckets = () if short_nodes is None else tuple(
        rows for rows in row_buckets if SHORT_MIN_SHARE * rows >= max_num_seqs)
    seq_buckets = compile_buckets("seq_buckets", seq_buckets, first=MIN_SEQ_BUCKET, last=max_seq_len,
                                  last_name="max_seq_len")
    prefix_caching = enable_prefix_caching and paged.continues_from_cache(setup)
    drop_last_hit = paged.recomputes_last_hit(setup)
    if enable_prefix_caching and not prefix_caching:
        logger.warning("prefix caching is off: the drafter reads target layers %s and does not continue from a "
                       "cached prefix", setup.drafter.tap_layers)
    config = ServeConfig(max_seq_len=max_seq_len, max_queue=max_queue, steps_per_chunk=steps_per_chunk, adapt=adapt,
                         short_draft_len=short_draft_len, short_nodes=short_nodes, num_stop_ids=num_stop_ids,
                         block_size=block_size, max_total_tokens=max_total_tokens, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens,
                         kv_cache_memory_fraction=kv_cache_memory_fraction, prefix_caching=prefix_caching,
                         drop_last_hit=drop_last_hit, row_buckets=row_buckets, short_row_buckets=short_row_buckets,
                         seq_buckets=seq_buckets, async_scheduling=async_scheduling,
                         max_prompt_width=max_prompt_width, widths=tuple(widths), piece_width=piece_width,
                         precompile=precompile, warm_up_structured_outputs=bool(warm_up_structured_outputs),
                         speculative=speculative, eos_token_ids=eos_token_ids)
    return config, setup
