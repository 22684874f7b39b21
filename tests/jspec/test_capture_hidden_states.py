"""Hidden-state capture (``generate(..., capture_hidden_states=layers)``): the target's residual-stream states at
the chosen layers for every token of each sequence, gathered inside the one generate program.

Oracle: transformers' ``output_hidden_states`` on each full prompt + generated sequence (index num_layers: a
forward hook on the last decoder layer, before the final norm), float32, atol 1e-4. Plain decoding and speculative
engines (n-gram lookup; the target as its own draft model, so drafts are accepted at dynamic-tree nodes off the
first branch; an EAGLE-3 head whose own taps overlap the captured layers) give the same states, and their tokens
do not change. On a dp 2 x tp 2 mesh (4 virtual CPU devices, in a subprocess) the states equal one device's.
"""

import dataclasses
import json

import jax
import numpy as np
import pytest
import torch

import jspec
from jspec.generate import generate_continue, generate_start
from jspec.sampling import SamplingArrays
from models.attention import KVCache
from models.llama import LlamaModel
from tests import spec_fixtures as fx
from tests.program_structure import CALLBACK_PRIMITIVES, all_primitives, top_level_eqns
from tests.virtual_devices import run_on_virtual_devices

ATOL = 1e-4
# ragged, repetitive (n-gram lookup finds matches); batch 3 -> a bucket of 4 (one padding row)
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 9, 10, 11, 12, 9, 10, 11], [3, 4, 3]]
MAX_NEW_TOKENS = 12


