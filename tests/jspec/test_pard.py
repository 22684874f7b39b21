"""PARD (jspec/drafters/pard.py): K drafts from one causal forward over ``pard_token``s, equal to AMD's reading of
an ordinary causal pass over ``[prompt, root, pard, ...]``; greedy output equal to plain decoding for a chain and a
static tree; a converted PARD checkpoint (config.json ``pard_token``, ``spd_type``) loads as one."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.drafters.base import DrafterSource, PrefillContext
from jspec.drafters.pard import PardDrafter, default_spec, load
from models.attention import KVCache
from models.checkpoint import convert_hf_checkpoint, write_hf_llama
from models.llama import LlamaModel, init_params
from tests import spec_fixtures as fx
from tests.exact_distribution import PROMPT, TINY, assert_triples_follow, exact_triples, varied

RAGGED = [[5, 9, 13], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 41], [7] * 6]
PARD_TOKEN = 63
SPECS = {"chain": jspec.SpecConfig(tree="chain", num_steps=4),
         "static": jspec.SpecConfig(tree="static", tree_choices=((0,), (1,), (0, 0), (0, 1), (0, 0, 0)))}


@pytest.fixture(scope="module")
def models():
    """(target, a draft: the target with its attention damped differently, so drafts are partly accepted)."""
    target = fx.near_bigram_target()
    draft = jax.tree.map(lambda leaf: leaf, target)
    draft["layers"]["self_attn"]["o_proj"]["kernel"] = target["layers"]["self_attn"]["o_proj"]["kernel"] * 0.3
    return target, draft


def test_the_drafts_are_one_causal_forward_over_the_pard_tokens(models):
    target, draft = models
    drafter = PardDrafter(fx.TARGET, fx.TARGET, SPECS["chain"], 32, pard_token=PARD_TOKEN)
    prompts = np.array([[5, 9, 13, 2], [40, 41, 0, 0]], np.int32)
    lens, roots = np.array([4, 2], np.int32), np.array([17, 33], np.int32)
    state = drafter.prefill(target, draft, PrefillContext(jnp.asarray(prompts), jnp.asarray(lens),
                                                          jnp.asarray(roots), None))
    _, tree = drafter.propose(target, draft, state, jnp.asarray(roots), jnp.asarray(lens))
    for row in range(2):
        sequence = list(prompts[row, :lens[row]]) + [roots[row]] + [PARD_TOKEN] * 3
        cache = KVCache.zeros(fx.TARGET.num_layers, 1, len(sequence), fx.TARGET.num_kv_heads, fx.TARGET.head_dim,
                              jnp.float32)
        logits = LlamaModel(fx.TARGET).apply({"params": draft}, jnp.asarray([sequence]),
                                             jnp.arange(len(sequence))[None], cache, jnp.zeros((1,), jnp.int32)).logits
        want = np.argmax(np.asarray(logits[0, lens[row]:]), axis=-1).tolist()  # at the root and each pard token
        assert np.asarray(tree.tokens[row]).tolist() == [int(roots[row])] + want


# slow: [static] (PARD's per-position top-k static tree greedy = plain); default tier: [chain], test_dflash's [static]
# (the same per-position tree from one forward)
@pytest.mark.parametrize("tree", ["chain", pytest.param("static", marks=pytest.mark.slow)])
def test_greedy_output_equals_plain_decoding(models, tree):
    target, draft = models
    drafter = PardDrafter(fx.TARGET, fx.TARGET, SPECS[tree], fx.MAX_SEQ_LEN, pard_token=PARD_TOKEN)
    engine = jspec.SpecEngine(fx.TARGET, target, drafter=drafter, drafter_params=draft, max_batch_size=4,
                              max_seq_len=fx.MAX_SEQ_LEN)
    out = engine.generate(RAGGED, max_new_tokens=33)
    assert out.token_ids == fx.plain_engine(target).generate(RAGGED, max_new_tokens=33).token_ids
    assert out.stats.acceptance_length > 1.0, out.stats


# slow: a PARD chain sampled at T=1 follows the target's exact distribution (chi-square); default tier:
# test_spec_sampling (the same verify walk over deterministic drafts)
@pytest.mark.slow
def test_sampled_tokens_follow_the_exact_target_distribution():
    """A PARD chain of 3 at temperature 1 (the target drafting for itself: draft 1 often accepted, the pard
    positions' drafts less often): counts of (x1, x2, x3) over 12000 rows against the target's enumerated joint."""
    target = varied(init_params(TINY, jax.random.key(4)))
    rows, spec = 12000, jspec.SpecConfig(tree="chain", num_steps=3)
    drafter = PardDrafter(TINY, TINY, spec, 16, pard_token=TINY.vocab_size - 1)
    engine = jspec.SpecEngine(TINY, target, drafter=drafter, drafter_params=target, max_batch_size=rows,
                              max_seq_len=16)
    out = engine.generate([PROMPT] * rows, max_new_tokens=3, temperature=1.0, seed=3)
    assert 1.1 < out.stats.acceptance_length < spec.max_depth + 1  # drafts both accepted and rejected
    assert_triples_follow(out.token_ids, exact_triples(TINY, target, PROMPT))


def test_a_converted_pard_checkpoint_loads_as_pard(models, tmp_path):
    _, draft = models
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
          "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 8, "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "pard_token": PARD_TOKEN,
          "spd_type": "pard"}
    src = write_hf_llama(str(tmp_path / "hf"), hf, draft)
    path = convert_hf_checkpoint(src, str(tmp_path / "pard"), progress=False)
    assert default_spec(path) == jspec.SpecConfig(tree="chain", num_steps=8)
    from jspec.tools.bundled import default_spec as cli_default_spec
    assert cli_default_spec(path) == default_spec(path)  # jspec generate / serve --drafter DIR without tree flags
    drafter, _ = load(DrafterSource(path, fx.TARGET, None, SPECS["chain"], 64, "float32"))
    assert type(drafter) is PardDrafter and drafter.pard_token == PARD_TOKEN
    with open(os.path.join(src, "config.json")) as f:
        bad = dict(json.load(f), pard_token=None)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(bad, f)
    with pytest.raises(ValueError, match="pard_token=None"):
        load(DrafterSource(path, fx.TARGET, None, SPECS["chain"], 64, "float32"))
    with pytest.raises(ValueError, match="tree='dynamic'"):
        PardDrafter(fx.TARGET, fx.TARGET, jspec.SpecConfig(), 64, pard_token=PARD_TOKEN)
