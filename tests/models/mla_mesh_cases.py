"""A DeepSeek-V3-shaped target on 8 virtual CPU devices (tests/models/test_deepseek_v3.py): greedy tokens of one
device, tensor parallelism (query heads and kv_b_proj split over "model", the latent cache whole on every device,
as vLLM keeps MLA's cache under TP; routed experts sliced) and expert parallelism (whole experts over "data"), plain,
with n-gram speculation and with a DeepSeek MTP module (a sparse latent-attention layer, split as the target's).
Prints one JSON report as its last line."""

from __future__ import annotations

import json

import jax

import jspec
from jspec.drafters.mtp import MtpDrafter
from jspec.drafters.ngram import NgramDrafter
from jspec.sharding import make_mesh
from models.config import ModelConfig
from models.llama import init_params
from models.mtp import MtpConfig, init_mtp_params
from tests.models.moe_mesh_cases import with_random_biases

TARGET = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=8,
                     num_kv_heads=8, head_dim=8, model_type="deepseek_v3", kv_lora_rank=16, q_lora_rank=24,
                     qk_nope_head_dim=8, v_head_dim=8, rope_interleave=True, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=32, norm_topk_prob=True, router_scoring="sigmoid", router_groups=4,
                     router_topk_groups=2, routed_scaling_factor=2.5, shared_expert_size=32, first_dense_layers=1)
PROMPTS = [[5, 9, 5, 9, 12], [3, 1, 4, 1, 5, 9, 2, 6], [7], [200, 100, 50, 25, 12, 6]]
# name -> (tensor_parallel_size, data_parallel_size, enable_expert_parallel)
MESHES = {"tp2xdp4": (2, 4, False), "tp4xep2": (4, 2, True)}


def main() -> None:
    params = init_params(TARGET, jax.random.key(0))
    params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * 6.0
    params = jax.tree_util.tree_map_with_path(  # the router's correction bias away from zero, like a bias
        lambda path, leaf: leaf if path[-1].key != "e_score_correction_bias" else
        0.2 * jax.random.normal(jax.random.key(len(path)), leaf.shape), with_random_biases(params))
    chain = jspec.SpecConfig(tree="chain", num_steps=3)
    mtp = MtpConfig.for_target(TARGET, 1, "deepseek")
    drafters = {"plain": {}, "ngram": dict(drafter=NgramDrafter(chain, 64), drafter_params={}),
                "mtp": dict(drafter=MtpDrafter(mtp, TARGET, chain, 64),
                            drafter_params=init_mtp_params(mtp, jax.random.key(3)))}
    report = {}
    for method, kwargs in drafters.items():
        for name, (tp, dp, ep) in {"one": (1, 1, False), **MESHES}.items():
            mesh = None if name == "one" else make_mesh(tp, dp)
            engine = jspec.SpecEngine(TARGET, params, max_batch_size=4, max_seq_len=64, mesh=mesh,
                                      enable_expert_parallel=ep, **kwargs)
            out = engine.generate(PROMPTS, max_new_tokens=16)
            layer = engine.params["layers_1"]
            report[f"{method}/{name}"] = {
                "tokens": out.token_ids,
                "kv_b_spec": [str(a) for a in getattr(layer["self_attn"]["kv_b_proj"]["kernel"].sharding, "spec", ())],
                "experts_spec": [str(a) for a in getattr(layer["mlp"]["experts"]["gate_proj"]["kernel"].sharding,
                                                         "spec", ())]}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
