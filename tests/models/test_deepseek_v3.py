"""DeepSeek-V3 (``DeepseekV3ForCausalLM``) against transformers: a tiny random checkpoint saved by transformers
(multi-head latent attention with q and kv low-rank projections, rope on interleaved pairs, yarn with mscale; 8
experts routed by sigmoid scores plus a correction bias within the 2 best of 4 groups, a shared expert, the routed
scaling factor, the first layer dense) converts with ``jspec convert``; its logits equal transformers' within 1e-4
through prefill, cached decode and a tree pass, and greedy decoding, plain and n-gram speculative, returns
transformers' tokens.

jspec runs the attention in its absorbed form over a cache of latents (``models/mla.py``); transformers' module
expands every cached latent into per-head keys and values (the naive form), so equal logits are the absorbed form
checked against the naive one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jspec
from jspec.drafters.ngram import NgramDrafter
from models.attention import KVCache
from models.checkpoint import load_llama
from models.config import from_hf_config
from models.llama import LlamaModel
from models.moe import route_sigmoid
from tests import spec_fixtures as fx
from tests.hf_models import FAMILIES
from tests.jspec.test_engine_vs_hf import hf_greedy, prompts_for

ATOL = 1e-4


@pytest.fixture(scope="module")
def converted(hf_checkpoint):
    model, _, out_dir = hf_checkpoint("deepseek_v3")
    config, params, _ = load_llama(out_dir)
    return model, config, params, out_dir


def test_the_config_reads_latent_attention_and_the_router(converted):
    model, config, params, _ = converted
    assert config.mla and config.kv_cache_heads == 1 and config.kv_cache_dims == (32 + 16, 0)
    assert (config.q_lora_rank, config.qk_nope_head_dim, config.v_head_dim, config.head_dim) == (48, 24, 20, 16)
    assert config.rope_interleave and config.router_scoring == "sigmoid"
    assert (config.router_groups, config.router_topk_groups, config.routed_scaling_factor) == (4, 2, 2.5)
    assert config.shared_expert_size == 24 and config.first_dense_layers == 1 and not config.uniform_layers
    assert config.attention_scale == pytest.approx(model.model.layers[0].self_attn.scaling, rel=1e-12)
    assert sorted(params) == ["embed_tokens", "layers_0", "layers_1", "layers_2", "lm_head", "norm"]  # per layer
    assert "experts" not in params["layers_0"]["mlp"] and "shared_experts" in params["layers_1"]["mlp"]


def test_refused_by_name():
    hf = FAMILIES["deepseek_v3"]().to_dict()
    with pytest.raises(ValueError, match="attention_bias"):
        from_hf_config(dict(hf, attention_bias=True))
    with pytest.raises(ValueError, match="scoring_func"):
        from_hf_config(dict(hf, scoring_func="softmax"))


def test_routing_equals_transformers_router():
    """Sigmoid scores, the correction bias choosing within the best groups, renormalised weights times the scale."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf_config = FAMILIES["deepseek_v3"]()
    router = DeepseekV3TopkRouter(hf_config)
    rng = np.random.default_rng(0)
    with torch.no_grad():
        router.weight.copy_(torch.tensor(rng.normal(size=(8, 64)), dtype=torch.float32))
        router.e_score_correction_bias.copy_(torch.tensor(rng.normal(0, 0.5, size=8), dtype=torch.float32))
    x = rng.normal(size=(50, 64)).astype(np.float32)
    with torch.no_grad():
        logits, want_weights, want_experts = router(torch.tensor(x))
    weights, experts = route_sigmoid(jnp.asarray(logits.numpy()), jnp.asarray(router.e_score_correction_bias.numpy()),
                                     2, 4, 2, True, 2.5)
    order, want_order = np.argsort(experts, axis=1), np.argsort(want_experts.numpy(), axis=1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(experts), order, 1),
                                  np.take_along_axis(want_experts.numpy(), want_order, 1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, 1),
                               np.take_along_axis(want_weights.numpy(), want_order, 1), rtol=1e-6)


