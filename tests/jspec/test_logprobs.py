"""Log-probabilities of generated tokens (jspec/logprobs.py, ``SpecEngine.generate(logprobs=K)``).

The oracle is transformers: the bundled target exported to Hugging Face format, run over each prompt and its
generated tokens in one teacher-forced forward, gives the log-softmax at every position; every token's
log-probability and the top K there must equal it, for plain decoding and for every drafter, greedy and sampled
(the values are the raw log-softmax, vLLM's default, not the temperature-scaled one). Under greedy decoding the
speculative and plain runs also equal each other token for token.
"""

import numpy as np
import pytest
import torch
import transformers

import jspec
from jspec.tools.bench import export_hf

TOL = 2e-5  # float32: a T-token verify pass and a 1-token decode step against torch's full forward
SPEC_TOL = dict(atol=1e-5, rtol=1e-5)  # float32: a verify pass of T tokens against a decode step of one
PROMPTS = ["def fibonacci(n):", "import os\nclass Config:\n    def __init__(self", "x = [i * i for i in",
           "    return sorted("]  # ragged lengths
NUM_TOP = 5
CODE_130 = "\n".join(f"value_{i} = compute({i}, scale=2)" for i in range(14))  # > 128 tokens
DRAFTERS = {  # drafter name -> the tree it verifies
    "eagle3": jspec.SpecConfig(tree="dynamic", num_steps=4, topk=4, num_draft_tokens=16),
    "draft": jspec.SpecConfig(tree="chain", num_steps=4),
    "ngram": jspec.SpecConfig(tree="chain", num_steps=5),
    "ngram+eagle3": jspec.SpecConfig(tree="chain", num_steps=5),
}


@pytest.fixture(scope="module")
def hf_target(tmp_path_factory):
    directory = export_hf(jspec.bundled_model(), str(tmp_path_factory.mktemp("hf") / "target"))
    return transformers.LlamaForCausalLM.from_pretrained(directory, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def plain_engine():
    return jspec.SpecEngine.from_pretrained(jspec.bundled_model(), max_batch_size=4, max_seq_len=256,
                                              dtype="float32")


def hf_log_softmax(model, prompt: list[int], generated: list[int]) -> np.ndarray:
    """f32[len(generated), V]: torch's log-softmax at the positions that predicted each generated token."""
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float(), dim=-1).numpy()


def assert_logprobs_are_the_targets(model, out, prompt_ids: list[list[int]], what: str) -> None:
    for b, (prompt, generated, got) in enumerate(zip(prompt_ids, out.token_ids, out.logprobs)):
        want = hf_log_softmax(model, prompt, generated)
        n = len(generated)
        assert got.token.shape == (n,) and got.top_ids.shape == got.top.shape == (n, NUM_TOP), what
        np.testing.assert_allclose(got.token, want[np.arange(n), generated], atol=TOL, err_msg=f"{what} row {b}")
        np.testing.assert_allclose(got.top, np.sort(want, axis=-1)[:, ::-1][:, :NUM_TOP], atol=TOL,
                                   err_msg=f"{what} row {b} top")
        np.testing.assert_allclose(np.take_along_axis(want, got.top_ids, axis=-1), got.top, atol=TOL,
                                   err_msg=f"{what} row {b}: top ids are the most likely tokens")


def test_plain_decoding_logprobs_equal_transformers(hf_target, plain_engine):
    out = plain_engine.generate(PROMPTS, max_new_tokens=24, logprobs=NUM_TOP)
    assert_logprobs_are_the_targets(hf_target, out, plain_engine.encode(PROMPTS), "plain")
    for got, ids in zip(out.logprobs, out.token_ids):
        assert got.top_ids[:, 0].tolist() == ids  # greedy: the chosen token is the most likely
    programs = len(plain_engine._compiled)
    fewer = plain_engine.generate(PROMPTS, max_new_tokens=24, logprobs=2)  # any K up to 20: the program above
    assert len(plain_engine._compiled) == programs
    for few, many in zip(fewer.logprobs, out.logprobs):
        assert few.top_ids.shape == (len(many.token), 2)
        np.testing.assert_array_equal(few.top_ids, many.top_ids[:, :2])
        np.testing.assert_array_equal(few.top, many.top[:, :2])


# slow: the draft model's, n-gram's and the hybrid's logprobs equal plain decoding's and transformers'; default tier:
# the [eagle3] tree's
@pytest.mark.parametrize("drafter", [pytest.param(name, marks=pytest.mark.slow) if name != "eagle3" else name
                                     for name in sorted(DRAFTERS)])
def test_speculative_logprobs_equal_plain_and_transformers(hf_target, plain_engine, drafter):
    engine = jspec.SpecEngine.from_pretrained(jspec.bundled_model(), drafter=drafter, spec=DRAFTERS[drafter],
                                              max_batch_size=4, max_seq_len=256,
                                              dtype="float32")
    out = engine.generate(PROMPTS, max_new_tokens=40, logprobs=NUM_TOP)
    plain = plain_engine.generate(PROMPTS, max_new_tokens=40, logprobs=NUM_TOP)
    assert out.token_ids == plain.token_ids and out.stats.acceptance_length > 1.5
    for got, want in zip(out.logprobs, plain.logprobs):
        np.testing.assert_allclose(got.token, want.token, **SPEC_TOL)
        np.testing.assert_allclose(got.top, want.top, **SPEC_TOL)
    assert_logprobs_are_the_targets(hf_target, out, engine.encode(PROMPTS), drafter)


