"""The engine's programs compiled ahead of time for a TPU or GPU deployment this machine does not have
(``jspec.tools.aot``): the whole ``generate`` program and its decode step, at a real model's shapes (random weights
are never made: the parameters are ``jax.ShapeDtypeStruct`` trees), over a TP mesh of the chip's compile-only
devices.

    programs = compile_engine_programs(DEPLOYMENTS["llama3-8b/v5e-1/int8"], "eagle3-chain", batch=8)
    programs.step.cost_analysis()["bytes accessed"], programs.generate.memory_analysis()

Step costs come from the step program (XLA's cost analysis counts a while loop's body once, so the generate
program's flops are prefill plus one step); memory from the generate program (weights, the KV cache of
``batch x seq_len`` slots and every temporary, per device).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jspec.config import SpecConfig
from jspec.drafters.dflash import DFlashDrafter
from jspec.drafters.eagle3 import Eagle3Drafter
from jspec.drafters.mtp import MtpDrafter
from jspec.generate import generate, generate_start
from jspec.generate_setup import GenerateSetup
from jspec.sampling import SamplingArrays
from jspec.sharding import ROWS, expand_kv_heads, kv_repeats, make_mesh, named, param_specs, per_device_bytes, traced_on
from jspec.step import plain_step, spec_step
from jspec.tools.aot import compile_for, devices_for
from jspec.tools.roofline.shapes import LLAMA3_8B, TINY, dflash_hf
from models.checkpoint import DTYPES
from models.config import ModelConfig, from_hf_config
from models.dflash import dflash_config_from_hf, dflash_param_shapes
from models.eagle3 import eagle3_config_from_hf, eagle3_param_shapes
from models.llama import param_shapes, unstack_layers
from models.mtp import MtpConfig, mtp_param_shapes
from models.quantization import QuantizationConfig, quantize_params

LLAMA3_70B = dict(LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8)


@dataclasses.dataclass(frozen=True)
class ModelShapes:
    """A target's HF config with its EAGLE-3 head's and DFlash drafter's, and the trees the engine would run."""

    target_hf: dict
    head_hf: dict
    dflash_hf: dict
    chain: SpecConfig = SpecConfig(tree="chain", num_steps=4)
    dynamic: SpecConfig = SpecConfig(tree="dynamic", num_steps=6, topk=8, num_draft_tokens=32)
    dynamic16: SpecConfig = SpecConfig(tree="dynamic", num_steps=5, topk=4, num_draft_tokens=16)


def _head_hf(target_hf: dict) -> dict:
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "vocab_size", "rms_norm_eps", "rope_theta")
    return {**{k: target_hf[k] for k in keep if k in target_hf}, "draft_vocab_size": 32000}


# Qwen3-30B-A3B's config.json: 48 layers of 128 experts (8 a token, 768 wide) and GQA attention (32 heads of 128,
# 4 KV heads) over a 2048-wide residual; 30.5B parameters, 3.3B active a token.
QWEN3_30B_A3B = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
                     tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                     norm_topk_prob=True)

# gpt-oss-20b's config.json: 24 layers of 32 experts (4 a token, 2880 wide, with biases and the clamped SwiGLU),
# attention of 64 heads of 64 over 8 KV heads with a sink per head, layers alternating a 128-token window and full
# attention, yarn rope; 20.9B parameters, 3.6B active a token (its experts ship in MXFP4; converted, they are bf16).
GPT_OSS_20B = dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                   num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                   num_local_experts=32, num_experts_per_tok=4, sliding_window=128, rms_norm_eps=1e-5,
                   rope_theta=150000.0, max_position_embeddings=131072, tie_word_embeddings=False,
                   rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 4096},
                   swiglu_limit=7.0, attention_bias=True)

# DeepSeek-V3's config.json (671B; R1's is the same): 61 layers, the first 3 dense (18432 wide), then 256 routed
# experts (8 a token, within 4 of 8 groups, 2048 wide) beside one shared; multi-head latent attention (128 heads,
# q rank 1536, kv rank 512, query heads of 128 + 64 rope, values of 128); one MTP module (layer 61); yarn rope;
# 37B parameters active a token.
DEEPSEEK_V3 = dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                   moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
                   n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512,
                   q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8,
                   topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True,
                   scoring_func="sigmoid", topk_method="noaux_tc", max_position_embeddings=163840,
                   rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, num_nextn_predict_layers=1,
                   rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                 "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096})

