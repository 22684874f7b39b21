"""A sharded engine against the single-device one, on 8 virtual CPU devices (tests/jspec/sharded_cases.py runs in a
subprocess, since the device count is fixed when JAX starts).

For plain decoding, EAGLE-3 chains and dynamic trees, a draft model, n-gram drafting, a DFlash dynamic tree and a
DSpark chain under its confidence cut, over tp 8 and dp 2 x tp 4 (tp 2 with the bundled model and its head):
greedy float32 tokens equal one device's token for token; seeded sampling (tp 8, dp 2 x tp 4) too
(the vocabulary-split logits are gathered before sampling, and threefry draws do not depend on the sharding); a
second call in the same bucket compiles nothing. The compiled loop body holds one all-reduce per target layer
after o_proj and one after down_proj per target forward (likewise in the split EAGLE-3 head), and never gathers
a weight.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from tests.jspec import sharded_cases as cases
from tests.virtual_devices import run_on_virtual_devices

# slow: every drafter's greedy and seeded tokens at tp 8 and dp 2 x tp 4 equal one device's, one all-reduce per layer
# and no weight gather in the loop; default tier: test_multihost's tp 4 engine over two processes (= one device),
# test_sharded_kernels and test_sharded_params on 4 devices
pytestmark = pytest.mark.slow

DRAFTERS = ("plain", "eagle3-chain", "eagle3-dynamic", "draft-model", "ngram", "dflash", "dspark")


@pytest.fixture(scope="module")
def report() -> dict:
    """Every case of this module from one subprocess on 8 devices -> {"cases"|"collectives"|"bundled": {name:
    report}} (one process instead of one per case: each pays JAX's start-up and compiles its own programs)."""
    names = ",".join(DRAFTERS)
    return run_on_virtual_devices("tests.jspec.sharded_cases", 8, "cases", names, "collectives", names, "bundled",
                                  "bundled-eagle3", timeout=1200)


@pytest.mark.parametrize("name", DRAFTERS)
def test_sharded_tokens_equal_one_device(report, name):
    case = report["cases"][name]
    single = case["single"]
    assert all(len(tokens) == 24 for tokens in single[:3])
    for mesh in cases.MESHES:
        assert case[mesh]["greedy"] == single, f"{name} on {mesh}: greedy tokens differ from one device's"
        assert case[mesh]["again"] == single, f"{name} on {mesh}: second call differs"
        assert case[mesh]["num_compiled"] == 1 and case[mesh]["again_compile_seconds"] == 0.0
    for mesh in cases.SAMPLED_MESHES:
        assert case[mesh]["sampled"] == case["single_sampled"], f"{name} on {mesh}: seeded sampling differs"
    if name == "draft-model":  # the target drafting for itself: whole chains accepted, so commits are exercised
        assert case["acceptance"] > 3.0
    if name in cases.FORCED:  # accepting a fixed number of drafts (not the target's output, the same on every mesh)
        assert case["acceptance"] > cases.FORCED[name]  # 4 tokens a step but the last (max_new_tokens cuts it)


def test_bundled_model_with_its_eagle3_head_on_meshes(report):
    """Real acceptance (the trained head, default dynamic tree), loaded by from_pretrained straight into the
    sharding; generate and stream both equal one device's tokens."""
    case = report["bundled"]["bundled-eagle3"]
    assert case["acceptance"] > 1.5
    for mesh in cases.BUNDLED_MESHES:
        assert case[mesh]["greedy"] == case["single"], mesh
        assert case[mesh]["streamed"] == case["single"], mesh
        assert case[mesh]["acceptance"] == case["acceptance"]


@functools.cache
def _weight_shapes() -> frozenset[tuple[int, ...]]:
    """Every matrix shape a weight has, whole or split 2, 4 or 8 ways along either axis."""
    import jax

    params = cases.target_params()
    shapes = set()
    for leaf in jax.tree.leaves(params):
        shape = leaf.shape[-2:]
        if len(shape) == 2:
            for split in (1, 2, 4, 8):
                shapes |= {(shape[0] // split, shape[1]), (shape[0], shape[1] // split)}
    return frozenset(shapes)


@pytest.mark.parametrize("name", DRAFTERS)
def test_loop_collectives_are_per_layer_all_reduces(report, name):
    program = report["collectives"][name]
    assert program["generate_loops"] == 1  # still one lax.while_loop in one program
    found = program["collectives"]
    target, tp, batch = cases.TARGET, 4, 1
    # Target forwards in one step: the verify pass, and for drafters that report what they drafted also lax.cond's
    # other branch (n-gram: the root-only decode; DSpark under its confidence cut: the short chain's verify).
    forwards = 2 if name in ("ngram", "dspark") else 1
    for proj in ("self_attn/o_proj", "mlp/down_proj"):
        reduces = [shape for kind, shape, op in found
                   if kind == "all-reduce" and "/layers_" in op and op.endswith(f"{proj}/dot_general")]
        assert len(reduces) == forwards * target.num_layers, (proj, reduces)
        assert all(shape[0] == batch and shape[-1] == target.hidden_size for shape in reduces)
        # The EAGLE-3 head splits at tp 4 (8 heads, 4 KV heads): the same two all-reduces in each of its
        # num_steps forwards per step (num_steps - 1 drafting depths, then the commit's extend).
        head = [op for kind, _, op in found if kind == "all-reduce" and f"Eagle3Head/midlayer/{proj}/" in op]
        assert len(head) == (cases.SPECS[name[len("eagle3-"):]].num_steps if name.startswith("eagle3") else 0)
    weights = _weight_shapes()
    for kind, shape, op in found:
        squeezed = tuple(d for d in shape if d != 1)
        assert squeezed not in weights, f"{kind} {shape} ({op}) moves a weight"
        if kind == "all-gather":  # the logits (vocabulary split) and argmax (value, index) pairs, nothing else
            assert shape[-1] in (target.vocab_size, tp), (kind, shape, op)
        assert int(np.prod(shape)) <= batch * 8 * target.vocab_size, (kind, shape, op)  # never above the logits


def test_heads_not_divisible_by_tp_is_a_clear_error():
    import jspec
    from jspec.sharding import check_tensor_parallel, make_mesh
    from models.config import ModelConfig

    with pytest.raises(ValueError, match="num_attention_heads=6 is not divisible by tensor_parallel_size=4"):
        check_tensor_parallel(ModelConfig(vocab_size=8, hidden_size=12, intermediate_size=8, num_layers=1,
                                          num_heads=6, num_kv_heads=2, head_dim=2), 4)
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh(8, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        jspec.SpecEngine.from_pretrained(jspec.bundled_model(), tensor_parallel_size=0)