def capture_layers(num_layers: int) -> tuple[int, ...]:
    """(num_layers, 0, 1, num_layers // 2, ...) deduplicated: out of order on purpose."""
    return tuple(dict.fromkeys((num_layers, 0, 1, num_layers // 2, num_layers - 1)))


def hf_states(model, sequence: list[int], layers: tuple[int, ...]) -> np.ndarray:
    """[len(layers), len(sequence), H] transformers' hidden states; index num_layers before the final norm."""
    last_output = []
    hook = model.model.layers[-1].register_forward_hook(
        lambda module, args, out: last_output.append((out[0] if isinstance(out, tuple) else out).detach()))
    with torch.no_grad():
        hidden = list(model(torch.tensor([sequence]), output_hidden_states=True).hidden_states)
    hook.remove()
    hidden[len(model.model.layers)] = last_output[0]
    return np.stack([hidden[layer][0].numpy() for layer in layers])


@pytest.fixture(scope="module")
def checkpoint(hf_checkpoint):
    model, _, out_dir = hf_checkpoint("llama")
    return model, out_dir


@pytest.fixture(scope="module")
def plain_tokens(checkpoint):
    engine = jspec.SpecEngine.from_pretrained(checkpoint[1], max_batch_size=4, max_seq_len=64)
    return engine.generate(PROMPTS, max_new_tokens=MAX_NEW_TOKENS).token_ids


ENGINES = {
    "plain": lambda out_dir: dict(drafter=None),
    "ngram": lambda out_dir: dict(drafter="ngram", spec=jspec.SpecConfig(tree="chain", num_steps=3)),
    "self_draft_dynamic": lambda out_dir: dict(
        drafter=out_dir, spec=jspec.SpecConfig(tree="dynamic", num_steps=3, topk=2, num_draft_tokens=6)),
}


# slow: hidden states captured during n-gram and dynamic-tree speculation = transformers; default tier: [plain]
@pytest.mark.parametrize("kind", [pytest.param(kind, marks=pytest.mark.slow) if kind != "plain" else kind
                                  for kind in sorted(ENGINES)])
def test_captured_states_match_transformers(checkpoint, plain_tokens, kind):
    model, out_dir = checkpoint
    engine = jspec.SpecEngine.from_pretrained(out_dir, max_batch_size=4, max_seq_len=64, **ENGINES[kind](out_dir))
    layers = capture_layers(engine.config.num_layers)
    out = engine.generate(PROMPTS, max_new_tokens=MAX_NEW_TOKENS, capture_hidden_states=layers)
    assert out.token_ids == plain_tokens
    if kind == "self_draft_dynamic":
        assert out.stats.acceptance_length > 2.0, out.stats  # multi-token commits really are exercised
    if kind == "ngram":
        assert out.stats.acceptance_length > 1.0, out.stats
    assert len(out.hidden_states) == len(PROMPTS)
    for prompt, new, states in zip(PROMPTS, out.token_ids, out.hidden_states):
        sequence = prompt + new
        assert states.dtype == np.float32
        assert states.shape == (len(layers), len(sequence), engine.config.hidden_size)
        np.testing.assert_allclose(states, hf_states(model, sequence, layers), atol=ATOL, rtol=0)


# slow: an EAGLE-3 head keeps its own taps while the caller captures others; default tier: capture [plain],
# [self_draft_dynamic]
@pytest.mark.slow
def test_eagle3_head_keeps_its_taps_while_capturing():
    """The head reads layers (2, 2, 1) of the 4-layer target; capturing (4, 2, 0) beside them changes neither the
    tokens nor the head's state (its K/V are built from its taps: the same after prefill and a few steps), and the
    states equal one full causal forward pass."""
    params = fx.near_bigram_target()
    engine = fx.spec_engine(params, fx.random_head(), "chain")
    layers = (4, 2, 0)
    prompts = [[5, 9, 13, 5, 9], [1, 2, 3, 4, 5, 6, 7], [40]]
    without = engine.generate(prompts, max_new_tokens=20)
    out = engine.generate(prompts, max_new_tokens=20, capture_hidden_states=layers)
    assert out.token_ids == without.token_ids
    assert out.stats.num_verify_steps == without.stats.num_verify_steps
    assert without.hidden_states is None
    for prompt, new, states in zip(prompts, out.token_ids, out.hidden_states):
        sequence = np.asarray([prompt + new])
        cache = KVCache.zeros(fx.TARGET.num_layers, 1, sequence.shape[1], fx.TARGET.num_kv_heads,
                              fx.TARGET.head_dim, np.float32)
        full = LlamaModel(fx.TARGET).apply({"params": params}, sequence, np.arange(sequence.shape[1])[None], cache,
                                           np.zeros((1,), np.int32), tap_layers=layers)
        np.testing.assert_allclose(states, np.asarray(full.taps[:, 0]), atol=ATOL, rtol=0)

    setup = engine.setup.with_max_seq_len(32)
    drafts = []
    for capture in ((), layers):
        run = dataclasses.replace(setup, capture_layers=capture)
        state, inputs = generate_start(*generate_args(engine), setup=run)
        state = generate_continue(engine.params, engine.drafter_params, state, inputs, np.int32(3), setup=run)
        drafts.append(state.draft)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0), *drafts)


def generate_args(engine, b=2):
    """jspec.generate's arguments for b rows of 16-wide prompts (greedy, 8 new tokens)."""
    sampling = SamplingArrays(np.zeros((b,), np.float32), np.zeros((b,), np.int32), np.ones((b,), np.float32))
    prompts = np.arange(b * 16, dtype=np.int32).reshape(b, 16) % fx.TARGET.vocab_size
    return (engine.params, engine.drafter_params, prompts, np.arange(5, 5 + b, dtype=np.int32), jax.random.key(0),
            np.full((b,), 8, np.int32), np.full((b, 1), -1, np.int32), sampling)


@pytest.mark.parametrize("layers, match", [((0, 0), "repeats"), ((-1,), r"0\.\.3"), ((4,), r"0\.\.3"),
                                           ((1.0,), "layer indices"), ("12", "sequence")])
def test_bad_layer_lists_raise(checkpoint, layers, match):
    engine = jspec.SpecEngine.from_pretrained(checkpoint[1], max_batch_size=4, max_seq_len=64)
    with pytest.raises(ValueError, match=match):
        engine.generate(PROMPTS, max_new_tokens=2, capture_hidden_states=layers)
    assert engine.num_compiled == 0


def test_setup_takes_a_tuple_of_valid_layers():
    with pytest.raises(ValueError, match="tuple"):
        jspec.GenerateSetup(fx.TARGET, 32, capture_layers=[0, 1])
    with pytest.raises(ValueError, match=r"capture_layers has 5"):
        jspec.GenerateSetup(fx.TARGET, 32, capture_layers=(0, 5))
    assert jspec.GenerateSetup(fx.TARGET, 32, capture_layers=(4, 0)).tap_layers == (4, 0)


def test_capture_program_is_one_loop_without_host_callbacks():
    engine = fx.spec_engine(fx.near_bigram_target(), fx.random_head(), "chain")
    setup = jspec.GenerateSetup(fx.TARGET, 32, drafter=engine.setup.drafter.with_max_seq_len(32),
                                capture_layers=(4, 0))
    args = generate_args(engine)
    jaxpr = jax.make_jaxpr(lambda *a: jspec.generate(*a, setup=setup))(*args).jaxpr
    loops = [e for e in top_level_eqns(jaxpr) if e.primitive.name == "while"]
    assert len(loops) == 1
    assert not set(all_primitives(jaxpr)) & set(CALLBACK_PRIMITIVES)
    hidden = jax.eval_shape(lambda *a: jspec.generate(*a, setup=setup), *args).hidden_states
    assert hidden.shape == (2, 2, 32, fx.TARGET.hidden_size)


MESH_PROMPTS = [[5, 9, 13, 5, 9], [1, 2, 3, 4, 5, 6, 7], [40]]


def mesh_case() -> dict:
    """Run with 4 devices: an EAGLE-3 chain engine on a dp 2 x tp 2 mesh and on one device, capturing (4, 2, 0)."""
    from jspec.drafters.eagle3 import Eagle3Drafter
    from jspec.sharding import make_mesh

    params, head = fx.near_bigram_target(), fx.random_head()
    outs = []
    for mesh in (None, make_mesh(tensor_parallel_size=2, data_parallel_size=2)):
        drafter = Eagle3Drafter(fx.HEAD, fx.TARGET, fx.SPECS["chain"], fx.MAX_SEQ_LEN)
        engine = jspec.SpecEngine(fx.TARGET, params, drafter=drafter, drafter_params=head, max_batch_size=4,
                                  max_seq_len=fx.MAX_SEQ_LEN, mesh=mesh)
        outs.append(engine.generate(MESH_PROMPTS, max_new_tokens=12, capture_hidden_states=(4, 2, 0)))
    single, sharded = outs
    return {"same_tokens": single.token_ids == sharded.token_ids,
            "shapes": [list(a.shape) for a in sharded.hidden_states],
            "max_diff": max(float(np.abs(a - b).max()) for a, b in zip(single.hidden_states, sharded.hidden_states))}


# slow: hidden-state capture on a mesh; default tier: capture on one device, and the sharded engine cases
@pytest.mark.slow
def test_capture_on_a_mesh_equals_one_device():
    case = run_on_virtual_devices("tests.jspec.test_capture_hidden_states", 4)
    assert case["same_tokens"]
    assert case["shapes"] == [[3, len(p) + 12, fx.TARGET.hidden_size] for p in MESH_PROMPTS]
    assert case["max_diff"] < ATOL


if __name__ == "__main__":
    print(json.dumps(mesh_case()))
