"""The MTP drafter (jspec/drafters/mtp.py), both modes: lossless greedy output (chain, dynamic tree, ragged batch),
an acceptance computed independently on the host, the exact target distribution under sampling (chi-square), and
the registry's names that take the weights from the target directory.

The computable case: an attention-free target (every o_proj zero, so each position's hidden state and next token are
functions of its token alone) and modules whose block attention is zero too, so a module's prediction is a function
of (its hidden input, the token it reads) that numpy evaluates; the draft chain of every step then follows from
plain decoding's output, and so does the engine's acceptance.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.drafters import registry
from jspec.drafters.mtp import MtpDrafter
from models.llama import init_params
from models.mtp import MtpConfig, init_mtp_params
from tests import spec_fixtures as fx
from tests.exact_distribution import assert_triples_follow, exact_triples, varied
from tests.jspec import test_spec_sampling as sampling_tests

RAGGED = [[5, 9, 13], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 41], [7] * 6]
CHAIN = jspec.SpecConfig(tree="chain", num_steps=3)
DYNAMIC = jspec.SpecConfig(tree="dynamic", num_steps=3, topk=3, num_draft_tokens=8)
H = fx.TARGET.hidden_size


def one_layer_target(attention_scale: float, seed: int = 0) -> dict:
    """fx.TARGET whose layers before the last are the identity (o_proj and down_proj zero), attention scaled by
    ``attention_scale`` in the last, embedding rows of unit RMS (so token_norm with weight 1 returns them), a sharp
    lm_head: a module copying the last layer reproduces the target's step (exactly when attention_scale is 0)."""
    params = init_params(fx.TARGET, jax.random.key(seed))
    embedding = params["embed_tokens"]["embedding"]
    params["embed_tokens"]["embedding"] = embedding / jnp.sqrt(jnp.mean(embedding ** 2, axis=-1, keepdims=True))
    layers = params["layers"]
    o_proj = layers["self_attn"]["o_proj"]["kernel"]
    layers["self_attn"]["o_proj"]["kernel"] = o_proj.at[:-1].set(0.0).at[-1].multiply(attention_scale)
    layers["mlp"]["down_proj"]["kernel"] = layers["mlp"]["down_proj"]["kernel"].at[:-1].set(0.0)
    params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * 6.0
    return params


def copy_module(params_t: dict, layout: str, hidden_scale: float, seed: int) -> dict:
    """A module whose block is the target's last layer, input_proj passing the token half through (identity) and
    mixing in ``hidden_scale`` x a random projection of the hidden half, final_norm the target's norm."""
    rng = np.random.default_rng(seed)
    token_rows = np.eye(H, dtype=np.float32)
    hidden_rows = (hidden_scale * rng.normal(size=(H, H)) / np.sqrt(H)).astype(np.float32)
    rows = [hidden_rows, token_rows] if layout == "mimo" else [token_rows, hidden_rows]
    return {"token_norm": {"weight": jnp.ones((H,))},
            "hidden_norm": {"weight": jnp.asarray(rng.uniform(0.5, 1.5, H), jnp.float32)},
            "input_proj": {"kernel": jnp.asarray(np.concatenate(rows))},
            "block": jax.tree.map(lambda stacked: stacked[-1], params_t["layers"]),
            "final_norm": {"weight": params_t["norm"]["weight"]}}


def engine(params_t, modules, spec, mode, layout="mimo", max_batch_size=4, **kwargs):
    config = MtpConfig.for_target(fx.TARGET, len(modules), layout)
    drafter = MtpDrafter(config, fx.TARGET, spec, fx.MAX_SEQ_LEN, mode=mode)
    return jspec.SpecEngine(fx.TARGET, params_t, drafter=drafter, drafter_params={"modules": tuple(modules)},
                            max_batch_size=max_batch_size, max_seq_len=fx.MAX_SEQ_LEN, **kwargs)


# --- lossless greedy output ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def near_target():
    return one_layer_target(0.05)


@pytest.fixture(scope="module")
def near_plain(near_target):
    return fx.plain_engine(near_target).generate(RAGGED, max_new_tokens=20).token_ids


# slow: [vanilla-deepseek] (MTP vanilla dynamic tree greedy = plain); default tier: [mtp_eagle-mimo]
@pytest.mark.parametrize("mode, layout", [("mtp_eagle", "mimo"),
                                          pytest.param("vanilla", "deepseek", marks=pytest.mark.slow)])
