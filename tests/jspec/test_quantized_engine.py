"""The engine on weight-only quantized weights (qwix; models.quantization): speculative decoding stays lossless
against plain decoding of the same quantized target, for every drafter kind and scheme; on a mesh it equals one
device and each device holds the quantized bytes."""

from __future__ import annotations

import jax
import pytest

import jspec
from models.quantization import QuantizationConfig
from tests import spec_fixtures as fx
from tests.jspec.test_mtp import DYNAMIC, RAGGED, copy_module, engine as mtp_engine, one_layer_target
from tests.virtual_devices import run_on_virtual_devices

PROMPTS = ["def fibonacci(n):", "import os\n\ndef list_files(path):", "class Stack:\n    def __init__(self):"]
SPECS = {"eagle3": jspec.SpecConfig(tree="dynamic", num_steps=4, topk=2, num_draft_tokens=8),
         "draft": jspec.SpecConfig(tree="chain", num_steps=4),
         "ngram": jspec.SpecConfig(tree="chain", num_steps=5)}
ACCEPTANCE_FLOOR = {"eagle3": 1.5, "draft": 1.5, "ngram": 1.2}  # prompt lookup finds the output's own repeats only


def bundled(scheme: str, drafter: str | None = None) -> jspec.SpecEngine:
    return jspec.SpecEngine.from_pretrained(jspec.bundled_model(), drafter=drafter, spec=SPECS.get(drafter),
                                            max_batch_size=3, max_seq_len=128, quantization=scheme)


# slow: every drafter and scheme but [eagle3-int8] (a mark on either value: the draft model, n-gram, fp8, int4);
# default tier: [eagle3-int8] (target and head quantized) and the MTP int4 case (group-quantized target and modules)
@pytest.mark.parametrize("scheme", ["int8", pytest.param("fp8", marks=pytest.mark.slow),
                                    pytest.param("int4", marks=pytest.mark.slow)])
@pytest.mark.parametrize("drafter", ["eagle3", pytest.param("draft", marks=pytest.mark.slow),
                                     pytest.param("ngram", marks=pytest.mark.slow)])
def test_greedy_speculation_equals_plain_decoding_of_the_same_quantized_target(scheme, drafter):
    """The bundled model (float32 compute on this CPU) quantized at load, the drafter's linear layers too."""
    plain = bundled(scheme).generate(PROMPTS, max_new_tokens=32)
    out = bundled(scheme, drafter).generate(PROMPTS, max_new_tokens=32)
    assert out.token_ids == plain.token_ids
    assert out.stats.acceptance_length > ACCEPTANCE_FLOOR[drafter], out.stats  # drafts are accepted: it means something


# slow: [int8], [fp8] (MTP on per-channel weights = plain); default tier: [int4] (group-quantized modules)
@pytest.mark.parametrize("scheme", [pytest.param(QuantizationConfig("int8"), marks=pytest.mark.slow),
                                    pytest.param(QuantizationConfig("fp8"), marks=pytest.mark.slow),
                                    QuantizationConfig("int4", group_size=16)], ids=["int8", "fp8", "int4"])
def test_mtp_greedy_equals_plain_decoding_of_the_same_quantized_target(scheme):
    target = one_layer_target(0.05)
    modules = [copy_module(target, "mimo", scale, seed) for seed, scale in enumerate((0.3, 0.6))]
    plain = fx.plain_engine(target, quantization=scheme).generate(RAGGED, max_new_tokens=20)
    out = mtp_engine(target, modules, DYNAMIC, "mtp_eagle", quantization=scheme).generate(RAGGED, max_new_tokens=20)
    assert out.token_ids == plain.token_ids
    assert out.stats.acceptance_length > 1.5, out.stats


# slow: the loaded engine's target and head kernels are int8 QArrays; default tier: [eagle3-int8] (the same engine,
# lossless) and test_which_kernels_are_quantized_and_how
@pytest.mark.slow
def test_quantized_engine_holds_quantized_params():
    engine = bundled("int8", "eagle3")
    layer = engine.params["layers_0"]["self_attn"]["q_proj"]["kernel"]
    assert layer.qvalue.dtype == jax.numpy.int8 and layer.scale.shape == (1, layer.shape[1])
    assert engine.drafter_params["head"]["fc"]["kernel"].qvalue.dtype == jax.numpy.int8


def test_bad_quantization_settings_are_refused_before_loading():
    with pytest.raises(ValueError, match="spec='auto' with quantization"):
        jspec.SpecEngine.from_pretrained(jspec.bundled_model(), spec="auto", quantization="int8")
    with pytest.raises(ValueError, match="quantization='int3': expected one of"):
        jspec.SpecEngine.from_pretrained("/nonexistent", quantization="int3")  # before looking at the directory


# slow: int8 on tp 2 and dp 2 x tp 2 = one device, each device holding its share of the quantized bytes; default tier:
# test_sharded_params (the placement rules) and tests/models/test_quantization (the QArray leaves)
@pytest.mark.slow
def test_a_mesh_equals_one_device_and_splits_the_quantized_bytes():
    report = run_on_virtual_devices("tests.jspec.quantized_mesh", 4)
    assert report["tp2"] == report["single"] and report["dp2xtp2"] == report["single"]
    assert report["bytes_per_device_tp2"] < 0.6 * report["bytes_single"]  # the layers' qvalues and scales split


# slow: the slot engine (paged KV) on int4 weights with EAGLE-3 = offline generate; default tier: the quantized greedy
# cases (the same Dense in every program) and test_paged_rows_equal_generate_alone (the server's programs)
@pytest.mark.slow
def test_served_requests_equal_offline_generate_on_quantized_weights():
    """The server's slot engine (paged KV, one step program) on int4 weights with an EAGLE-3 head: each request's
    tokens equal the same engine's offline generate."""
    from jspec.serve.slots import SlotEngine
    from tests.jspec.serve.test_slots import serve_all

    engine = bundled("int4", "eagle3")
    slots = SlotEngine(engine, max_seq_len=128, steps_per_chunk=3, adapt=False, row_buckets=(3,),
                       enable_prefix_caching=False)
    slots.warm_up()
    slots.start()
    try:
        ids = engine.encode(PROMPTS)
        sinks = serve_all(slots, [dict(prompt_ids=p, max_tokens=20 + 4 * i, seed=i) for i, p in enumerate(ids)])
        for i, (prompt, sink) in enumerate(zip(ids, sinks)):
            assert sink.tokens == engine.generate([prompt], max_new_tokens=20 + 4 * i).token_ids[0]
    finally:
        slots.shutdown(10)
