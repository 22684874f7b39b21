"""Runs the sharded-engine cases on 8 virtual CPU devices and prints one JSON report (tests/jspec/test_sharded_engine.py).

Run as a subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (JAX reads it at start-up):
every case builds a single-device engine and sharded ones over the same weights and records their tokens.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec.drafters.dflash import DFlashDrafter
from jspec.drafters.draft_model import DraftModelDrafter
from jspec.drafters.eagle3 import Eagle3Drafter
from jspec.drafters.ngram import NgramDrafter
from jspec.sharding import make_mesh
from models.config import ModelConfig
from models.dflash import DFlashConfig, init_dflash_params
from models.eagle3 import eagle3_config_from_hf, init_eagle3_params
from models.llama import init_params
from tests.hlo_collectives import generate_loop_count, loop_collectives

# 8 query heads, 2 KV heads: tp 2 splits the KV heads, tp 4 and 8 repeat them (2 and 4 copies).
TARGET = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=8,
                     num_kv_heads=2, head_dim=8)
# The head splits over "model" at tp 2 and 4 (8 heads, 4 KV heads) and is replicated at tp 8.
HEAD = eagle3_config_from_hf({"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 8,
                              "num_key_value_heads": 4, "vocab_size": 256, "draft_vocab_size": 256})
# DFlash / DSpark layers over the target's layers 0 and 1 (replicated on the mesh: no param_specs of their own).
# Blocks of 4: a [1, 3, 64] activation would look like the stacked [3, 64] norm weights to the weight-gather check.
BLOCK_LAYER = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=8,
                          num_kv_heads=2, head_dim=8, model_type="qwen3", qk_norm=True)
DFLASH = DFlashConfig(BLOCK_LAYER, block_size=4, mask_token_id=255, target_layer_ids=(0, 1), target_hidden_size=64)
DSPARK = DFlashConfig(BLOCK_LAYER, block_size=4, mask_token_id=255, target_layer_ids=(-1, 1), target_hidden_size=64,
                      layout="dspark", markov_rank=8, confidence_head=True)
MAX_SEQ_LEN = 128
# tp 4 alone is left out: dp 2 x tp 4 runs the same tp-4 split (KV heads repeated twice) in each data group.
# tp 2 runs on the bundled model below (BUNDLED_MESHES); the tiny drafters take the widest split and the mixed one.
MESHES = {"tp8": (8, 1), "dp2xtp4": (4, 2)}
SAMPLED_MESHES = ("tp8", "dp2xtp4")
SPECS = {"chain": jspec.SpecConfig(tree="chain", num_steps=3),
         "dynamic": jspec.SpecConfig(tree="dynamic", num_steps=3, topk=2, num_draft_tokens=6)}


def target_params() -> dict:
    """A near-bigram target (small attention output, sharp lm_head): drafts get accepted, trees branch."""
    params = init_params(TARGET, jax.random.key(0))
    params["layers"]["self_attn"]["o_proj"]["kernel"] = params["layers"]["self_attn"]["o_proj"]["kernel"] * 0.3
    params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * 6.0
    return params


def drafters(params_t: dict) -> dict:
    """name -> (drafter or None, drafter params or None)."""
    head = {"head": init_eagle3_params(HEAD, jax.random.key(1)), "d2t": jnp.zeros((256,), jnp.int32)}
    return {
        "plain": (None, None),
        "eagle3-chain": (Eagle3Drafter(HEAD, TARGET, SPECS["chain"], MAX_SEQ_LEN), head),
        "eagle3-dynamic": (Eagle3Drafter(HEAD, TARGET, SPECS["dynamic"], MAX_SEQ_LEN), head),
        # The target drafting for itself: every draft is accepted, so commits move whole paths.
        "draft-model": (DraftModelDrafter(TARGET, TARGET, SPECS["chain"], MAX_SEQ_LEN), params_t),
        "ngram": (NgramDrafter(jspec.SpecConfig(tree="chain", num_steps=4), MAX_SEQ_LEN), {}),
        "dflash": (DFlashDrafter(DFLASH, TARGET, SPECS["dynamic"], MAX_SEQ_LEN),
                   init_dflash_params(DFLASH, jax.random.key(2))),
        # Under its confidence cut rows draft a whole chain, part of it or nothing.
        "dspark": (DFlashDrafter(DSPARK, TARGET, SPECS["chain"], MAX_SEQ_LEN, confidence_threshold=0.5,
                                 short_drafts=1), init_dflash_params(DSPARK, jax.random.key(3))),
    }


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    motif = rng.integers(0, 256, 6).tolist()
    return [motif * 3 + [7], rng.integers(0, 256, 9).tolist(), motif + [1, 2] + motif, [5]]


def engine(params_t, drafter, params_d, mesh, force_accept: int | None = None) -> jspec.SpecEngine:
    built = jspec.SpecEngine(TARGET, params_t, drafter=drafter, drafter_params=params_d, max_batch_size=4,
                             max_seq_len=MAX_SEQ_LEN, mesh=mesh)
    return built if force_accept is None else built.forcing_acceptance(force_accept)


# Random DFlash drafts are never accepted on this target: its engines (one device and sharded alike) accept 3
# drafts per step regardless, so the commit of whole paths into the drafter's context cache runs on the mesh.
FORCED = {"dflash": 3}


def run_cases(names: list[str]) -> dict:
    params_t = target_params()
    report = {}
    for name, (drafter, params_d) in drafters(params_t).items():
        if name not in names:
            continue
        forced = FORCED.get(name)
        single = engine(params_t, drafter, params_d, None, forced)
        case = {"single": single.generate(prompts(), max_new_tokens=24).token_ids,
                "single_sampled": single.generate(prompts(), max_new_tokens=16, temperature=0.8, seed=3).token_ids,
                "acceptance": single.generate(prompts(), max_new_tokens=24).stats.acceptance_length}
        for mesh_name, (tp, dp) in MESHES.items():
            sharded = engine(params_t, drafter, params_d, make_mesh(tp, dp), forced)
            first = sharded.generate(prompts(), max_new_tokens=24)
            again = sharded.generate(prompts()[::-1], max_new_tokens=24)  # same bucket: no compilation
            case[mesh_name] = {"greedy": first.token_ids, "again": again.token_ids[::-1],
                               "num_compiled": sharded.num_compiled,
                               "again_compile_seconds": again.stats.compile_seconds}
            if mesh_name in SAMPLED_MESHES:
                case[mesh_name]["sampled"] = sharded.generate(prompts(), max_new_tokens=16, temperature=0.8,
                                                              seed=3).token_ids
        report[name] = case
    return report


BUNDLED_MESHES = {"tp2": (2, 1), "dp2xtp4": (4, 2)}
BUNDLED_PROMPTS = ["def fibonacci(n):", "import os\n\ndef list_files(path):", "class Stack:\n    def __init__(self):",
                   "def is_prime(n):\n    \"\"\"Return True if n is prime.\"\"\""]


def bundled_case() -> dict:
    """The bundled code model with its trained EAGLE-3 head (default dynamic tree): real acceptance on a mesh,
    through ``from_pretrained`` (restored into the sharding), ``generate`` and ``stream``."""
    from jspec.tools.bundled import DEFAULT_SPEC

    def load(**mesh):
        return jspec.SpecEngine.from_pretrained(jspec.bundled_model(), drafter="eagle3", spec=DEFAULT_SPEC,
                                                max_batch_size=4, max_seq_len=256, **mesh)

    single = load().generate(BUNDLED_PROMPTS, max_new_tokens=32)
    case = {"single": single.token_ids, "acceptance": single.stats.acceptance_length}
    for mesh_name, (tp, dp) in BUNDLED_MESHES.items():
        sharded = load(tensor_parallel_size=tp, data_parallel_size=dp)
        out = sharded.generate(BUNDLED_PROMPTS, max_new_tokens=32)
        streamed = [[] for _ in BUNDLED_PROMPTS]
        for chunk in sharded.stream(BUNDLED_PROMPTS, max_new_tokens=32, steps_per_chunk=3):
            for tokens, new in zip(streamed, chunk):
                tokens += new
        case[mesh_name] = {"greedy": out.token_ids, "streamed": streamed, "acceptance": out.stats.acceptance_length}
    return case


def collectives(names: list[str]) -> dict:
    """name -> the generation loop body's collectives at tp=4: [kind, shape, op_name] per instruction."""
    params_t = target_params()
    report = {}
    for name, (drafter, params_d) in drafters(params_t).items():
        if name not in names:
            continue
        sharded = engine(params_t, drafter, params_d, make_mesh(4, 1))
        batch, sampling = sharded._prepare([[1, 2, 3]], 8, 0.0, 0, 1.0, 0, None)
        args = sharded._arguments(batch, sampling)
        setup = sharded.setup.with_max_seq_len(batch.seq_len)
        text = jspec.generate.lower(*args, setup=setup).compile().as_text()
        report[name] = {"collectives": [list(c) for c in loop_collectives(text)],
                        "generate_loops": generate_loop_count(text)}
    return report


def main(argv: list[str]) -> dict:
    """``WHAT NAMES [WHAT NAMES ...]`` (WHAT: cases, collectives or bundled; NAMES comma-separated) -> {WHAT:
    report}. One process runs them all: each process pays JAX's start-up and the single-device engines again."""
    assert len(jax.devices()) == 8, jax.devices()
    out = {}
    for what, names in zip(argv[::2], argv[1::2]):
        if what == "bundled":
            out[what] = {"bundled-eagle3": bundled_case()}
        else:
            out[what] = run_cases(names.split(",")) if what == "cases" else collectives(names.split(","))
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