# slow: sampled tokens' logprobs are the raw log-softmax; default tier: the greedy ones equal transformers'
# (test_plain_decoding_logprobs_equal_transformers, the [eagle3] speculative case)
@pytest.mark.slow
def test_sampled_logprobs_are_the_raw_log_softmax(hf_target):
    """At temperature 0.7 and top-k 8 the tokens are drawn from the processed distribution; the log-probabilities
    reported are still the target's raw log-softmax (vLLM's default), checked on whatever was drawn."""
    engine = jspec.SpecEngine.from_pretrained(jspec.bundled_model(), drafter="eagle3", spec=DRAFTERS["eagle3"],
                                              max_batch_size=4, max_seq_len=256,
                                              dtype="float32")
    out = engine.generate(PROMPTS, max_new_tokens=32, temperature=0.7, top_k=8, seed=3, logprobs=NUM_TOP)
    assert_logprobs_are_the_targets(hf_target, out, engine.encode(PROMPTS), "sampled eagle3")
    assert any(got.top_ids[:, 0].tolist() != ids for got, ids in zip(out.logprobs, out.token_ids))  # not greedy


def test_processed_logprobs_are_those_of_the_distribution_drawn_from(plain_engine):
    """vLLM's processed_logprobs at temperature 0.7 and top-k 8: the same tokens as raw_logprobs' run (one seed),
    each one's log-probability that of the tempered top-8 distribution, computed here from the raw top 10; the
    tokens outside the top 8 at -inf."""
    # 24 tokens: raw_logprobs runs the program test_plain_decoding_logprobs_equal_transformers compiled
    kwargs = dict(max_new_tokens=24, temperature=0.7, top_k=8, seed=5, logprobs=10)
    raw = plain_engine.generate(PROMPTS, **kwargs)
    processed = plain_engine.generate(PROMPTS, logprobs_mode="processed_logprobs", **kwargs)
    assert processed.token_ids == raw.token_ids
    for tokens, r, p in zip(raw.token_ids, raw.logprobs, processed.logprobs):
        kept = r.top[:, :8] / 0.7
        normal = np.log(np.exp(kept - kept.max(axis=1, keepdims=True)).sum(axis=1)) + kept.max(axis=1)
        np.testing.assert_allclose(p.token, r.token / 0.7 - normal, atol=1e-5, rtol=1e-5)
        np.testing.assert_array_equal(p.top_ids[:, :8], r.top_ids[:, :8])
        assert np.isneginf(p.top[:, 8:]).all()
    with pytest.raises(ValueError, match="logprobs_mode='processed': expected one of"):
        plain_engine.generate(PROMPTS, logprobs=1, logprobs_mode="processed")


# slow: logprobs=0 returns the chosen tokens' only; default tier: logprobs=5 through the engine and the server
@pytest.mark.slow
def test_zero_top_logprobs_keep_the_chosen_tokens_only(plain_engine):
    out = plain_engine.generate(PROMPTS[:1], max_new_tokens=3, logprobs=0)
    assert out.logprobs[0].token.shape == (3,) and out.logprobs[0].top_ids.shape == (3, 0)
    assert plain_engine.generate(PROMPTS[:1], max_new_tokens=3).logprobs is None


def test_bad_logprobs_values_are_refused_before_anything_compiles(plain_engine):
    compiled = plain_engine.num_compiled
    for bad in (-1, 4097, 2.0, True):
        with pytest.raises(ValueError, match=f"logprobs={bad!r}: expected None or an integer in \\[0, 4096\\]"):
            plain_engine.generate(PROMPTS[:1], max_new_tokens=2, logprobs=bad)
    assert plain_engine.num_compiled == compiled


def test_prompt_logprobs_equal_transformers(hf_target, plain_engine):
    """Each prompt token's log-probability after the tokens before it (vLLM's prompt_logprobs), ragged prompts,
    one longer than a POSITION_CHUNK of the scoring program."""
    prompts = PROMPTS[:3] + [CODE_130]
    out = plain_engine.generate(prompts, max_new_tokens=24, prompt_logprobs=NUM_TOP)
    for prompt, got in zip(plain_engine.encode(prompts), out.prompt_logprobs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = torch.log_softmax(hf_target(ids).logits[0, :-1].float(), dim=-1).numpy()
        n = len(prompt) - 1
        assert got.token.shape == (n,) and got.top.shape == (n, NUM_TOP)
        np.testing.assert_allclose(got.token, want[np.arange(n), prompt[1:]], atol=TOL)
        np.testing.assert_allclose(got.top, np.sort(want, axis=-1)[:, ::-1][:, :NUM_TOP], atol=TOL)
    assert out.logprobs is None
