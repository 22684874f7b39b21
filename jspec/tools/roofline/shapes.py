"""The benchmarked shapes (``SHAPES``): HF-style configs of a Llama-3-shaped target, its EAGLE-3 head and a DFlash
block drafter, and random weights of those shapes.

For each shape: random bf16 target weights, a random EAGLE-3 head and a random DFlash drafter of matching shape
(the shapes of the models' own init functions, drawn by one jitted call, so they are created on the device: 16 GB
of Llama-3-8B weights never touch host memory). The DFlash drafter follows z-lab's published drafters: 5 Qwen3
layers of the target's width, a block of 16 (15 drafts in one forward), the target layers z-lab's rule picks.

The random head's lm_head is sharpened (``HEAD_SHARPEN``): an untrained head is near-uniform over its draft
vocabulary, so the best cumulative scores of an EAGLE-2 tree sit at the shallow depths and its first-child path
may be shorter than the forced k (on the tiny shape it stops at depth 2 of 3). Sharpened, each draft's top-1 is
near-certain, as in a trained head, and the path is ``num_steps`` deep. Costs do not depend on the values: every
shape is static. ``forced_acceptance_reached`` in each row checks it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jspec.config import SpecConfig
from models.checkpoint import DTYPES
from models.config import ModelConfig, from_hf_config
from models.dflash import DFlashConfig, dflash_config_from_hf, dflash_param_shapes
from models.eagle3 import Eagle3Config, eagle3_config_from_hf, eagle3_param_shapes
from models.llama import param_shapes

PLAIN, CHAIN, DYNAMIC, DFLASH = "plain", "eagle3-chain", "eagle3-dynamic", "dflash-chain"
METHODS = (PLAIN, CHAIN, DYNAMIC, DFLASH)
SPECULATIVE = (CHAIN, DYNAMIC, DFLASH)
HEAD_SHARPEN = 64.0


def dflash_hf(target_hf: dict, num_layers: int, block_size: int) -> dict:
    """z-lab's config.json of a DFlash drafter for ``target_hf``: its width, heads and vocabulary, ``num_layers``
    Qwen3 layers, the target layers z-lab's rule picks (``num_target_layers``), the last token id as the mask."""
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings")
    return {**{k: target_hf[k] for k in keep if k in target_hf}, "architectures": ["DFlashDraftModel"],
            "num_hidden_layers": num_layers, "block_size": block_size,
            "num_target_layers": target_hf["num_hidden_layers"],
            "dflash_config": {"mask_token_id": target_hf["vocab_size"] - 1}}


def _llama3_rope(factor: float) -> dict:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


@dataclasses.dataclass(frozen=True)
class SyntheticShape:
    """One benchmarked model: HF-style config dicts of the target, its EAGLE-3 head and its DFlash drafter, and the
    run's shape.

    prompt_len: P, a power of two (sequence bucket 2P holds every call); steps: loop iterations each timed call
    runs (fewer where ``steps`` steps of the deepest commit would overflow the bucket); chain, dynamic: the EAGLE-3
    configurations; the DFlash chain drafts the whole block (``block_size - 1`` drafts).
    """

    description: str
    target_hf: dict
    head_hf: dict
    dflash_hf: dict
    prompt_len: int
    steps: int
    chain: SpecConfig
    dynamic: SpecConfig
    dtype: str = "bfloat16"

    @property
    def dflash_chain(self) -> SpecConfig:
        return SpecConfig(tree="chain", num_steps=self.dflash_hf["block_size"] - 1)

    def spec(self, method: str) -> SpecConfig | None:
        return {PLAIN: None, CHAIN: self.chain, DYNAMIC: self.dynamic, DFLASH: self.dflash_chain}[method]

    def steps_for(self, tokens_per_step: int) -> int:
        """Loop iterations of a timed call committing ``tokens_per_step`` tokens each: ``steps``, or as many as
        the bucket holds after the prompt."""
        return min(self.steps, (self.prompt_len - 1) // tokens_per_step)

    def new_tokens(self, tokens_per_step: int) -> int:
        """N for a call that runs ``steps_for(tokens_per_step)`` iterations committing ``tokens_per_step`` each."""
        return 1 + self.steps_for(tokens_per_step) * tokens_per_step

    def __post_init__(self):
        if self.prompt_len & (self.prompt_len - 1):
            raise ValueError(f"prompt_len={self.prompt_len}: expected a power of two")
        deepest = max(self.spec(m).max_depth for m in SPECULATIVE)
        if self.steps_for(deepest + 1) < 8:
            raise ValueError(f"prompt_len={self.prompt_len} leaves {self.steps_for(deepest + 1)} steps of "
                             f"{deepest + 1} tokens in the sequence bucket: expected at least 8")


LLAMA3_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                 rope_theta=500000.0, rope_scaling=_llama3_rope(8.0), max_position_embeddings=131072,
                 tie_word_embeddings=False)
