"""The DFlash draft network (models/dflash.py) and its converter (models/checkpoint/hf_dflash.py) against a torch
reference of z-lab's DFlashDraftModel (tests/models/dflash_reference.py): a checkpoint written under the publisher's
tensor names converts, and a block over a context cached in pieces, per row at its own length, equals the
reference's forward over the whole context."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen3 import modeling_qwen3 as qwen3

import jspec
from models.attention import KVCache
from models.checkpoint import checkpoint_kind, convert_hf_checkpoint, load_dflash
from models.config import ModelConfig
from models.dflash import DFlashDraft, default_target_layer_ids, dflash_config_from_hf
from tests.models.dflash_reference import DFlashReference, DSparkReference
from tests.models.test_eagle3 import write_hf_dir

HF = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64,
      "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512, "attention_bias": False,
      "tie_word_embeddings": False, "block_size": 4, "num_target_layers": 4, "torch_dtype": "float32",
      "dflash_config": {"mask_token_id": 63, "target_layer_ids": [0, 2]}}
BLOCK = HF["block_size"]
DSPARK_HF = {**{k: v for k, v in HF.items() if k not in ("dflash_config", "num_target_layers")},
             "architectures": ["Qwen3DSparkModel"], "mask_token_id": 63, "target_layer_ids": [-1, 2],
             "markov_rank": 8, "markov_head_type": "vanilla", "enable_confidence_head": True,
             "confidence_head_with_markov": True, "num_anchors": 512}
TARGET = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                     head_dim=8)


def write_zlab(directory, hf: dict, tensors: dict) -> str:
    """config.json + model.safetensors, as the publishers' save_pretrained writes them."""
    return write_hf_dir(directory, tensors, hf)


@pytest.fixture(scope="module")
def reference() -> DFlashReference:
    return make_reference()


def make_reference() -> DFlashReference:
    """z-lab's DFlashDraftModel (the torch replica) of :data:`HF`, random weights, norms not all ones."""
    torch.manual_seed(0)
    model = DFlashReference(qwen3.Qwen3Config(**HF), num_context_layers=2).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # not all ones, so a norm applied to the wrong tensor shows
                param.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def converted_dir(reference, tmp_path_factory):
    work = tmp_path_factory.mktemp("dflash")
    src = write_zlab(work / "hf", HF, reference.tensors())
    assert checkpoint_kind(src) == "dflash"
    return convert_hf_checkpoint(src, str(work / "jspec"), progress=False)


@pytest.fixture(scope="module")
def converted(converted_dir):
    return load_dflash(converted_dir)[:2]


def test_a_converted_directory_drafts_its_whole_block_by_default_and_auto_weighs_half_of_it_too(converted_dir):
    from jspec import auto
    from jspec.drafters import dflash

    assert dflash.default_spec(converted_dir) == jspec.SpecConfig(tree="chain", num_steps=BLOCK - 1)
    assert auto.candidate_specs(converted_dir) == (jspec.SpecConfig(tree="chain", num_steps=1),
                                                   jspec.SpecConfig(tree="chain", num_steps=BLOCK - 1))


def test_a_block_over_a_context_cached_in_pieces_equals_the_publishers_forward(reference, converted):
    config, params = converted
    model = DFlashDraft(config)
    rng = np.random.default_rng(0)
    lengths = [7, 5]  # each row's context, cached as 3 then 4 tokens: row 1's last 2 lie past its length, unread
    features = rng.normal(size=(2, 7, 2 * 32)).astype(np.float32)
    embeds = rng.normal(size=(2, BLOCK, 32)).astype(np.float32)
    layer = config.layer
    cache = KVCache.zeros(layer.num_layers, 2, 16, layer.num_kv_heads, layer.head_dim, jnp.float32, per_layer=True)
    for start, width in ((np.array([0, 0]), 3), (np.array([3, 3]), 4)):
        positions = start[:, None] + np.arange(width)[None]
        piece = np.take_along_axis(features, np.minimum(positions, 6)[:, :, None], axis=1)
        cache = model.apply({"params": params}, piece, positions, cache, start, method=DFlashDraft.context)
    lens = np.array(lengths)
    out, _ = model.apply({"params": params}, embeds, lens[:, None] + np.arange(BLOCK)[None], cache, lens)
    for row, length in enumerate(lengths):
        with torch.no_grad():
            want = reference(torch.from_numpy(embeds[row:row + 1]), torch.from_numpy(features[row:row + 1, :length]),
                             torch.arange(length + BLOCK)[None])
        np.testing.assert_allclose(np.asarray(out[row]), want[0].numpy(), atol=2e-5, rtol=1e-5)


