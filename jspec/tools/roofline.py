"""Roofline benchmark on random weights of real model shapes: decode step time against the memory floor.

    python -m jspec.tools.roofline --synthetic llama3-8b,llama3-1b --out DIR [--budget-seconds 480]
    python -m jspec.tools.roofline --synthetic tiny --synthetic-batches 1      # CPU smoke run

For each shape (``SHAPES``): random bf16 target weights and a random EAGLE-3 head of matching shape (the shapes
of the models' own init functions, drawn by one jitted call, so they are created on the device: 16 GB of
Llama-3-8B weights never touch host memory). Then, for each batch size, through the public ``SpecEngine`` API,
greedy, random prompts of ``prompt_len`` tokens:

- plain decoding (drafter=None), and EAGLE-3 with a chain and a dynamic (EAGLE-2) tree, each forced to accept
  exactly k drafts per step (``force_accept=k``, the JSPEC_FORCE_ACCEPT knob; a compile per k);
- step time: ``t(max_new_tokens=N) - t(max_new_tokens=1)`` (the second call is prefill only) divided by the
  verify steps the N-token call took, N = 1 + steps * (k + 1) so every row times ``steps`` loop iterations and
  every call lands in the same sequence bucket (2 * prompt_len). Median of ``repeats`` pairs after a warm-up.
- memory floor per step (seconds) = bytes read per step / measured device copy bandwidth, where bytes =
  target weights (the embedding table only when it is also the LM head: otherwise one row per token is
  gathered) + target KV at the mean context (2 * layers * batch * mean_context * kv_heads * head_dim * itemsize)
  + for speculative steps, per drafter forward: the head's weights (fc only in the one forward that reads
  target features) and its one-layer KV.

The random head's lm_head is sharpened (``HEAD_SHARPEN``): an untrained head is near-uniform over its draft
vocabulary, so the best cumulative scores of an EAGLE-2 tree sit at the shallow depths and its first-child path
may be shorter than the forced k (on the tiny shape it stops at depth 2 of 3). Sharpened, each draft's top-1 is
near-certain, as in a trained head, and the path is ``num_steps`` deep. Costs do not depend on the values: every
shape is static. ``forced_acceptance_reached`` in each row checks it.

Order and budget: configurations run by priority tier across all requested shapes (plain decoding and each
tree's deepest k at the two smallest batches, then at the larger ones, then each tree's k = 0, then the chain's
other k, then the dynamic tree's; see ``_tier``). A configuration whose estimated cost (the largest one of the
same shape and method so far) no longer fits the budget is skipped and listed under ``skipped``. Out-of-memory
and other failures are recorded per row, never raised. ``synthetic_<name>.json`` is rewritten after every row,
so a killed run leaves its results.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import logging
import os
import statistics
import sys
import time
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec.config import SpecConfig
from jspec.drafters.eagle3 import Eagle3Drafter
from jspec.engine import SpecEngine
from models.checkpoint import DTYPES
from models.config import ModelConfig, from_hf_config
from models.eagle3 import Eagle3Config, eagle3_config_from_hf, init_eagle3_params
from models.llama import init_params

PLAIN, CHAIN, DYNAMIC = "plain", "eagle3-chain", "eagle3-dynamic"
METHODS = (PLAIN, CHAIN, DYNAMIC)
HEAD_SHARPEN = 64.0
DEFAULT_BUDGET_SECONDS = 480.0


def _llama3_rope(factor: float) -> dict:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


@dataclasses.dataclass(frozen=True)
class SyntheticShape:
    """One benchmarked model: HF-style config dicts of the target and its EAGLE-3 head, and the run's shape.

    prompt_len: P, a power of two (sequence bucket 2P holds every call); steps: loop iterations each timed call
    runs; chain, dynamic: the two speculative configurations.
    """

    description: str
    target_hf: dict
    head_hf: dict
    prompt_len: int
    steps: int
    chain: SpecConfig
    dynamic: SpecConfig
    dtype: str = "bfloat16"

    def spec(self, method: str) -> SpecConfig | None:
        return {PLAIN: None, CHAIN: self.chain, DYNAMIC: self.dynamic}[method]

    def new_tokens(self, tokens_per_step: int) -> int:
        """N for a call that runs ``steps`` iterations committing ``tokens_per_step`` tokens each."""
        return 1 + self.steps * tokens_per_step

    def __post_init__(self):
        if self.prompt_len & (self.prompt_len - 1):
            raise ValueError(f"prompt_len={self.prompt_len}: expected a power of two")
        deepest = max(self.chain.max_depth, self.dynamic.max_depth)
        if self.new_tokens(deepest + 1) > self.prompt_len:
            raise ValueError(f"steps={self.steps} x {deepest + 1} tokens overflow the sequence bucket "
                             f"2 * prompt_len={2 * self.prompt_len}")


SHAPES: dict[str, SyntheticShape] = {
    "llama3-8b": SyntheticShape(
        description="Llama-3.1-8B shapes; EAGLE-3 head as yuhuili/EAGLE3-LLaMA3.1-Instruct-8B (draft vocab 32000)",
        target_hf=dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_llama3_rope(8.0),
                       max_position_embeddings=131072, tie_word_embeddings=False),
        head_hf=dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                     vocab_size=128256, draft_vocab_size=32000, rms_norm_eps=1e-5, rope_theta=500000.0),
        prompt_len=512, steps=32,
        chain=SpecConfig(tree="chain", num_steps=4),
        dynamic=SpecConfig(tree="dynamic", num_steps=6, topk=8, num_draft_tokens=32)),
    "llama3-1b": SyntheticShape(
        description="Llama-3.2-1B shapes (tied embeddings); EAGLE-3 head of matching shape (draft vocab 32000)",
        target_hf=dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                       num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                       rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_llama3_rope(32.0),
                       max_position_embeddings=131072, tie_word_embeddings=True),
        head_hf=dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=64, vocab_size=128256, draft_vocab_size=32000, rms_norm_eps=1e-5,
                     rope_theta=500000.0),
        prompt_len=512, steps=32,
        chain=SpecConfig(tree="chain", num_steps=4),
        dynamic=SpecConfig(tree="dynamic", num_steps=6, topk=8, num_draft_tokens=32)),
    # 3 layers, not 2: EAGLE-3 taps layers (2, L//2, L-3), which needs L >= 3.
    "tiny": SyntheticShape(
        description="tiny CPU smoke shapes (3 layers, hidden 64, vocab 256; head draft vocab 128)",
        target_hf=dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
        head_hf=dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=256, draft_vocab_size=128),
        prompt_len=128, steps=24,
        chain=SpecConfig(tree="chain", num_steps=3),
        dynamic=SpecConfig(tree="dynamic", num_steps=3, topk=3, num_draft_tokens=8)),
}


# --- models on the device ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SyntheticModels:
    """A shape's configs and its random params, already on the device."""

    name: str
    shape: SyntheticShape
    target: ModelConfig
    head: Eagle3Config
    params_t: Any
    params_d: Any  # {"head": ..., "d2t": i32[V_draft]}