def test_greedy_output_equals_plain_decoding_dynamic_tree(near_target, near_plain, mode, layout):
    """Noisy copies of the target's last layer (attention on: windows, caches and masks all matter); module 2 of
    the vanilla three is a random one, so its depth's drafts are mostly rejected. Chains: the host-replay and
    from_pretrained tests below (both modes, output compared with plain decoding)."""
    spec = DYNAMIC
    modules = [copy_module(near_target, layout, scale, seed) for seed, scale in enumerate((0.3, 0.6))]
    random = init_mtp_params(MtpConfig.for_target(fx.TARGET, 1, layout), jax.random.key(9))["modules"][0]
    out = engine(near_target, modules + [random], spec, mode, layout).generate(RAGGED, max_new_tokens=20)
    assert out.token_ids == near_plain
    assert 1.5 < out.stats.acceptance_length < spec.max_depth + 1, out.stats  # multi-token acceptance, not all


def test_vanilla_needs_a_module_per_depth():
    config = MtpConfig.for_target(fx.TARGET, 2)
    with pytest.raises(ValueError, match=r"max_depth=3.*num_modules=2"):
        MtpDrafter(config, fx.TARGET, CHAIN, fx.MAX_SEQ_LEN, mode="vanilla")
    MtpDrafter(config, fx.TARGET, CHAIN, fx.MAX_SEQ_LEN, mode="mtp_eagle")  # module 0 alone drafts any depth
    with pytest.raises(ValueError, match="mode='medusa'"):
        MtpDrafter(config, fx.TARGET, CHAIN, fx.MAX_SEQ_LEN, mode="medusa")


# --- acceptance computed on the host ------------------------------------------------------------------------------

def _rms(x, weight, eps=fx.TARGET.rms_norm_eps):
    return weight * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _mlp(block, x):
    mlp = {name: np.asarray(block["mlp"][name]["kernel"]) for name in ("gate_proj", "up_proj", "down_proj")}
    h = _rms(x, np.asarray(block["post_attention_layernorm"]["weight"]))
    gate = h @ mlp["gate_proj"]
    return x + (gate / (1 + np.exp(-gate)) * (h @ mlp["up_proj"])) @ mlp["down_proj"]


def target_hidden(params_t, token):
    """The attention-free target's last hidden state (before the final norm) at a position holding ``token``."""
    x = np.asarray(params_t["embed_tokens"]["embedding"])[token]
    for layer in range(fx.TARGET.num_layers):
        x = _mlp(jax.tree.map(lambda stacked: stacked[layer], params_t["layers"]), x)
    return x


def module_step(params_t, module, layout, hidden, token, position):
    """An attention-free module on (hidden, token) -> (x, its greedy prediction)."""
    e = np.asarray(params_t["embed_tokens"]["embedding"])[token] * (position != 0)
    e, h = _rms(e, np.asarray(module["token_norm"]["weight"])), _rms(hidden, np.asarray(module["hidden_norm"]["weight"]))
    fused = np.concatenate([h, e] if layout == "mimo" else [e, h]) @ np.asarray(module["input_proj"]["kernel"])
    x = _mlp(module["block"], fused)
    logits = _rms(x, np.asarray(module["final_norm"]["weight"])) @ np.asarray(params_t["lm_head"]["kernel"])
    return x, int(np.argmax(logits))


def expected_stats(params_t, modules, layout, mode, prompts, outputs, depth, max_new_tokens):
    """Replays each row's steps: draft the chain from the committed tokens, accept its prefix that plain decoding
    agrees with, commit (cut at max_new_tokens) -> (num_verify_steps, accepted_per_position, accepted drafts of
    each step before the cut)."""
    steps, committed_counts, accepted_counts = 0, [], []
    for prompt, output in zip(prompts, outputs):
        tokens, root, generated = list(prompt) + list(output), len(prompt), 1
        while generated < max_new_tokens:
            hidden, token, drafts = target_hidden(params_t, tokens[root - 1]), tokens[root], []
            for d in range(depth):  # module d (vanilla) or 0 reads position root - 1 + d
                module = modules[d if mode == "vanilla" else 0]
                hidden, token = module_step(params_t, module, layout, hidden, token, root - 1 + d)
                drafts.append(token)
            accepted = 0
            while (accepted < depth and root + 1 + accepted < len(tokens)  # past the end: cut anyway
                   and drafts[accepted] == tokens[root + 1 + accepted]):
                accepted += 1
            count = min(accepted + 1, max_new_tokens - generated)
            committed_counts.append(count)
            accepted_counts.append(accepted)
            generated, root, steps = generated + count, root + count, steps + 1
    counts = np.array(committed_counts)
    return steps, [float((counts >= i + 2).sum() / steps) for i in range(depth)], accepted_counts


@pytest.fixture(scope="module")
def attention_free():
    params = one_layer_target(0.0, seed=3)
    return params, fx.plain_engine(params).generate(RAGGED, max_new_tokens=25).token_ids