MODELS = {name: ModelShapes(hf, _head_hf(hf), dflash_hf(hf, num_layers=5, block_size=16))
          for name, hf in (("llama3-8b", LLAMA3_8B), ("llama3-70b", LLAMA3_70B), ("qwen3-30b-a3b", QWEN3_30B_A3B),
                           ("gpt-oss-20b", GPT_OSS_20B), ("deepseek-v3", DEEPSEEK_V3))}
# Three layers of width 64 (the roofline benchmark's CPU smoke shapes): every program's structure, compiled in
# seconds (tests/aot).
MODELS["tiny"] = ModelShapes(TINY, dict(_head_hf(dict(TINY, rms_norm_eps=1e-5, rope_theta=10000.0)),
                                        draft_vocab_size=128), dflash_hf(TINY, num_layers=2, block_size=8),
                             chain=SpecConfig(tree="chain", num_steps=3),
                             dynamic=SpecConfig(tree="dynamic", num_steps=3, topk=3, num_draft_tokens=8),
                             dynamic16=SpecConfig(tree="dynamic", num_steps=2, topk=2, num_draft_tokens=4))
# The same with Qwen3-MoE's mixture of experts (8 experts, 2 a token) in every layer.
MODELS["tiny-moe"] = dataclasses.replace(
    MODELS["tiny"], target_hf=dict(TINY, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                                   moe_intermediate_size=32, norm_topk_prob=True))
# eagle3-dynamic: the 32-node tree; eagle3-dynamic16: the 16-node one
# mtp-chain: the target's own MTP module (DeepSeek's layout) drafting a chain of 3 recurrently
METHODS = ("plain", "eagle3-chain", "eagle3-dynamic16", "eagle3-dynamic", "dflash-block", "mtp-chain")
MTP_CHAIN = SpecConfig(tree="chain", num_steps=3)


@dataclasses.dataclass(frozen=True)
class Deployment:
    """A model on ``chips`` chips of ``chip`` (a TPU slice or a GPU node: jspec.tools.aot.CHIPS), the target split
    over all of them (tensor parallel), weights in ``dtype`` or weight-only ``quantization``."""

    model: str
    chip: str
    chips: int
    quantization: str | None = None
    dtype: str = "bfloat16"

    @property
    def name(self) -> str:
        return f"{self.model}/{self.chip}-{self.chips}/{self.quantization or self.dtype}"


DEPLOYMENTS = {d.name: d for d in (
    Deployment("llama3-8b", "v5e", 1, "int8"), Deployment("llama3-8b", "v5e", 4), Deployment("llama3-8b", "v6e", 4),
    Deployment("llama3-70b", "v5p", 4), Deployment("llama3-70b", "v6e", 8),
    Deployment("llama3-8b", "h100", 1), Deployment("llama3-70b", "h100", 8),
    Deployment("qwen3-30b-a3b", "h100", 1), Deployment("qwen3-30b-a3b", "v5p", 1),
    Deployment("gpt-oss-20b", "h100", 1), Deployment("gpt-oss-20b", "v5p", 1),
    # 671B: int8 fills 8 v5p chips (760 GB of HBM); int4 fits 8 H100s (640 GB)
    Deployment("deepseek-v3", "v5p", 8, "int8"), Deployment("deepseek-v3", "h100", 8, "int4"))}
# v5p chips are megacores (one JAX device of two TensorCores): v5p-8 in Cloud's naming of cores is 4 chips.


@dataclasses.dataclass
class EnginePrograms:
    """One method of one deployment, compiled: the whole generate program and one decode step."""

    deployment: Deployment
    method: str
    batch: int
    seq_len: int
    generate: Any  # None where not asked for
    step: Any
    weight_bytes_per_device: int


def _drafter(shapes: ModelShapes, method: str, target: ModelConfig, seq_len: int, dtype: str):
    """(drafter, its abstract params) for ``method`` (None, None for plain decoding)."""
    if method == "plain":
        return None, None
    if method == "mtp-chain":
        config = MtpConfig.for_target(target, 1, "deepseek")
        return MtpDrafter(config, target, MTP_CHAIN, seq_len, dtype), mtp_param_shapes(config, DTYPES[dtype])
    if method == "dflash-block":
        config = dflash_config_from_hf(shapes.dflash_hf)
        spec = SpecConfig(tree="chain", num_steps=shapes.dflash_hf["block_size"] - 1)
        return DFlashDrafter(config, target, spec, seq_len, dtype), dflash_param_shapes(config, DTYPES[dtype])
    head = eagle3_config_from_hf(shapes.head_hf)
    spec = {"eagle3-chain": shapes.chain, "eagle3-dynamic16": shapes.dynamic16}.get(method, shapes.dynamic)
    abstract = {"head": eagle3_param_shapes(head, DTYPES[dtype]),
                "d2t": jax.ShapeDtypeStruct((head.draft_vocab_size,), jnp.int32)}
    return Eagle3Drafter(head, target, spec, seq_len, dtype), abstract