def _random_leaf(key: jax.Array, leaf: jax.ShapeDtypeStruct) -> jax.Array:
    """Vectors (norm weights) 1; matrices [..., fan_in, fan_out] uniform with variance 1 / fan_in."""
    if len(leaf.shape) < 2:
        return jnp.ones(leaf.shape, leaf.dtype)
    limit = (3.0 / leaf.shape[-2]) ** 0.5
    return jax.random.uniform(key, leaf.shape, leaf.dtype, -limit, limit)


def random_params(abstract: Any, seed: int) -> Any:
    """Params of the shapes in ``abstract`` (jax.ShapeDtypeStruct leaves), drawn on the device by one jitted
    call. Uniform draws from XLA's bit generator ("rbg" keys) compile in a fraction of the time that normal
    draws from threefry, or the models' own init functions, take (seconds per model on a CPU)."""
    leaves, treedef = jax.tree.flatten(abstract)

    def make(key):
        keys = jax.random.split(key, len(leaves))
        return treedef.unflatten([_random_leaf(k, leaf) for k, leaf in zip(keys, leaves)])

    return jax.jit(make)(jax.random.key(seed, impl="rbg"))


def abstract_params(target: ModelConfig, head: Eagle3Config, dtype: str) -> dict:
    """{"target": ..., "head": ...}: the shapes ``models.llama.init_params`` and ``init_eagle3_params`` make."""
    key = jax.random.key(0)
    return {"target": jax.eval_shape(functools.partial(init_params, target, dtype=DTYPES[dtype]), key),
            "head": jax.eval_shape(functools.partial(init_eagle3_params, head, dtype=DTYPES[dtype]), key)}


