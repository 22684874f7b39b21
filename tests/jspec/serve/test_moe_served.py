"""A mixture-of-experts target served: a gpt-oss checkpoint as the Hub ships it (bfloat16 shards, 4.x config.json,
a tokenizer) converted with ``jspec convert`` and served with n-gram speculation, paged KV and prefix caching: 16
concurrent requests through the official client, sharing a prefix, equal offline plain decoding alone. Its experts
carry biases, its attention sinks, and every other layer slides over a window of 16 positions, which the prompts
pass: the paged step programs read windows and sinks as the offline ones do, the sliding layers' K/V in a page
group of their own that keeps each request's window only."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch
import transformers

import jspec
from jspec.tools.cli import main as cli_main
from tests.hf_models import build_tokenizer, random_hf_model, write_as_shipped
from tests.jspec.serve.test_app import NAME, Server
from tests.models.test_shipped_targets import BASE_VOCAB, QWEN_CHAT, QWEN_IDS, QWEN_SPECIALS

# slow (a served MoE: its server's programs compile); default tier: test_moe's speculation on a MoE target equals
# plain decoding, test_app's served requests equal offline on the dense bundled model
pytestmark = pytest.mark.slow
PREFIX = "def add(a, b):\n    return a + b\n\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = transformers.GptOssConfig(
        vocab_size=BASE_VOCAB + len(QWEN_SPECIALS) + 13, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=16, max_position_embeddings=40960, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
        bos_token_id=QWEN_IDS["<|endoftext|>"], eos_token_id=QWEN_IDS["<|im_end|>"])
    root = tmp_path_factory.mktemp("gpt_oss")
    hf_dir, out_dir = str(root / "hf"), str(root / "jspec")
    random_hf_model(config).to(torch.bfloat16).save_pretrained(hf_dir, max_shard_size="100KB")
    build_tokenizer(BASE_VOCAB, QWEN_SPECIALS, bos=None, eos="<|im_end|>", pad="<|endoftext|>",
                    chat_template=QWEN_CHAT).save_pretrained(hf_dir)
    write_as_shipped(hf_dir)
    assert cli_main(["convert", "--src", hf_dir, "--dst", out_dir, "--dtype", "float32"]) == 0
    engine = jspec.SpecEngine.from_pretrained(out_dir, drafter="ngram", max_batch_size=16, max_seq_len=128)
    served = Server(max_batch_size=16, engine=engine, row_buckets=(16,), max_num_batched_tokens=64)
    yield served
    served.stop()


def test_sixteen_concurrent_requests_equal_offline(server):
    config = server.engine.config
    assert config.num_experts == 8 and config.attention_sinks and server.engine.setup.drafter is not None
    prompts = [PREFIX + f"def f{i}(x):\n    return x * {i}" for i in range(16)]
    assert min(len(server.engine.tokenizer.encode(p).ids) for p in prompts) > config.sliding_window

    def ask(prompt):
        return server.client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0).choices[0]

    first = ask(prompts[0])  # caches the shared prefix (16 arriving at once may all miss it)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        served = list(pool.map(ask, prompts))
    assert first.text == served[0].text
    offline = [server.plain.generate([prompt], max_new_tokens=16).texts[0] for prompt in prompts]
    assert [choice.text for choice in served] == offline
    assert server.metric("jspec:prefix_cache_hits_total") > 0  # the shared prefix came from the cache
    layout, blocks = server.slots.layout, server.slots.blocks  # the sliding layers' pages in their own group
    assert layout.window == 16 and blocks.window.num_used_pages == blocks.full.num_used_pages == 0
    assert server.served_compiles == []
