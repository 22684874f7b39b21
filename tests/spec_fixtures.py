"""Tiny targets and EAGLE-3 heads for engine tests: a random head, and one distilled to high acceptance.

The "near-bigram" target (attention outputs scaled down, sharp lm_head) makes the next token mostly a function of
the current one, so a head distilled for a few seconds on the target's own samples reaches acceptance lengths > 2.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import pickle
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec.drafters.eagle3 import Eagle3Drafter
from jspec.train.eagle3_head import distill_eagle3_head, make_batch
from models.config import ModelConfig
from models.eagle3 import eagle3_config_from_hf, init_eagle3_params
from models.llama import init_params

TARGET = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                     num_kv_heads=2, head_dim=8)
HEAD = eagle3_config_from_hf({"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                              "num_key_value_heads": 2, "vocab_size": 64, "draft_vocab_size": 64})
SPECS = {
    "chain": jspec.SpecConfig(tree="chain", num_steps=4),
    "static": jspec.SpecConfig(tree="static", tree_choices=((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0),
                                                            (0, 0, 0, 0))),
    "dynamic": jspec.SpecConfig(tree="dynamic", num_steps=4, topk=3, num_draft_tokens=10),
}
MAX_SEQ_LEN = 128


def near_bigram_target(seed: int = 0) -> dict:
    params = init_params(TARGET, jax.random.key(seed))
    params["layers"]["self_attn"]["o_proj"]["kernel"] = params["layers"]["self_attn"]["o_proj"]["kernel"] * 0.05
    params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * 6.0
    return params


def random_head(seed: int = 1) -> dict:
    return {"head": init_eagle3_params(HEAD, jax.random.key(seed)), "d2t": jnp.zeros((64,), jnp.int32)}


def _session_file(name: str) -> str:
    """A path shared by this test session's processes (xdist workers run under one PYTEST_XDIST_TESTRUNUID), in
    a directory of its own per session: nothing outlives the run it was made in."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
    directory = os.path.join(tempfile.gettempdir(), f"jspec-tests-{run}")
    os.makedirs(directory, exist_ok=True)
    return os.path.join(directory, name)


def distilled_head(params_t: dict, steps: int = 80) -> dict:
    """The head trained on 32 sampled continuations of the target (temperature 1). Distilled once per test session
    for given (target weights, steps): the modules that use it share the result through a file."""
    digest = hashlib.sha1(b"".join(np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(params_t)))
    path = _session_file(f"distilled-head-{steps}-{digest.hexdigest()}.pkl")
    # One process distils, the others wait for its file (xdist workers reach their modules that need it at once).
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                return jax.tree.map(jnp.asarray, pickle.load(f))
        head = _distill_head(params_t, steps)
        with open(path + f".{os.getpid()}.tmp", "wb") as f:
            pickle.dump(jax.tree.map(np.asarray, head), f)
        os.replace(path + f".{os.getpid()}.tmp", path)
    return head


def _distill_head(params_t: dict, steps: int) -> dict:
    plain = jspec.SpecEngine(TARGET, params_t, max_batch_size=32, max_seq_len=MAX_SEQ_LEN)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, TARGET.vocab_size, 4).tolist() for _ in range(32)]
    generated = plain.generate(prompts, max_new_tokens=44, temperature=1.0).token_ids
    sequences = np.array([p + g for p, g in zip(prompts, generated)], np.int32)
    batch = make_batch(params_t, TARGET, sequences, np.full(len(sequences), sequences.shape[1]))
    head, _ = distill_eagle3_head(init_eagle3_params(HEAD, jax.random.key(1)), params_t, batch, config=HEAD,
                                  steps=steps, learning_rate=1e-2, unroll=2)
    return {"head": head, "d2t": jnp.zeros((64,), jnp.int32)}


def spec_engine(params_t, params_d, tree: str, max_batch_size: int = 4, **kwargs) -> jspec.SpecEngine:
    drafter = Eagle3Drafter(HEAD, TARGET, SPECS[tree], MAX_SEQ_LEN)
    return jspec.SpecEngine(TARGET, params_t, drafter=drafter, drafter_params=params_d,
                            max_batch_size=max_batch_size, max_seq_len=MAX_SEQ_LEN, **kwargs)


def plain_engine(params_t, max_batch_size: int = 4, **kwargs) -> jspec.SpecEngine:
    return jspec.SpecEngine(TARGET, params_t, max_batch_size=max_batch_size, max_seq_len=MAX_SEQ_LEN, **kwargs)