def sharpened(head: dict, sharpen: float) -> dict:
    """The head with its lm_head scaled by ``sharpen`` (on the device)."""
    kernel = head["lm_head"]["kernel"]
    return {**head, "lm_head": {**head["lm_head"], "kernel": kernel * jnp.asarray(sharpen, kernel.dtype)}}


def build_models(name: str, seed: int = 0) -> SyntheticModels:
    """The configs of ``SHAPES[name]`` and random params on the device; d2t is the identity map."""
    shape = SHAPES[name]
    target = from_hf_config(shape.target_hf)
    head = eagle3_config_from_hf(shape.head_hf)
    params = random_params(abstract_params(target, head, shape.dtype), seed)
    d2t = jnp.zeros((head.draft_vocab_size,), jnp.int32)  # target id = draft id + 0
    params_d = {"head": sharpened(params["head"], HEAD_SHARPEN), "d2t": d2t}
    jax.block_until_ready((params["target"], params_d))
    return SyntheticModels(name, shape, target, head, params["target"], params_d)


# --- bytes and bandwidth -------------------------------------------------------------------------------------

def tree_bytes(tree: Any) -> int:
    return int(sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree)))


def target_weight_bytes(config: ModelConfig, params_t: Any) -> int:
    """Bytes of target weights one forward reads: all of them, less the embedding table unless it is tied
    (an untied embedding is gathered one row per token)."""
    total = tree_bytes(params_t)
    return total if config.tie_word_embeddings else total - tree_bytes(params_t["embed_tokens"])


def kv_bytes(config: ModelConfig, batch: int, context: float, itemsize: int) -> float:
    """K and V bytes of ``context`` tokens in every layer: 2 * layers * batch * context * kv_heads * head_dim."""
    return 2.0 * config.num_layers * batch * context * config.num_kv_heads * config.head_dim * itemsize


def drafter_forwards(spec: SpecConfig) -> int:
    """Head forwards per step: max_depth - 1 while drafting (the deepest nodes draft nothing) + 1 extend."""
    return spec.max_depth


def floor_bytes(models: SyntheticModels, method: str, batch: int, context: float) -> dict[str, float]:
    """Bytes one decode step must read from device memory (see the module docstring), by part."""
    itemsize = jnp.dtype(DTYPES[models.shape.dtype]).itemsize
    parts = {"target_weights": float(target_weight_bytes(models.target, models.params_t)),
             "target_kv": kv_bytes(models.target, batch, context, itemsize),
             "drafter_weights": 0.0, "drafter_kv": 0.0}
    spec = models.shape.spec(method)
    if spec is not None:
        head = models.params_d["head"]
        forwards = drafter_forwards(spec)
        fc = tree_bytes(head["fc"])
        parts["drafter_weights"] = float(forwards * (tree_bytes(head) - fc) + fc)
        parts["drafter_kv"] = forwards * kv_bytes(models.head.layer, batch, context, itemsize)
    parts["total"] = sum(parts.values())
    return parts