def test_prefill_cached_decode_and_a_tree_equal_transformers(converted):
    model, config, params, _ = converted
    rng = np.random.default_rng(1)
    batch, prompt_len, decode_steps = 2, 13, (1, 3)
    total = prompt_len + sum(decode_steps)
    ids = rng.integers(0, config.vocab_size, (batch, total))
    with torch.no_grad():
        expected = model(torch.tensor(ids)).logits.numpy()
    flax_model = LlamaModel(config, scan_layers=False)
    apply = jax.jit(flax_model.apply)  # compiled (cached across runs) rather than dispatched op by op
    cache = KVCache.for_model(config, batch, 32, jnp.float32, per_layer=True)
    assert cache.k[0].shape == (batch, 32, 1, 48) and cache.v[0].shape == (batch, 32, 1, 0)  # the latent only
    cache = cache._replace(k=tuple(k + jnp.nan for k in cache.k))  # unused slots must never be read
    start = 0
    for width in (prompt_len,) + decode_steps:
        positions = np.broadcast_to(np.arange(start, start + width), (batch, width))
        out = apply({"params": params}, jnp.asarray(ids[:, start:start + width]), jnp.asarray(positions), cache,
                    jnp.full((batch,), start, jnp.int32))
        np.testing.assert_allclose(np.asarray(out.logits), expected[:, start:start + width], atol=ATOL, rtol=0)
        cache, start = out.cache, start + width
    # a tree over the prompt's cache: node 1 continues the prompt, node 2 (its child) and node 3 (a sibling of 1)
    tree = np.asarray([[ids[0, prompt_len - 1], 5, 7, 9]])
    mask = np.asarray([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]]], bool)
    one = KVCache.for_model(config, 1, 32, jnp.float32, per_layer=True)
    prefix = apply({"params": params}, jnp.asarray(ids[:1, :prompt_len - 1]), jnp.arange(prompt_len - 1)[None], one,
                   jnp.zeros((1,), jnp.int32))
    out = apply({"params": params}, jnp.asarray(tree), jnp.asarray([[0, 1, 2, 1]]) + prompt_len - 1,
                prefix.cache, jnp.full((1,), prompt_len - 1, jnp.int32), local_mask=jnp.asarray(mask))
    with torch.no_grad():
        branch_a = model(torch.tensor(np.concatenate([ids[:1, :prompt_len], [[5, 7]]], 1))).logits.numpy()[0]
        branch_b = model(torch.tensor(np.concatenate([ids[:1, :prompt_len], [[9]]], 1))).logits.numpy()[0]
    got = np.asarray(out.logits)[0]
    np.testing.assert_allclose(got[:3], branch_a[prompt_len - 1:], atol=ATOL, rtol=0)
    np.testing.assert_allclose(got[3], branch_b[-1], atol=ATOL, rtol=0)


def test_greedy_plain_and_speculative_return_transformers_tokens(converted):
    model, config, params, _ = converted
    model.generation_config.eos_token_id = None  # random weights: run to max_new_tokens on both sides
    prompts = prompts_for(config.vocab_size)
    want = [hf_greedy(model, prompt, 12) for prompt in prompts]
    plain = jspec.SpecEngine(config, params, max_batch_size=4, max_seq_len=64)
    assert plain.generate(prompts, max_new_tokens=12).token_ids == want
    ngram = jspec.SpecEngine(config, params, drafter=NgramDrafter(fx.SPECS["chain"], 64), drafter_params={},
                             max_batch_size=4, max_seq_len=64)
    assert ngram.generate(prompts, max_new_tokens=12).token_ids == want


