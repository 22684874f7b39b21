"""Logits processors (jspec/logits_processors.py): penalties, logit_bias, banned ids, min_tokens and ignore_eos.

Against transformers' ``generate`` with its matching processors (RepetitionPenaltyLogitsProcessor,
NoBadWordsLogitsProcessor, SequenceBiasLogitsProcessor, MinNewTokensLengthLogitsProcessor) on the bundled target
exported to Hugging Face format; speculative decoding with every bundled drafter equal to plain decoding with the
same processors (each tree node processed with its own path's history); the per-node path counts by hand. The
sampled case (chi-square against the enumerated processed distribution) is in test_spec_sampling.py.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jspec
from jspec.logits_processors import path_counts
from jspec.tools.bench import export_hf

PROMPTS = ["def fibonacci(n):", "import os\nclass Config:\n    def __init__(self", "x = [i * i for i in",
           "    return sorted("]
EOS = 2
PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3, logit_bias={10: 2.0, 20: -5.0},
                 banned_token_ids=[11], min_tokens=20)
DRAFTERS = {
    "eagle3": jspec.SpecConfig(tree="dynamic", num_steps=4, topk=4, num_draft_tokens=16),
    "draft": jspec.SpecConfig(tree="chain", num_steps=4),
    "ngram": jspec.SpecConfig(tree="chain", num_steps=5),
    "ngram+eagle3": jspec.SpecConfig(tree="chain", num_steps=5),
}


@pytest.fixture(scope="module")
def plain_engine():
    return jspec.SpecEngine.from_pretrained(jspec.bundled_model(), max_batch_size=4, max_seq_len=256,
                                              dtype="float32")


@pytest.fixture(scope="module")
def unprocessed(plain_engine):
    """Greedy plain decoding of PROMPTS without processors: the processed outputs must differ from it."""
    return plain_engine.generate(PROMPTS, max_new_tokens=40).token_ids


@pytest.fixture(scope="module")
def hf_target(tmp_path_factory):
    directory = export_hf(jspec.bundled_model(), str(tmp_path_factory.mktemp("hf") / "target"))
    return transformers.LlamaForCausalLM.from_pretrained(directory, torch_dtype=torch.float32).eval()


def hf_generate(model, prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=EOS, pad_token_id=EOS,
                             **kwargs)
    return out[0, len(prompt):].tolist()


# slow: [bias-min-tokens] (logit_bias and min_tokens equal transformers' SequenceBias and MinNewTokensLength);
# default tier: [repetition-banned], and test_app's served penalties with min_tokens equal offline
@pytest.mark.parametrize("case", ["repetition-banned", pytest.param("bias-min-tokens", marks=pytest.mark.slow)])
def test_plain_decoding_equals_transformers_processors(hf_target, plain_engine, unprocessed, case):
    """Repetition penalty 1.3 with banned tokens (HF: repetition_penalty, bad_words_ids); a bias of +8 on EOS with
    min_tokens 12 (HF: sequence_bias, min_new_tokens): EOS, alone within 8 tokens, is banned for 12, then comes."""
    if case == "repetition-banned":
        ours = dict(repetition_penalty=1.3, banned_token_ids=[11, 13])
        theirs = dict(repetition_penalty=1.3, bad_words_ids=[[11], [13]])
    else:
        ours = dict(logit_bias={EOS: 8.0}, min_tokens=12)
        theirs = dict(sequence_bias={(EOS,): 8.0}, min_new_tokens=12)
    out = plain_engine.generate(PROMPTS, max_new_tokens=40, **ours)
    for prompt, ids in zip(plain_engine.encode(PROMPTS), out.token_ids):
        assert ids == hf_generate(hf_target, prompt, 40, **theirs)
    if case == "bias-min-tokens":
        assert all(12 < len(ids) < 40 and ids[-1] == EOS for ids in out.token_ids)  # the bias and the ban both bit
        assert all(len(ids) <= 8 for ids in plain_engine.generate(PROMPTS, max_new_tokens=40,
                                                                   logit_bias={EOS: 8.0}).token_ids)
    else:
        assert not any(t in (11, 13) for ids in out.token_ids for t in ids) and out.token_ids != unprocessed


# slow: the draft model, n-gram and the hybrid under penalties equal plain decoding; default tier: the [eagle3] tree's
# (the same verify path)
@pytest.mark.parametrize("drafter", [pytest.param(name, marks=pytest.mark.slow) if name != "eagle3" else name
                                     for name in sorted(DRAFTERS)])
def test_speculative_equals_plain_with_the_same_processors(plain_engine, unprocessed, drafter):
    engine = jspec.SpecEngine.from_pretrained(jspec.bundled_model(), drafter=drafter, spec=DRAFTERS[drafter],
                                              max_batch_size=4, max_seq_len=256,
                                              dtype="float32")
    want = plain_engine.generate(PROMPTS, max_new_tokens=40, **PENALTIES)
    got = engine.generate(PROMPTS, max_new_tokens=40, **PENALTIES)
    assert got.token_ids == want.token_ids and want.token_ids != unprocessed
    assert got.stats.acceptance_length > 1.0 or drafter == "ngram"


def test_ignore_eos_runs_to_max_tokens(plain_engine):
    stopping = plain_engine.generate(PROMPTS, max_new_tokens=40, logit_bias={EOS: 30.0})
    assert all(ids == [EOS] for ids in stopping.token_ids)
    running = plain_engine.generate(PROMPTS, max_new_tokens=40, logit_bias={EOS: 30.0}, ignore_eos=True)
    assert all(len(ids) == 40 and set(ids) == {EOS} for ids in running.token_ids)


def test_path_counts_by_hand():
    """A tree root -> a (5) -> b (7), root -> c (5): b's path holds 5 and 7, a's 5, c's 5, the root's nothing."""
    tokens = jnp.asarray([[9, 5, 7, 5]])
    mask = jnp.asarray([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]]], bool)
    counts = np.asarray(path_counts(tokens, mask, 10))[0]
    expected = np.zeros((4, 10), np.int32)
    expected[1, 5] = expected[2, 5] = expected[2, 7] = expected[3, 5] = 1
    np.testing.assert_array_equal(counts, expected)


@pytest.mark.parametrize("kwargs, message", [
    (dict(presence_penalty=2.5), "presence_penalty=2.5: expected a number in \\[-2, 2\\]"),
    (dict(repetition_penalty=0.0), "repetition_penalty=0.0: expected a number in \\(0, 100\\]"),
    (dict(logit_bias={3: 101.0}), "logit_bias=\\{3: 101.0\\}: expected"),
    (dict(logit_bias={5000: 1.0}), "logit_bias has token id 5000, outside the vocabulary \\[0, 4096\\)"),
    (dict(banned_token_ids=[-1]), "banned_token_ids=\\(-1,\\): expected non-negative integers"),
    (dict(min_tokens=-1), "min_tokens=-1: expected an integer >= 0"),
])
def test_bad_processor_values_are_refused(plain_engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        plain_engine.generate(PROMPTS[:1], max_new_tokens=2, **kwargs)
