"""The benchmarked shapes (``SHAPES``): HF-style configs of a Llama-3-shaped target and its EAGLE-3 head, and
random weights of those shapes.

For each shape: random bf16 target weights and a random EAGLE-3 head of matching shape (the shapes of the
models' own init functions, drawn by one jitted call, so they are created on the device: 16 GB of Llama-3-8B
weights never touch host memory).

The random head's lm_head is sharpened (``HEAD_SHARPEN``): an untrained head is near-uniform over its draft
vocabulary, so the best cumulative scores of an EAGLE-2 tree sit at the shallow depths and its first-child path
may be shorter than the forced k (on the tiny shape it stops at depth 2 of 3). Sharpened, each draft's top-1 is
near-certain, as in a trained head, and the path is ``num_steps`` deep. Costs do not depend on the values: every
shape is static. ``forced_acceptance_reached`` in each row checks it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jspec.config import SpecConfig
from models.checkpoint import DTYPES
from models.config import ModelConfig, from_hf_config
from models.eagle3 import Eagle3Config, eagle3_config_from_hf, init_eagle3_params
from models.llama import init_params

PLAIN, CHAIN, DYNAMIC = "plain", "eagle3-chain", "eagle3-dynamic"
METHODS = (PLAIN, CHAIN, DYNAMIC)
HEAD_SHARPEN = 64.0


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