def test_default_layer_ids_follow_the_publishers_rule():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # Qwen3-8B's shipped ids
    assert default_target_layer_ids(36, 1) == (18,)
    hf = {**HF, "dflash_config": {"mask_token_id": 63}}  # no ids: derived from num_target_layers
    assert dflash_config_from_hf(hf).target_layer_ids == default_target_layer_ids(4, 2)


@pytest.mark.parametrize("change, message", [
    ({"dflash_config": {"mask_token_id": 63, "target_layer_ids": [0, 2], "use_swa": True}}, "use_swa=True"),
    ({"causal": True}, "causal=True"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding_attention"),
    ({"block_size": 1}, "block_size=1"),
    ({"dflash_config": {"target_layer_ids": [0, 2]}}, "mask_token_id=None"),
    ({"dflash_config": {"mask_token_id": 64, "target_layer_ids": [0, 2]}}, "mask_token_id=64"),
])
def test_options_jspec_does_not_implement_are_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        dflash_config_from_hf({**HF, **change})


def test_a_target_layer_past_the_last_is_refused():
    config = dflash_config_from_hf({**HF, "dflash_config": {"mask_token_id": 63, "target_layer_ids": [0, 3]}})
    target = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                         num_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match=r"\[3\] must be below the target's last layer 3"):
        config.check_target(target)
    assert dflash_config_from_hf(HF).tap_layers(target) == (1, 3)


def test_a_drafter_with_its_own_lm_head_is_refused_and_nothing_is_written(reference, tmp_path):
    tensors = {**reference.tensors(), "lm_head.weight": torch.zeros(64, 32)}
    src = write_zlab(tmp_path / "hf", HF, tensors)
    with pytest.raises(ValueError, match="lm_head.weight"):
        convert_hf_checkpoint(src, str(tmp_path / "out"), progress=False)
    assert not os.path.exists(tmp_path / "out")
    missing = {k: v for k, v in reference.tensors().items() if k != "layers.1.self_attn.k_norm.weight"}
    with pytest.raises(ValueError, match="k_norm"):
        convert_hf_checkpoint(write_zlab(tmp_path / "hf2", HF, missing), str(tmp_path / "out"), progress=False)


def test_dspark_converts_and_drafts_deepspecs_greedy_chain(tmp_path):
    """DeepSpec's layout (the knobs at top level, -1 for the embedding output, frozen embedding / lm_head copies
    dropped): every slot drafts, and the Markov scan and confidence logits equal DeepSpec's slot-by-slot loop."""
    from jspec.drafters.dflash import DFlashDrafter

    torch.manual_seed(1)
    reference = DSparkReference(qwen3.Qwen3Config(**DSPARK_HF), num_context_layers=2, markov_rank=8).eval()
    src = write_zlab(tmp_path / "hf", DSPARK_HF, reference.tensors())
    assert checkpoint_kind(src) == "dflash"
    config, params, _ = load_dflash(convert_hf_checkpoint(src, str(tmp_path / "jspec"), progress=False))
    assert (config.layout, config.num_drafts, config.tap_layers(TARGET)) == ("dspark", BLOCK, (0, 3))
    drafter = DFlashDrafter(config, TARGET, jspec.SpecConfig(tree="chain", num_steps=BLOCK), 32)
    normed = np.random.default_rng(2).normal(size=(3, BLOCK, 32)).astype(np.float32)
    root = np.array([5, 17, 63])
    kernel = reference.lm_head.weight.detach().numpy().T
    tokens, confidence = drafter._markov_chain(params, normed, normed @ kernel, root)
    with torch.no_grad():
        want_tokens, want_confidence = reference.draft_chain(torch.from_numpy(normed), torch.from_numpy(root))
    assert np.asarray(tokens).tolist() == want_tokens.tolist()
    np.testing.assert_allclose(np.asarray(confidence), want_confidence.numpy(), atol=1e-5)


def test_dspark_options_jspec_does_not_implement_are_refused(tmp_path):
    with pytest.raises(ValueError, match="markov_head_type='gated'"):
        dflash_config_from_hf({**DSPARK_HF, "markov_head_type": "gated"})
    torch.manual_seed(1)
    tensors = DSparkReference(qwen3.Qwen3Config(**DSPARK_HF), num_context_layers=2, markov_rank=8).tensors()
    tensors["lm_head.weight"] = torch.zeros(64, 16)  # not a copy of a [V, H] lm_head
    with pytest.raises(ValueError, match=r"DSpark tensor lm_head.weight: got \(64, 16\)"):
        convert_hf_checkpoint(write_zlab(tmp_path / "hf", DSPARK_HF, tensors), str(tmp_path / "out"), progress=False)
    assert not os.path.exists(tmp_path / "out")
