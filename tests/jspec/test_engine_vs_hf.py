"""engine.generate (drafter=None) equals transformers' greedy generate token-for-token, every family.

A batch of 3 prompts of different lengths runs in one engine call; transformers generates each prompt alone
(no padding), which is the output every batched engine must reproduce.
"""

import numpy as np
import pytest
import torch

import jspec
from tests.hf_models import FAMILIES, WINDOWED_FAMILIES

PROMPT_LENS = (3, 11, 6)


def hf_greedy(model, prompt, max_new_tokens, eos_token_id=None):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos_token_id, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompts_for(vocab_size, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, n).tolist() for n in PROMPT_LENS]


# slow: Mistral's and Qwen2's greedy generation = transformers'; default tier: [llama], [qwen3] (Qwen3-MoE's:
# test_llama_vs_hf's n-gram speculation on the converted model = transformers' greedy tokens; gpt-oss's and Gemma-3's:
# tests/models/test_windowed_families.py, past their windows)
@pytest.mark.parametrize("family", [pytest.param(family, marks=pytest.mark.slow) if family in ("mistral", "qwen2")
                                    else family for family in sorted(FAMILIES)
                                    if family not in ("qwen3_moe", "deepseek_v3") + WINDOWED_FAMILIES])
def test_greedy_matches_transformers(family, hf_checkpoint):
    model, _, out_dir = hf_checkpoint(family)
    model.generation_config.eos_token_id = None  # random weights: run to max_new_tokens on both sides
    engine = jspec.SpecEngine.from_pretrained(out_dir, max_batch_size=4, max_seq_len=64)
    engine = jspec.SpecEngine(engine.config, engine.params, max_batch_size=4, max_seq_len=64)  # no EOS ids
    prompts = prompts_for(model.config.vocab_size)
    out = engine.generate(prompts, max_new_tokens=12)
    for prompt, got in zip(prompts, out.token_ids):
        assert got == hf_greedy(model, prompt, 12)
    assert out.stats.acceptance_length == 1.0
    assert out.stats.num_verify_steps == 3 * 11


def test_stops_at_eos_like_transformers(hf_checkpoint):
    """Pick as EOS a token the greedy continuation emits mid-way: both stop right after it (kept)."""
    model, _, out_dir = hf_checkpoint("llama")
    loaded = jspec.SpecEngine.from_pretrained(out_dir, max_batch_size=4, max_seq_len=64)
    prompts = prompts_for(model.config.vocab_size, seed=1)
    free = hf_greedy(model, prompts[1], 16)
    eos = free[5]
    engine = jspec.SpecEngine(loaded.config, loaded.params, max_batch_size=4, max_seq_len=64,
                              eos_token_ids=(eos,))
    out = engine.generate(prompts, max_new_tokens=16)
    for prompt, got in zip(prompts, out.token_ids):
        assert got == hf_greedy(model, prompt, 16, eos_token_id=eos)
    assert out.token_ids[1][-1] == eos and len(out.token_ids[1]) <= 6
    # stop_token_ids given per call behave the same
    plain = jspec.SpecEngine(loaded.config, loaded.params, max_batch_size=4, max_seq_len=64)
    assert plain.generate(prompts, max_new_tokens=16, stop_token_ids=[eos]).token_ids == out.token_ids