# slow: MTP acceptance equals a host replay (both chainings, both layouts); default tier: test_mtp's greedy = plain
# [mtp_eagle-mimo]
@pytest.mark.slow
@pytest.mark.parametrize("mode, layout, scales", [
    ("mtp_eagle", "mimo", (0.0,)),                # an exact copy: every draft accepted
    ("mtp_eagle", "deepseek", (0.5,)),            # the hidden half matters: partial acceptance
    ("vanilla", "mimo", (0.5, 0.5, 1.0)),         # noisy copies, noisier by depth
])
def test_acceptance_equals_the_host_replay(attention_free, mode, layout, scales):
    params_t, plain = attention_free
    modules = [copy_module(params_t, layout, scale, seed=11 + i) for i, scale in enumerate(scales)]
    for module in modules:  # attention-free blocks: predictions are functions of (hidden, token)
        module["block"]["self_attn"]["o_proj"]["kernel"] = jnp.zeros((H, H))
    out = engine(params_t, modules, CHAIN, mode, layout).generate(RAGGED, max_new_tokens=25)
    assert out.token_ids == plain
    steps, per_position, accepted = expected_stats(params_t, modules, layout, mode, RAGGED, plain, 3, 25)
    assert out.stats.num_verify_steps == steps
    np.testing.assert_allclose(out.stats.accepted_per_position, per_position, atol=1e-9)
    if scales == (0.0,):
        assert set(accepted) == {3}, accepted  # the exact copy drafts what the target decodes
    else:
        assert 0.0 < per_position[1] and per_position[0] < 1.0, per_position  # partial, multi-token acceptance


# --- sampling ----------------------------------------------------------------------------------------------------

# slow: MTP drafting sampling chi-square (deterministic drafts); default tier: test_spec_sampling [dynamic], the same
# verify path
@pytest.mark.slow
def test_sampled_tokens_follow_the_exact_target_distribution():
    """mtp_eagle, a dynamic tree, temperature 1: the first three tokens vs the enumerated joint (V = 5)."""
    target = sampling_tests.TARGET
    params = varied(init_params(target, jax.random.key(7)))
    config = MtpConfig.for_target(target, 1)
    modules = varied(init_mtp_params(config, jax.random.key(8)))
    spec = jspec.SpecConfig(tree="dynamic", num_steps=3, topk=2, num_draft_tokens=6)
    rows = 6000
    drafter = MtpDrafter(config, target, spec, 16)
    out = jspec.SpecEngine(target, params, drafter=drafter, drafter_params=modules, max_batch_size=rows,
                           max_seq_len=16).generate([sampling_tests.PROMPT] * rows, max_new_tokens=3,
                                                    temperature=1.0, seed=5)
    assert out.stats.acceptance_length > 1.1, out.stats  # drafts accepted: the walk is exercised
    assert_triples_follow(out.token_ids, exact_triples(target, params, sampling_tests.PROMPT))


# --- registry: weights from the target directory ------------------------------------------------------------------

def test_registry_names_resolve_to_the_target_directory(tmp_path):
    for name in ("mtp", "mtp_vanilla"):
        assert registry.DRAFTERS[name].weights_from_target
        with pytest.raises(ValueError, match=f"drafter={name!r}.*target directory"):
            registry.resolve(name, None)
        with pytest.raises(ValueError, match="no MTP modules"):
            registry.resolve(name, str(tmp_path))