# slow (the server's programs over a DeepSeek-V3 target compile); default tier: the cached decode and tree pass above
@pytest.mark.slow
def test_served_requests_keep_latents_in_pages_and_equal_generate_alone(converted):
    """The paged store holds each layer's latents (kv_lora_rank + rope per token, a zero-wide V), a long prompt is
    prefilled in pieces through them, a prefix hit reuses them, and n-gram speculation four rows at a time returns
    what ``generate`` returns alone."""
    from jspec.serve.slots import SlotEngine
    from tests.jspec.serve.test_slots import serve_all

    _, config, params, _ = converted
    engine = jspec.SpecEngine(config, params, drafter=NgramDrafter(fx.SPECS["chain"], 64), drafter_params={},
                              max_batch_size=4, max_seq_len=64)
    # prompts past 16 tokens prefilled in pieces, whose cached-prefill program also serves the prefix hit
    slots = SlotEngine(engine, max_seq_len=64, steps_per_chunk=2, adapt=False, row_buckets=(4,), block_size=8,
                       max_num_batched_tokens=16)
    slots.warm_up()
    assert slots.layout.pool("target K/V").bytes_per_token == config.num_layers * (32 + 16) * 4
    slots.start()
    rng = np.random.default_rng(0)
    requests = [{"prompt_ids": rng.integers(2, 100, n).tolist(), "max_tokens": m}
                for n, m in ((5, 20), (17, 30), (9, 12), (30, 25))]
    try:
        served = serve_all(slots, requests[:2]) + serve_all(slots, requests[2:] + [
            {"prompt_ids": requests[1]["prompt_ids"][:16] + [3], "max_tokens": 30}])  # two pages of the second's
        assert slots.metrics.prefix_hits._value.get() > 0
    finally:
        slots.shutdown(10)
    requests.append({"prompt_ids": requests[1]["prompt_ids"][:16] + [3], "max_tokens": 30})
    for request, sink in zip(requests, served):
        assert sink.tokens == engine.generate([request["prompt_ids"]],
                                              max_new_tokens=request["max_tokens"]).token_ids[0]


