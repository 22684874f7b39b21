"""A mixture-of-experts target on 8 virtual CPU devices (tests/models/test_moe_mesh.py): greedy tokens of one device,
tensor parallelism (every expert sliced over "model"), and expert parallelism (whole experts over "data", sliced over
"model"), plain and speculative. The target has everything a mixture of experts brings: gpt-oss's biased router and
experts (their biases split with the experts), clamped SwiGLU, a sink per head, a window of 8 in its sliding layers
(which the sequences pass), and Qwen3's q/k norms. Prints one JSON report as its last line."""

from __future__ import annotations

import json

import jax

import jspec
from jspec.drafters.eagle3 import Eagle3Drafter
from jspec.sharding import make_mesh
from models.config import ModelConfig
from models.eagle3 import eagle3_config_from_hf, init_eagle3_params
from models.llama import init_params

TARGET = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=8,
                     num_kv_heads=2, head_dim=8, model_type="gpt_oss", qk_norm=True, num_experts=8,
                     num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, moe_bias=True,
                     expert_activation="clamped_swiglu", attention_sinks=True, qkv_bias=True, o_bias=True,
                     sliding_window=8, layer_types=("sliding_attention", "full_attention", "sliding_attention"))
HEAD = eagle3_config_from_hf({"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 8,
                              "num_key_value_heads": 4, "vocab_size": 256, "draft_vocab_size": 256})
SPEC = jspec.SpecConfig(tree="dynamic", num_steps=3, topk=2, num_draft_tokens=6)
PROMPTS = [[5, 9, 5, 9, 12], [3, 1, 4, 1, 5, 9, 2, 6], [7], [200, 100, 50, 25, 12, 6]]
# name -> (tensor_parallel_size, data_parallel_size, enable_expert_parallel)
MESHES = {"tp2xdp4": (2, 4, False), "tp2xep4": (2, 4, True)}  # tp 2 within each data group; whole experts on top


def with_random_biases(params: dict, scale: float = 0.1) -> dict:
    """Every bias leaf (init_params draws zeros) drawn from N(0, scale): biases split with their kernels must
    land on the right devices to give one device's tokens."""
    keys = iter(jax.random.split(jax.random.key(7), len(jax.tree.leaves(params))))

    def draw(path, leaf):
        key = next(keys)
        return scale * jax.random.normal(key, leaf.shape, leaf.dtype) if path[-1].key == "bias" else leaf

    return jax.tree_util.tree_map_with_path(draw, params)


def main() -> None:
    params = with_random_biases(init_params(TARGET, jax.random.key(0)))
    params["layers"]["self_attn"]["o_proj"]["kernel"] = params["layers"]["self_attn"]["o_proj"]["kernel"] * 0.3
    params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * 6.0
    head = {"head": init_eagle3_params(HEAD, jax.random.key(1)), "d2t": jax.numpy.zeros((256,), jax.numpy.int32)}
    report = {}
    for drafted in (False, True):
        kwargs = dict(drafter=Eagle3Drafter(HEAD, TARGET, SPEC, 64), drafter_params=head) if drafted else {}
        for name, (tp, dp, ep) in {"one": (1, 1, False), **MESHES}.items():
            if drafted and name == "tp2xdp4":  # EAGLE-3's tree over experts split whole: the harder case
                continue
            mesh = None if name == "one" else make_mesh(tp, dp)
            engine = jspec.SpecEngine(TARGET, params, max_batch_size=4, max_seq_len=64, mesh=mesh,
                                      enable_expert_parallel=ep, **kwargs)
            sharding = engine.params["layers_0"]["mlp"]["experts"]["gate_proj"]["kernel"].sharding
            spec = getattr(sharding, "spec", ())
            out = engine.generate(PROMPTS, max_new_tokens=16)
            report[f"{'eagle3' if drafted else 'plain'}/{name}"] = {
                "tokens": out.token_ids, "experts_spec": [str(axis) for axis in spec],
                "acceptance_length": out.stats.acceptance_length}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
