"""The speculative engine with an EAGLE-3 drafter: lossless greedy output for every tree kind, statistics,
streaming, and the checkpoint path (HF-layout head -> converter -> from_pretrained)."""

import functools

import numpy as np
import pytest

import jspec
from models.checkpoint import convert_hf_checkpoint, convert_hf_llama, write_hf_eagle3, write_hf_llama
from tests import spec_fixtures as fx

RAGGED = [[5, 9, 13], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 41], [7] * 6]


@pytest.fixture(scope="module")
def target():
    return fx.near_bigram_target()


@pytest.fixture(scope="module")
def heads(target):
    return {"random": fx.random_head(), "distilled": fx.distilled_head(target)}


@pytest.fixture(scope="module")
def plain_output(target):
    """max_new_tokens -> plain decoding's output of RAGGED, generated when first asked for (the default tier asks
    for 33 only: one program)."""
    engine = fx.plain_engine(target)
    return functools.lru_cache(lambda n: engine.generate(RAGGED, max_new_tokens=n).token_ids)


# slow: EAGLE-3 greedy = plain for every tree (chain, static, dynamic), with a random head (drafts mostly rejected) and
# a distilled one (real acceptance); default tier: test_stops_at_eos_inside_an_accepted_run[chain] and [dynamic] (greedy
# = plain, distilled head), the bundled head's real acceptance in test_tree_selection and test_hybrid, the static tree
# arrays in test_trees and tree_build's kernel tests
@pytest.mark.slow
@pytest.mark.parametrize("tree", sorted(fx.SPECS))
@pytest.mark.parametrize("head", ["random", "distilled"])
def test_greedy_output_equals_plain_decoding(target, heads, plain_output, tree, head):
    """The random head's drafts are mostly rejected, the distilled head's mostly accepted; the distilled engine
    also runs each request at batch 1 (another batch bucket)."""
    engine = fx.spec_engine(target, heads[head], tree)
    for max_new_tokens in (1, 7, 33):
        expected = plain_output(max_new_tokens)
        out = engine.generate(RAGGED, max_new_tokens=max_new_tokens)
        assert out.token_ids == expected, (tree, head, max_new_tokens)
        if head == "distilled":
            single = engine.generate(RAGGED[1:2], max_new_tokens=max_new_tokens)  # batch 1
            assert single.token_ids == expected[1:2]
    # batch buckets ({4, 1} distilled, {4} random) x sequence buffers {32, 64} (16 + 1, 16 + 7 | 16 + 33)
    assert engine.num_compiled == (4 if head == "distilled" else 2)
    if head == "distilled":
        assert out.stats.acceptance_length > 1.5, out.stats  # multi-token acceptance really is exercised


# slow: [static] (EAGLE-3 stops at EOS inside an accepted run of a static tree); default tier: [chain], [dynamic]
@pytest.mark.parametrize("tree", [pytest.param(tree, marks=pytest.mark.slow) if tree == "static" else tree
                                  for tree in sorted(fx.SPECS)])
def test_stops_at_eos_inside_an_accepted_run(target, heads, plain_output, tree):
    """EOS = a token that plain decoding emits mid-way; a step accepting past it is cut right after it."""
    expected_free = plain_output(33)
    eos = expected_free[1][9]
    plain = fx.plain_engine(target, eos_token_ids=(eos,)).generate(RAGGED, max_new_tokens=33).token_ids
    assert plain[1][-1] == eos and len(plain[1]) <= 10
    spec = fx.spec_engine(target, heads["distilled"], tree, eos_token_ids=(eos,))
    assert spec.generate(RAGGED, max_new_tokens=33).token_ids == plain


def test_acceptance_statistics_with_forced_acceptance(target, heads):
    """Forcing every draft to be accepted: each step commits num_steps + 1 tokens."""
    steps = fx.SPECS["chain"].num_steps
    engine = fx.spec_engine(target, heads["random"], "chain", force_accept=steps)
    out = engine.generate(RAGGED, max_new_tokens=1 + 5 * (steps + 1))
    assert out.stats.acceptance_length == steps + 1
    assert out.stats.accepted_per_position == [1.0] * steps
    assert out.stats.num_verify_steps == 4 * 5
    assert all(len(t) == 1 + 5 * (steps + 1) for t in out.token_ids)


def test_acceptance_statistics_are_consistent(target, heads):
    out = fx.spec_engine(target, heads["distilled"], "dynamic").generate(RAGGED, max_new_tokens=33)
    stats = out.stats
    generated = sum(len(t) for t in out.token_ids)
    assert stats.acceptance_length == pytest.approx((generated - len(RAGGED)) / stats.num_verify_steps)
    rates = stats.accepted_per_position
    assert all(a >= b for a, b in zip(rates, rates[1:])) and rates[0] > 0
    assert stats.acceptance_length == pytest.approx(1 + sum(rates), rel=0.05)  # cut final steps aside


# slow: [chain] (stream = generate for a chain); default tier: [dynamic]
@pytest.mark.parametrize("tree", [pytest.param("chain", marks=pytest.mark.slow), "dynamic"])
def test_stream_concatenates_to_generate(target, heads, tree):
    engine = fx.spec_engine(target, heads["distilled"], tree)
    chunks = list(engine.stream(RAGGED, max_new_tokens=21, steps_per_chunk=2))
    joined = [sum((chunk[b] for chunk in chunks), []) for b in range(len(RAGGED))]
    assert joined == engine.generate(RAGGED, max_new_tokens=21).token_ids
    assert len(chunks) > 2


# slow: a converted HF head through from_pretrained = plain; default tier: test_eagle3_layouts (every layout converts to
# the same head) and test_train_drafter's exported head driving the engine
@pytest.mark.slow
def test_from_pretrained_with_a_converted_head(target, heads, tmp_path):
    """HF-layout target and head -> converter -> from_pretrained(target, drafter=head): same output."""
    target_hf = write_hf_llama(str(tmp_path / "target_hf"), _target_hf_config(), target)
    convert_hf_llama(target_hf, str(tmp_path / "target"), progress=False)
    head_hf = write_hf_eagle3(str(tmp_path / "head_hf"), _head_hf_config(), heads["distilled"]["head"],
                              np.zeros(64, np.int64))
    convert_hf_checkpoint(head_hf, str(tmp_path / "head"), progress=False)
    engine = jspec.SpecEngine.from_pretrained(tmp_path / "target", drafter=tmp_path / "head",
                                              spec=fx.SPECS["dynamic"], max_batch_size=4, max_seq_len=128)
    plain = jspec.SpecEngine.from_pretrained(tmp_path / "target", max_batch_size=4, max_seq_len=128)
    assert engine.generate(RAGGED, max_new_tokens=20).token_ids == plain.generate(RAGGED, max_new_tokens=20).token_ids


def _target_hf_config():
    cfg = fx.TARGET
    return {"model_type": "llama", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
            "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta}


def _head_hf_config():
    return {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 32, "intermediate_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "draft_vocab_size": 64,
            "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "max_position_embeddings": 512}


def test_head_for_another_target_is_refused(target):
    from jspec.drafters.eagle3 import Eagle3Drafter
    from models.eagle3 import eagle3_config_from_hf
    wrong = eagle3_config_from_hf({"hidden_size": 48, "intermediate_size": 64, "num_attention_heads": 4,
                                   "vocab_size": 64})
    with pytest.raises(ValueError, match="hidden_size=48"):
        Eagle3Drafter(wrong, fx.TARGET, fx.SPECS["chain"], 128)