def block_fp8(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek's block FP8 of a [out, in] weight: (float8_e4m3fn weight, weight_scale_inv [ceil(out / block),
    ceil(in / block)], the dequantized weight)."""
    rows, cols = -(-weight.shape[0] // block), -(-weight.shape[1] // block)
    padded = torch.zeros(rows * block, cols * block)
    padded[:weight.shape[0], :weight.shape[1]] = weight
    blocks = padded.reshape(rows, block, cols, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0  # float8_e4m3fn's largest value
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    dequantized = (q.float() * scale[:, None, :, None]).reshape(padded.shape)[:weight.shape[0], :weight.shape[1]]
    return q.reshape(padded.shape)[:weight.shape[0], :weight.shape[1]].contiguous(), scale, dequantized


def test_a_block_fp8_checkpoint_converts_as_its_dequantized_weights(tmp_path):
    """Every projection stored as DeepSeek ships them (float8 blocks of 16 here, partial ones at the edges, and a
    ``weight_scale_inv`` per block): the converted model's logits equal transformers' on the dequantized weights."""
    import json
    import os
    import shutil

    import transformers
    from safetensors.torch import save_file
    from models.checkpoint import convert_hf_checkpoint, load_mtp
    from models.checkpoint.hf_export import mtp_hf_tensors
    from models.mtp import MtpConfig, init_mtp_params
    from tests.hf_models import make_hf_model

    from safetensors.torch import load_file

    saved, hf_dir, ref_dir = str(tmp_path / "saved"), str(tmp_path / "hf"), str(tmp_path / "reference")
    make_hf_model("deepseek_v3").save_pretrained(saved)  # the Hub's layout: one tensor per expert projection
    shipped = load_file(os.path.join(saved, "model.safetensors"))
    target = from_hf_config(json.load(open(os.path.join(saved, "config.json"))))
    modules = init_mtp_params(MtpConfig.for_target(target, 1, "deepseek"), jax.random.key(6))["modules"]
    mtp = mtp_hf_tensors(modules, "deepseek", target, "float32", {k: v.numpy() for k, v in shipped.items()})
    shipped.update({name: torch.from_numpy(np.ascontiguousarray(value)) for name, value in mtp.items()})
    tensors, reference = {}, {}
    for name, tensor in shipped.items():
        if tensor.ndim == 2 and name.endswith(("_proj.weight", "_proj_with_mqa.weight")):
            q, scale, dequantized = block_fp8(tensor, 16)
            reference[name] = dequantized.contiguous()
            tensors[name], tensors[name + "_scale_inv"] = q, scale.contiguous()
        else:
            tensors[name] = reference[name] = tensor.contiguous()
    for directory, weights in ((hf_dir, tensors), (ref_dir, reference)):
        os.makedirs(directory)
        save_file(weights, os.path.join(directory, "model.safetensors"))
        shutil.copy(os.path.join(saved, "config.json"), directory)
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(ref_dir).eval()
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [16, 16]}
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(config, f)
    out = convert_hf_checkpoint(hf_dir, str(tmp_path / "jspec"), dtype="float32", progress=False)
    assert json.load(open(os.path.join(out, "jspec.json")))["quantization"]["scheme"] == "fp8"
    loaded, params, _ = load_llama(out)
    ids = np.random.default_rng(4).integers(0, loaded.vocab_size, (1, 20))
    with torch.no_grad():
        want = model(torch.tensor(ids)).logits.numpy()
    got = LlamaModel(loaded, scan_layers=False).apply(
        {"params": params}, jnp.asarray(ids), jnp.arange(20)[None],
        KVCache.for_model(loaded, 1, 20, jnp.float32, per_layer=True), jnp.zeros((1,), jnp.int32)).logits
    np.testing.assert_allclose(np.asarray(got), want, atol=ATOL, rtol=0)
    # its MTP module (layer 3 here, as DeepSeek ships layer 61) converts through the same reader
    converted = load_mtp(out)[1]["modules"][0]
    np.testing.assert_allclose(converted["input_proj"]["kernel"],
                               reference[f"model.layers.{target.num_layers}.eh_proj.weight"].numpy().T, rtol=1e-6)
    np.testing.assert_allclose(converted["block"]["mlp"]["experts"]["down_proj"]["kernel"][5],
                               reference[f"model.layers.{target.num_layers}.mlp.experts.5.down_proj.weight"].numpy().T,
                               rtol=1e-6)


def test_the_checkpoints_own_mtp_module_drafts_losslessly(tmp_path):
    """A DeepSeek-V3 checkpoint with its MTP module as DeepSeek ships it (layer num_hidden_layers: enorm, hnorm,
    eh_proj, a sparse latent-attention block with one tensor per expert, shared_head, the copies of the target's
    embedding and head) converts with the target; ``drafter="mtp"`` drafts with it through its own latent cache,
    as a chain (a tree of its top-k: the sampled test below), and greedy decoding equals plain decoding's."""
    import json
    import os

    from safetensors.numpy import load_file, save_file

    from models.checkpoint import convert_hf_checkpoint
    from models.checkpoint.hf_export import mtp_hf_tensors
    from models.mtp import MtpConfig, init_mtp_params
    from tests.hf_models import make_hf_model

    hf_dir = str(tmp_path / "hf")
    make_hf_model("deepseek_v3").save_pretrained(hf_dir)
    config = from_hf_config(json.load(open(os.path.join(hf_dir, "config.json"))))
    target = load_file(os.path.join(hf_dir, "model.safetensors"))
    modules = init_mtp_params(MtpConfig.for_target(config, 1, "deepseek"), jax.random.key(5))["modules"]
    shipped = mtp_hf_tensors(modules, "deepseek", config, "float32", target)
    assert f"model.layers.{config.num_layers}.mlp.experts.7.down_proj.weight" in shipped
    save_file({**target, **shipped}, os.path.join(hf_dir, "model.safetensors"))
    out = convert_hf_checkpoint(hf_dir, str(tmp_path / "jspec"), dtype="float32", progress=False)
    kwargs = dict(max_batch_size=4, max_seq_len=64)
    prompts = prompts_for(config.vocab_size)
    plain = jspec.SpecEngine.from_pretrained(out, **kwargs).generate(prompts, max_new_tokens=12).token_ids
    engine = jspec.SpecEngine.from_pretrained(out, drafter="mtp", spec=fx.SPECS["chain"], **kwargs)
    assert engine.setup.drafter.mtp.layout == "deepseek" and engine.setup.drafter.mtp.layer.mla
    assert engine.generate(prompts, max_new_tokens=12).token_ids == plain