LLAMA3_1B = dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                 num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
                 rope_theta=500000.0, rope_scaling=_llama3_rope(32.0), max_position_embeddings=131072,
                 tie_word_embeddings=True)
TINY = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)

SHAPES: dict[str, SyntheticShape] = {
    "llama3-8b": SyntheticShape(
        description="Llama-3.1-8B shapes; EAGLE-3 head as yuhuili/EAGLE3-LLaMA3.1-Instruct-8B (draft vocab 32000)",
        target_hf=LLAMA3_8B,
        head_hf=dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                     vocab_size=128256, draft_vocab_size=32000, rms_norm_eps=1e-5, rope_theta=500000.0),
        dflash_hf=dflash_hf(LLAMA3_8B, num_layers=5, block_size=16),
        prompt_len=512, steps=32,
        chain=SpecConfig(tree="chain", num_steps=4),
        dynamic=SpecConfig(tree="dynamic", num_steps=6, topk=8, num_draft_tokens=32)),
    "llama3-1b": SyntheticShape(
        description="Llama-3.2-1B shapes (tied embeddings); EAGLE-3 head of matching shape (draft vocab 32000)",
        target_hf=LLAMA3_1B,
        head_hf=dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=64, vocab_size=128256, draft_vocab_size=32000, rms_norm_eps=1e-5,
                     rope_theta=500000.0),
        dflash_hf=dflash_hf(LLAMA3_1B, num_layers=5, block_size=16),
        prompt_len=512, steps=32,
        chain=SpecConfig(tree="chain", num_steps=4),
        dynamic=SpecConfig(tree="dynamic", num_steps=6, topk=8, num_draft_tokens=32)),
    # 3 layers, not 2: EAGLE-3 taps layers (2, L//2, L-3), which needs L >= 3.
    "tiny": SyntheticShape(
        description="tiny CPU smoke shapes (3 layers, hidden 64, vocab 256; head draft vocab 128)",
        target_hf=TINY,
        head_hf=dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=256, draft_vocab_size=128),
        dflash_hf=dflash_hf(TINY, num_layers=2, block_size=8),
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
    dflash: DFlashConfig
    params_t: Any
    params_d: Any  # {"head": ..., "d2t": i32[V_draft]}
    params_f: Any  # the DFlash drafter's tree

    def drafter_params(self, method: str) -> Any:
        return self.params_f if method == DFLASH else self.params_d


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


def abstract_params(target: ModelConfig, head: Eagle3Config, dflash: DFlashConfig, dtype: str) -> dict:
    """{"target", "head", "dflash"}: the shapes ``init_params``, ``init_eagle3_params`` and ``init_dflash_params``
    make."""
    return {"target": param_shapes(target, DTYPES[dtype]), "head": eagle3_param_shapes(head, DTYPES[dtype]),
            "dflash": dflash_param_shapes(dflash, DTYPES[dtype])}


def sharpened(head: dict, sharpen: float) -> dict:
    """The head with its lm_head scaled by ``sharpen`` (on the device)."""
    kernel = head["lm_head"]["kernel"]
    return {**head, "lm_head": {**head["lm_head"], "kernel": kernel * jnp.asarray(sharpen, kernel.dtype)}}


def build_models(name: str, seed: int = 0) -> SyntheticModels:
    """The configs of ``SHAPES[name]`` and random params on the device; d2t is the identity map."""
    shape = SHAPES[name]
    target = from_hf_config(shape.target_hf)
    head = eagle3_config_from_hf(shape.head_hf)
    dflash = dflash_config_from_hf(shape.dflash_hf)
    params = random_params(abstract_params(target, head, dflash, shape.dtype), seed)
    d2t = jnp.zeros((head.draft_vocab_size,), jnp.int32)  # target id = draft id + 0
    params_d = {"head": sharpened(params["head"], HEAD_SHARPEN), "d2t": d2t}
    jax.block_until_ready((params["target"], params_d, params["dflash"]))
    return SyntheticModels(name, shape, target, head, dflash, params["target"], params_d, params["dflash"])