def measure_copy_bandwidth(num_bytes: int, iterations: int = 20, repeats: int = 5) -> tuple[float, list[float]]:
    """Device copy bandwidth: bytes read + written per second by an elementwise pass over a bf16 array of
    ``num_bytes`` -> (median bytes/s, seconds per pass). Each timing is ``iterations`` separate calls queued
    back to back (dispatch overlaps the device's work; separate calls cannot be fused into one pass)."""
    x = jnp.zeros((num_bytes // 2,), jnp.bfloat16)
    one_pass = jax.jit(lambda a: a + jnp.ones((), a.dtype))
    jax.block_until_ready(one_pass(x))
    per_pass = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iterations):
            out = one_pass(x)  # the previous output is freed once its pass is done
        jax.block_until_ready(out)
        per_pass.append((time.perf_counter() - start) / iterations)
    return 2 * x.nbytes / statistics.median(per_pass), per_pass


def default_copy_bytes() -> int:
    return (16 << 20) if jax.default_backend() == "cpu" else (1 << 30)


# --- the plan ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RowPlan:
    """One configuration to time; ``tier`` orders the work (lower first)."""

    model: str
    batch: int
    method: str
    force_accept: int | None
    tier: int

    def key(self) -> dict:
        return {"batch": self.batch, "method": self.method, "force_accept": self.force_accept}


def accept_counts(spec: SpecConfig, force_accepts: Sequence[int] | None) -> list[int]:
    """The forced acceptances timed for ``spec``: 0..max_depth, or the requested ones that fit the depth."""
    depth = spec.max_depth
    wanted = range(depth + 1) if force_accepts is None else force_accepts
    return sorted({k for k in wanted if 0 <= k <= depth})


def _tier(method: str, k: int | None, counts: Sequence[int], batch_rank: int) -> int:
    """0: plain and each tree's deepest k at the two smallest batches; 1: the same at larger batches;
    2: each tree's smallest k; 3: the chain's other k; 4: the dynamic tree's other k.

    A step's cost does not depend on k (static shapes), so the deepest k of each tree already gives its step
    time; the other k re-measure it at other acceptance lengths."""
    batch_tier = 0 if batch_rank < 2 else 1
    if method == PLAIN or k == counts[-1]:
        return batch_tier
    if k == counts[0]:
        return 2
    return 3 if method == CHAIN else 4


def plan_rows(models: Sequence[SyntheticModels], batches: Sequence[int], force_accepts: Sequence[int] | None,
              methods: Sequence[str] = METHODS) -> list[RowPlan]:
    """Every configuration of ``methods``, highest priority first: by tier, then batch, model, method, k."""
    batches = sorted(set(batches))
    plans = []
    for model_rank, m in enumerate(models):
        for batch_rank, batch in enumerate(batches):
            if PLAIN in methods:
                plans.append((RowPlan(m.name, batch, PLAIN, None, _tier(PLAIN, None, (), batch_rank)), model_rank))
            for method in (CHAIN, DYNAMIC):
                if method not in methods:
                    continue
                counts = accept_counts(m.shape.spec(method), force_accepts)
                for k in counts:
                    plans.append((RowPlan(m.name, batch, method, k, _tier(method, k, counts, batch_rank)),
                                  model_rank))
    plans.sort(key=lambda p: (p[0].tier, p[0].batch, p[1], METHODS.index(p[0].method), p[0].force_accept or 0))
    return [plan for plan, _ in plans]


# --- timing one configuration --------------------------------------------------------------------------------

def make_engine(models: SyntheticModels, plan: RowPlan) -> SpecEngine:
    """An engine whose one sequence bucket (2 * prompt_len) holds every call of the row."""
    shape, seq_len = models.shape, 2 * models.shape.prompt_len
    spec = shape.spec(plan.method)
    if spec is None:
        return SpecEngine(models.target, models.params_t, max_batch_size=plan.batch, max_seq_len=seq_len,
                          dtype=shape.dtype)
    drafter = Eagle3Drafter(models.head, models.target, spec, seq_len, shape.dtype)
    return SpecEngine(models.target, models.params_t, drafter=drafter, drafter_params=models.params_d,
                      max_batch_size=plan.batch, max_seq_len=seq_len, dtype=shape.dtype,
                      force_accept=plan.force_accept)


def random_prompts(vocab_size: int, batch: int, length: int, seed: int) -> list[list[int]]:
    return np.random.default_rng(seed).integers(0, vocab_size, (batch, length)).tolist()


def time_steps(engine: SpecEngine, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    """Warm-up (compiles) then ``repeats`` pairs of (prefill-only call, N-token call) -> timings in seconds.

    step_seconds = (median t_N - median t_1) / loop iterations of the N-token call."""
    warm = engine.generate(prompts, max_new_tokens=new_tokens)
    prefill_runs, full_runs, out = [], [], warm
    for _ in range(repeats):
        prefill_runs.append(engine.generate(prompts, max_new_tokens=1).stats.run_seconds)
        out = engine.generate(prompts, max_new_tokens=new_tokens)
        full_runs.append(out.stats.run_seconds)
    steps = out.stats.num_verify_steps / len(prompts)  # every row takes the same steps: lockstep acceptance
    prefill_s, full_s = statistics.median(prefill_runs), statistics.median(full_runs)
    return {"compile_seconds": warm.stats.compile_seconds, "prefill_seconds": prefill_s,
            "total_seconds": full_s, "prefill_runs": prefill_runs, "total_runs": full_runs,
            "verify_steps": steps, "acceptance_length": out.stats.acceptance_length,
            "step_seconds": (full_s - prefill_s) / steps if steps else float("nan")}


def is_out_of_memory(error: BaseException) -> bool:
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def measure_row(models: SyntheticModels, plan: RowPlan, repeats: int, seed: int) -> dict:
    """Times one configuration -> its JSON row (status "ok", "oom" or "error"; never raises an Exception)."""
    shape = models.shape
    spec = shape.spec(plan.method)
    expected = 1 if spec is None else plan.force_accept + 1
    new_tokens = shape.new_tokens(expected)
    row = {**plan.key(), "tier": plan.tier, "new_tokens": new_tokens, "status": "ok", "error": None}
    start = time.perf_counter()
    try:
        engine = make_engine(models, plan)
        prompts = random_prompts(models.target.vocab_size, plan.batch, shape.prompt_len, seed)
        row.update(time_steps(engine, prompts, new_tokens, repeats))
    except Exception as error:  # noqa: BLE001 -- one failed configuration must not end the benchmark
        row["status"] = "oom" if is_out_of_memory(error) else "error"
        row["error"] = f"{type(error).__name__}: {str(error)[:2000]}"
    row["wall_seconds"] = time.perf_counter() - start
    if row["status"] == "ok":
        row["forced_acceptance_reached"] = abs(row["acceptance_length"] - expected) < 1e-6
        row["mean_context"] = shape.prompt_len + row["acceptance_length"] * (row["verify_steps"] - 1) / 2
        row["drafter_forwards_per_step"] = 0 if spec is None else drafter_forwards(spec)
        row["floor_bytes"] = floor_bytes(models, plan.method, plan.batch, row["mean_context"])
        row["tokens_per_second"] = plan.batch * row["acceptance_length"] / row["step_seconds"]
    return row


def add_ratios(rows: list[dict], bandwidth: float) -> None:
    """Fills floor_seconds, step_over_floor, spec_over_plain_step, tokens_per_second_over_plain in place."""
    plain = {r["batch"]: r for r in rows if r["method"] == PLAIN and r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            continue
        r["floor_seconds"] = r["floor_bytes"]["total"] / bandwidth
        r["step_over_floor"] = r["step_seconds"] / r["floor_seconds"]
        base = plain.get(r["batch"])
        r["spec_over_plain_step"] = None if base is None else r["step_seconds"] / base["step_seconds"]
        r["tokens_per_second_over_plain"] = (None if base is None
                                             else r["tokens_per_second"] / base["tokens_per_second"])


# --- reports -------------------------------------------------------------------------------------------------

def new_report(models: SyntheticModels, bandwidth: float, copy_runs: list[float], copy_bytes: int,
               batches: Sequence[int], repeats: int, budget_seconds: float) -> dict:
    shape = models.shape
    return {
        "name": models.name, "description": shape.description, "platform": jax.default_backend(),
        "device": jax.devices()[0].device_kind, "jax_version": jax.__version__, "dtype": shape.dtype,
        "target_config": models.target.to_json_dict(), "eagle3_config": dataclasses.asdict(models.head),
        "head_sharpen": HEAD_SHARPEN,
        "specs": {CHAIN: dataclasses.asdict(shape.chain), DYNAMIC: dataclasses.asdict(shape.dynamic)},
        "target_param_bytes": tree_bytes(models.params_t),
        "target_weight_bytes_per_forward": target_weight_bytes(models.target, models.params_t),
        "eagle3_param_bytes": tree_bytes(models.params_d["head"]),
        "copy_bandwidth_bytes_per_second": bandwidth, "copy_seconds_per_pass": copy_runs,
        "copy_bytes": copy_bytes, "prompt_len": shape.prompt_len, "sequence_bucket": 2 * shape.prompt_len,
        "steps_per_call": shape.steps, "repeats": repeats, "batches": sorted(set(batches)),
        "budget_seconds": budget_seconds, "elapsed_seconds": 0.0, "complete": False,
        "rows": [], "skipped": [],
    }


def write_json(report: dict, out_dir: str | None) -> str | None:
    """Writes ``synthetic_<name>.json`` atomically (a kill never leaves half a file) -> its path."""
    if out_dir is None:
        return None
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"synthetic_{report['name']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=2)
    os.replace(path + ".tmp", path)
    return path


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


TABLE_COLUMNS = ("batch", "method", "k", "accept", "step ms", "floor ms", "step/floor", "step/plain", "tok/s",
                 "tok/s /plain", "compile s", "status")


def table_rows(report: dict) -> list[tuple[str, ...]]:
    """One tuple of cells per row, sorted by (batch, method, k)."""
    lines = []
    order = sorted(report["rows"], key=lambda r: (r["batch"], METHODS.index(r["method"]), r["force_accept"] or 0))
    for r in order:
        k = "-" if r["force_accept"] is None else str(r["force_accept"])
        if r["status"] != "ok":
            lines.append((str(r["batch"]), r["method"], k) + ("",) * 8 + (r["status"],))
            continue
        lines.append((str(r["batch"]), r["method"], k, f"{r['acceptance_length']:.2f}",
                      f"{1e3 * r['step_seconds']:.2f}", f"{1e3 * r['floor_seconds']:.2f}",
                      f"{r['step_over_floor']:.2f}", _fmt(r["spec_over_plain_step"], ".2f"),
                      f"{r['tokens_per_second']:.0f}", _fmt(r["tokens_per_second_over_plain"], ".2f"),
                      f"{r['compile_seconds']:.1f}", "ok" if r["forced_acceptance_reached"] else "ok*"))
    return lines


def table_title(report: dict) -> str:
    return (f"{report['name']} on {report['device']} ({report['platform']}): copy bandwidth "
            f"{report['copy_bandwidth_bytes_per_second'] / 1e9:.0f} GB/s, prompt {report['prompt_len']}, "
            f"{report['elapsed_seconds']:.0f} s, {len(report['skipped'])} skipped")


def format_table(report: dict) -> str:
    """Plain-text table of a report (ok* = acceptance differed from the forced k + 1)."""
    rows = [TABLE_COLUMNS] + table_rows(report)
    widths = [max(len(row[i]) for row in rows) for i in range(len(TABLE_COLUMNS))]
    lines = [table_title(report)]
    for n, row in enumerate(rows):
        lines.append("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
        if n == 0:
            lines.append("-" * len(lines[-1]))
    return "\n".join(lines)


def print_table(report: dict) -> None:
    """A rich table on a terminal (when rich is installed), else the plain-text one (logs keep every digit)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None
    if Console is None or not sys.stdout.isatty():
        print(format_table(report), flush=True)
        return
    table = Table(title=table_title(report))
    for column in TABLE_COLUMNS:
        table.add_column(column, justify="left" if column == "method" else "right")
    for row in table_rows(report):
        table.add_row(*row)
    Console().print(table)


# --- the run -------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _quiet_engine_warnings() -> Iterator[None]:
    """Every forced-acceptance engine warns that its output is not the target's; once is enough here."""
    logger = logging.getLogger("jspec")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


class Budget:
    """Decides which configurations still start: within the wall-clock budget, and not at a batch that already
    ran out of memory for the same shape and method at a batch no larger."""

    def __init__(self, seconds: float):
        self.seconds, self.start = seconds, time.perf_counter()
        self._cost: dict[tuple[str, str], tuple[float, int]] = {}  # (model, method) -> (max wall, max batch)
        self._oom_batch: dict[tuple[str, str], int] = {}  # (model, method) -> smallest batch out of memory

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def estimate(self, plan: RowPlan) -> float:
        """The costliest configuration of this model and method so far (x1.5 for a larger batch); else of
        this model; 0 when nothing was timed yet."""
        seen = self._cost.get((plan.model, plan.method))
        if seen is None:
            same_model = [wall for (model, _), (wall, _) in self._cost.items() if model == plan.model]
            return max(same_model, default=0.0)
        wall, batch = seen
        return wall * (1.5 if plan.batch > batch else 1.0)

    def skip_reason(self, plan: RowPlan) -> str | None:
        oom_batch = self._oom_batch.get((plan.model, plan.method))
        if oom_batch is not None and plan.batch >= oom_batch:
            return f"out of memory at batch {oom_batch}"
        estimate = self.estimate(plan)
        if self.elapsed + estimate > self.seconds:
            return f"budget: {self.elapsed:.0f} s of {self.seconds:.0f} s elapsed, ~{estimate:.0f} s needed"
        return None

    def record(self, plan: RowPlan, row: dict) -> None:
        key = (plan.model, plan.method)
        wall_max, batch_max = self._cost.get(key, (0.0, 0))
        self._cost[key] = (max(wall_max, row["wall_seconds"]), max(batch_max, plan.batch))
        if row["status"] == "oom":
            self._oom_batch[key] = min(plan.batch, self._oom_batch.get(key, plan.batch))


def run_synthetic_models(names: Sequence[str], out_dir: str | None = None,
                         budget_seconds: float = DEFAULT_BUDGET_SECONDS, batches: Sequence[int] = (1, 8, 32),
                         force_accepts: Sequence[int] | None = None, repeats: int = 3, seed: int = 0,
                         copy_bytes: int | None = None, show: bool = True,
                         methods: Sequence[str] = METHODS) -> dict[str, dict]:
    """Benchmarks several shapes under one budget, interleaved by priority -> {name: report}.

    force_accepts: the k to time for each tree (None: 0..max_depth of each); copy_bytes: size of the
    bandwidth probe's array (None: 1 GiB on an accelerator, 16 MiB on CPU); methods: a subset of ``METHODS``
    (ratios to plain decoding need "plain").
    """
    unknown = [n for n in names if n not in SHAPES]
    if unknown or not names:
        raise ValueError(f"synthetic shapes {list(names)!r}: expected names from {sorted(SHAPES)}")
    if not methods or any(m not in METHODS for m in methods):
        raise ValueError(f"methods={methods!r}: expected a non-empty subset of {METHODS}")
    budget = Budget(budget_seconds)
    copy_bytes = copy_bytes or default_copy_bytes()
    bandwidth, copy_runs = measure_copy_bandwidth(copy_bytes)
    models = [build_models(name, seed) for name in names]
    reports = {m.name: new_report(m, bandwidth, copy_runs, copy_bytes, batches, repeats, budget_seconds)
               for m in models}
    by_name = {m.name: m for m in models}
    with _quiet_engine_warnings():
        for plan in plan_rows(models, batches, force_accepts, methods):
            report = reports[plan.model]
            reason = budget.skip_reason(plan)
            if reason is not None:
                report["skipped"].append({**plan.key(), "reason": reason})
            else:
                row = measure_row(by_name[plan.model], plan, repeats, seed)
                budget.record(plan, row)
                report["rows"].append(row)
                add_ratios(report["rows"], bandwidth)
                if show:
                    _print_progress(plan.model, row)
            report["elapsed_seconds"] = budget.elapsed
            write_json(report, out_dir)
    for report in reports.values():
        report["complete"] = True
        report["elapsed_seconds"] = budget.elapsed
        write_json(report, out_dir)
        if show:
            print_table(report)
    return reports


def _print_progress(model: str, row: dict) -> None:
    what = f"{model} batch {row['batch']} {row['method']} k={row['force_accept']}"
    if row["status"] != "ok":
        print(f"{what}: {row['status']} {row['error'][:200]}", flush=True)
        return
    print(f"{what}: step {1e3 * row['step_seconds']:.2f} ms ({row['step_over_floor']:.2f}x floor), accept "
          f"{row['acceptance_length']:.2f}, compile {row['compile_seconds']:.1f} s, wall {row['wall_seconds']:.1f} s",
          flush=True)


def run_synthetic(name: str, out_dir: str | None = None, budget_seconds: float = DEFAULT_BUDGET_SECONDS,
                  batches: Sequence[int] = (1, 8, 32), force_accepts: Sequence[int] | None = None,
                  repeats: int = 3, seed: int = 0, copy_bytes: int | None = None, show: bool = True,
                  methods: Sequence[str] = METHODS) -> dict:
    """Benchmarks one shape (``SHAPES``) -> its report, also written to ``out_dir/synthetic_<name>.json``."""
    return run_synthetic_models([name], out_dir, budget_seconds, batches, force_accepts, repeats, seed,
                                copy_bytes, show, methods)[name]


# --- command line --------------------------------------------------------------------------------------------

def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None


def add_synthetic_arguments(parser: argparse.ArgumentParser) -> None:
    """The synthetic benchmark's options (names chosen not to clash with scripts/benchmark.py's)."""
    parser.add_argument("--synthetic", metavar="NAME[,NAME]",
                        help=f"random-weight roofline benchmark of these shapes: {', '.join(SHAPES)}")
    parser.add_argument("--out", help="directory for synthetic_<name>.json (rewritten after every row)")
    parser.add_argument("--budget-seconds", type=float, default=DEFAULT_BUDGET_SECONDS,
                        help="no new configuration starts once this would be exceeded (all shapes together)")
    parser.add_argument("--synthetic-batches", type=_int_list, default=(1, 8, 32), metavar="B[,B]")
    parser.add_argument("--synthetic-force-accepts", type=_int_list, default=None, metavar="K[,K]",
                        help="forced acceptances to time (default: 0..depth of each tree)")
    parser.add_argument("--synthetic-repeats", type=int, default=3)


def run_from_args(args: argparse.Namespace) -> dict[str, dict]:
    names = [n.strip() for n in args.synthetic.split(",") if n.strip()]
    return run_synthetic_models(names, args.out, args.budget_seconds, args.synthetic_batches,
                                args.synthetic_force_accepts, args.synthetic_repeats)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_synthetic_arguments(parser)
    args = parser.parse_args(argv)
    if not args.synthetic:
        parser.error(f"give --synthetic NAME[,NAME] ({', '.join(SHAPES)})")
    run_from_args(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