# slow: from_pretrained with the target's MTP modules = plain; default tier: test_mtp_checkpoint's converted modules
@pytest.mark.slow
def test_from_pretrained_with_the_targets_own_modules(near_target, tmp_path):
    """HF checkpoint with MTP modules (DeepSeek layout) -> converter -> from_pretrained(target, drafter="mtp" |
    "mtp_vanilla"): the modules come from the target directory; output equals plain decoding."""
    from models.checkpoint import convert_hf_llama, write_hf_llama
    cfg = fx.TARGET
    hf_config = {"model_type": "llama", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
                 "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
                 "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
                 "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta}
    modules = {"modules": tuple(copy_module(near_target, "deepseek", 0.3, seed) for seed in range(3))}
    hf_dir = write_hf_llama(str(tmp_path / "hf"), hf_config, near_target, mtp_params=modules, mtp_layout="deepseek")
    target_dir = convert_hf_llama(hf_dir, str(tmp_path / "target"), progress=False)
    kwargs = dict(spec=CHAIN, max_batch_size=4, max_seq_len=64)
    expected = jspec.SpecEngine.from_pretrained(target_dir, max_batch_size=4, max_seq_len=64).generate(
        RAGGED, max_new_tokens=12).token_ids
    for name, mode in (("mtp", "mtp_eagle"), ("mtp_vanilla", "vanilla")):
        engine = jspec.SpecEngine.from_pretrained(target_dir, drafter=name, **kwargs)
        assert engine.setup.drafter.mode == mode and engine.setup.drafter.mtp.layout == "deepseek"
        out = engine.generate(RAGGED, max_new_tokens=12)
        assert out.token_ids == expected, name
        assert out.stats.acceptance_length > 1.5, out.stats


# --- vanilla alignment with attention: the drafter's state equals a recomputation over DeepSeek slots -------------

def reference_outputs(params_t, modules, hidden, tokens, count):
    """Module k over its DeepSeek slots p = 0 .. count - 1 - k, reading (x^{k-1}_p, token p + k + 1) at positions
    p + k from a fresh cache -> [x^k f32[count - k, H] per module], module 0's logits at slot count - 1."""
    from models.attention import KVCache
    from models.mtp import MtpModule
    config = MtpConfig.for_target(fx.TARGET, len(modules))
    embedding = params_t["embed_tokens"]["embedding"]
    outputs, x, logits = [], hidden[:count], None
    for k, module in enumerate(modules):
        n = count - k
        if n <= 0:
            break
        cache = KVCache.zeros(1, 1, n, fx.TARGET.num_kv_heads, fx.TARGET.head_dim, jnp.float32)
        out = MtpModule(config).apply({"params": module}, embedding[tokens[k + 1:k + 1 + n]][None], x[:n][None],
                                      jnp.arange(k, k + n, dtype=jnp.int32)[None], cache, jnp.zeros((1,), jnp.int32))
        x = out.x[0]
        outputs.append(x)
        logits = out.normed[0, -1] @ params_t["lm_head"]["kernel"] if k == 0 else logits
    return outputs, logits


# slow: MTP vanilla's cached state equals a recomputation; default tier: greedy = plain [mtp_eagle-mimo]
@pytest.mark.slow
def test_vanilla_prefill_and_commit_state_equals_the_recomputation():
    """Random target and three random modules (attention on); prompts of 2 and 6 tokens (module 2 of the first has
    no committed slot at first: its first cache slots must not be read), then a commit of 3 and of 1 tokens."""
    from jspec.drafters.base import CommitContext, PrefillContext
    from models.attention import KVCache
    from models.llama import LlamaModel
    params_t = init_params(fx.TARGET, jax.random.key(0))
    config = MtpConfig.for_target(fx.TARGET, 3)
    modules = init_mtp_params(config, jax.random.key(1))["modules"]
    drafter = MtpDrafter(config, fx.TARGET, CHAIN, 32, mode="vanilla")
    seq = jax.random.randint(jax.random.key(2), (2, 16), 0, fx.TARGET.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(16), (2, 16))
    cache = KVCache.zeros(fx.TARGET.num_layers, 2, 16, fx.TARGET.num_kv_heads, fx.TARGET.head_dim, jnp.float32)
    taps = LlamaModel(fx.TARGET).apply({"params": params_t}, seq, positions, cache, jnp.zeros((2,), jnp.int32),
                                       tap_layers=(fx.TARGET.num_layers,)).taps  # [1, 2, 16, H]
    lens, width = jnp.array([2, 6]), 8
    state = jax.jit(drafter.prefill)(params_t, {"modules": modules},
                                     PrefillContext(seq[:, :width], lens, seq[jnp.arange(2), lens], taps[:, :, :width]))

    def check(state, roots):
        for b, root in enumerate(roots):
            outputs, logits = jax.jit(reference_outputs, static_argnums=4)(params_t, modules, taps[0, b], seq[b],
                                                                           root)
            np.testing.assert_allclose(state.logits[b], logits, rtol=1e-4, atol=1e-4)
            for k, x in enumerate(outputs):  # module k's last committed slot: p = root - 1 - k
                np.testing.assert_allclose(state.hidden[k, b], x[-1], rtol=1e-4, atol=1e-4, err_msg=f"{b} {k}")

    check(state, [2, 6])
    committed, depth = jnp.array([3, 1]), CHAIN.max_depth
    index = lens[:, None] + jnp.arange(depth + 1)[None]
    ctx = CommitContext(jnp.take_along_axis(seq, index + 1, axis=1), committed,
                        jnp.broadcast_to(jnp.arange(depth + 1), (2, depth + 1)),
                        jnp.take_along_axis(taps, index[None, :, :, None], axis=2), lens)
    check(jax.jit(drafter.commit)(params_t, {"modules": modules}, state, ctx), [5, 7])