# slow: MTP sampling on a DeepSeek-V3-shaped target (6,000 rows through latent attention and experts);
# default tier: the greedy MTP test above, test_mtp's sampling chi-square path on a dense target
@pytest.mark.slow
def test_mtp_sampling_follows_the_exact_target_distribution():
    """The checkpoint's kind of MTP module drafting a dynamic tree at temperature 1 for a DeepSeek-V3-shaped
    target (latent attention, grouped sigmoid routing, a shared expert, a dense first layer; V = 5): the first
    three tokens against the enumerated joint."""
    import dataclasses

    from jspec.drafters.mtp import MtpDrafter
    from models.llama import init_params
    from models.mtp import MtpConfig, init_mtp_params
    from tests.exact_distribution import assert_triples_follow, exact_triples, varied
    from tests.jspec import test_spec_sampling as sampling_tests

    target = dataclasses.replace(
        sampling_tests.TARGET, model_type="deepseek_v3", kv_lora_rank=8, qk_nope_head_dim=8, v_head_dim=8,
        rope_interleave=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, norm_topk_prob=True,
        router_scoring="sigmoid", router_groups=2, router_topk_groups=1, routed_scaling_factor=2.0,
        shared_expert_size=8, first_dense_layers=1)
    params = varied(init_params(target, jax.random.key(7)))
    config = MtpConfig.for_target(target, 1, "deepseek")
    modules = varied(init_mtp_params(config, jax.random.key(8)))
    spec = jspec.SpecConfig(tree="dynamic", num_steps=3, topk=2, num_draft_tokens=6)
    rows = 6000
    out = jspec.SpecEngine(target, params, drafter=MtpDrafter(config, target, spec, 16), drafter_params=modules,
                           max_batch_size=rows, max_seq_len=16).generate(
        [sampling_tests.PROMPT] * rows, max_new_tokens=3, temperature=1.0, seed=5)
    assert out.stats.acceptance_length > 1.1, out.stats
    assert_triples_follow(out.token_ids, exact_triples(target, params, sampling_tests.PROMPT))


# slow (one subprocess on 8 devices: 9 engines); default tier: the one-device tests above
@pytest.mark.slow
def test_tensor_and_expert_parallelism_give_one_devices_tokens():
    """tp 2 x dp 4 and tp 4 x ep 2 (tests/models/mla_mesh_cases.py): query heads and kv_b_proj split over "model",
    every device holding the whole latent cache its heads read; plain, n-gram and MTP speculation (the module split
    as the target's layers) = one device."""
    from tests.virtual_devices import run_on_virtual_devices

    report = run_on_virtual_devices("tests.models.mla_mesh_cases", 8)
    for method in ("plain", "ngram", "mtp"):
        for mesh in ("tp2xdp4", "tp4xep2"):
            assert report[f"{method}/{mesh}"]["tokens"] == report[f"{method}/one"]["tokens"], (method, mesh)
    assert report["plain/tp2xdp4"]["kv_b_spec"] == ["None", "model"]
    assert report["plain/tp4xep2"]["experts_spec"] == ["data", "None", "model"]


# slow (the server's programs with an MTP drafter compile); default tier: the checkpoint's MTP module drafting offline
@pytest.mark.slow
def test_served_mtp_requests_equal_generate_alone(converted):
    """DeepSeek's MTP module served: its own latent cache paged beside the target's (a zero-wide V each), four rows
    of chained drafts; every request returns what ``generate`` returns alone."""
    from jspec.drafters.mtp import MtpDrafter
    from jspec.serve.slots import SlotEngine
    from models.mtp import MtpConfig, init_mtp_params
    from tests.jspec.serve.test_slots import serve_all

    _, config, params, _ = converted
    mtp = MtpConfig.for_target(config, 1, "deepseek")
    engine = jspec.SpecEngine(config, params, drafter=MtpDrafter(mtp, config, fx.SPECS["chain"], 64),
                              drafter_params=init_mtp_params(mtp, jax.random.key(5)), max_batch_size=4,
                              max_seq_len=64)
    slots = SlotEngine(engine, max_seq_len=64, steps_per_chunk=2, adapt=False, row_buckets=(4,), block_size=8)
    slots.warm_up()
    assert {pool.name for pool in slots.layout.pools} >= {"target K/V", "MTP K/V"}
    slots.start()
    rng = np.random.default_rng(1)
    requests = [{"prompt_ids": rng.integers(2, 100, n).tolist(), "max_tokens": m}
                for n, m in ((5, 20), (17, 30), (9, 12), (30, 25), (3, 33))]
    try:
        served = serve_all(slots, requests)
    finally:
        slots.shutdown(10)
    for request, sink in zip(requests, served):
        assert sink.tokens == engine.generate([request["prompt_ids"]],
                                              max_new_tokens=request["max_tokens"]).token_ids[0]