def _placed(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda leaf, s: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s), tree, shardings)


@dataclasses.dataclass
class Placed:
    """A deployment's engine as compile-only arrays: its setup (mesh included), the target's and drafter's abstract
    parameters placed on the mesh, the devices, and the bytes of parameters one device holds."""

    setup: GenerateSetup
    params_t: Any
    params_d: Any
    devices: tuple
    weight_bytes_per_device: int


def placed_engine(deployment: Deployment, method: str, seq_len: int) -> Placed:
    """``method`` (:data:`METHODS`) on ``deployment`` at a ``seq_len`` context, as abstract arrays on the chip's
    compile-only devices (tensor parallel over all of them)."""
    if method not in METHODS:
        raise ValueError(f"method={method!r}: expected one of {METHODS}")
    shapes = MODELS[deployment.model]
    devices = devices_for(deployment.chip, deployment.chips)
    mesh = make_mesh(tensor_parallel_size=deployment.chips, devices=devices)
    config = from_hf_config(shapes.target_hf)
    tp = deployment.chips
    repeats = kv_repeats(config, tp)
    quantization = QuantizationConfig.coerce(deployment.quantization)

    def prepare(stacked):
        return quantize_params(expand_kv_heads(unstack_layers(stacked, config), config, repeats)[0], quantization)

    abstract_t = jax.eval_shape(prepare, param_shapes(config, DTYPES[deployment.dtype]))
    config = expand_kv_heads({}, config, repeats)[1]
    params_t = _placed(abstract_t, named(mesh, param_specs(abstract_t, config, tp)))
    drafter, abstract_d = _drafter(shapes, method, config, seq_len, deployment.dtype)
    params_d = None if drafter is None else _placed(abstract_d, named(mesh, drafter.param_specs(abstract_d, tp)))
    setup = GenerateSetup(target=config, max_seq_len=seq_len, dtype=deployment.dtype, drafter=drafter, mesh=mesh)
    return Placed(setup, params_t, params_d, devices,
                  per_device_bytes(params_t) + (0 if params_d is None else per_device_bytes(params_d)))


def compile_engine_programs(deployment: Deployment, method: str, batch: int = 8, prompt_len: int = 1024,
                            seq_len: int = 2048, whole: bool = True) -> EnginePrograms:
    """``method`` (:data:`METHODS`) on ``deployment``: the generate program for ``batch`` prompts of
    ``prompt_len`` tokens in a ``seq_len`` bucket (``whole=False``: not compiled, None), and its decode step,
    compiled for the chip."""
    engine = placed_engine(deployment, method, seq_len)
    setup, params_t, params_d, devices = engine.setup, engine.params_t, engine.params_d, engine.devices
    mesh, tp, drafter = setup.mesh, deployment.chips, setup.drafter
    rows = jax.sharding.NamedSharding(mesh, ROWS)
    row = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rows)
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), batch))
    sampling = jax.tree.map(lambda a: row(a.shape, a.dtype), SamplingArrays.full(batch))
    args = [params_t, params_d, row((batch, prompt_len), jnp.int32), row((batch,), jnp.int32),
            row(keys.shape, keys.dtype), row((batch,), jnp.int32), row((batch, 1), jnp.int32), sampling]
    program = compile_for(functools.partial(generate, setup=setup), args, devices[:tp]) if whole else None
    state_inputs = jax.eval_shape(functools.partial(generate_start, setup=setup), *args)
    if tp > 1:  # where the state's leaves live: the prefill program's outputs say
        shardings = compile_for(functools.partial(generate_start, setup=setup), args, devices[:tp]).output_shardings
    else:  # on one chip: there
        shardings = jax.tree.map(lambda _: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
                                 state_inputs)
    state_inputs = _placed(state_inputs, shardings)
    step_fn = plain_step if drafter is None else spec_step

    def one_step(pt, pd, state, inputs):
        with traced_on(mesh):  # as generate's loop traces it: kernels wrap themselves in shard_map
            return step_fn(pt, pd, state, inputs, setup=setup)

    step = compile_for(one_step, [params_t, params_d, *state_inputs], devices[:tp], donate_argnums=(2,))
    return EnginePrograms(deployment, method, batch, seq_len, program, step, engine.weight_bytes_per_device)

