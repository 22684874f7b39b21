"""The int8-quantized bundled model with its EAGLE-3 head on one device and on meshes of 4 virtual CPU devices
(tests/jspec/test_quantized_engine.py runs this in a subprocess): greedy tokens of each, and the weight bytes one
device holds (read from ``addressable_shards``). Prints one JSON object."""

from __future__ import annotations

import json

import jax

import jspec
from models.quantization import weight_bytes
from tests.jspec.test_quantized_engine import PROMPTS, SPECS


def engine(**mesh) -> jspec.SpecEngine:
    return jspec.SpecEngine.from_pretrained(jspec.bundled_model(), drafter="eagle3", spec=SPECS["eagle3"],
                                            max_batch_size=4, max_seq_len=128, quantization="int8", **mesh)


if __name__ == "__main__":
    assert len(jax.devices()) == 4, jax.devices()
    single, tp2 = engine(), engine(tensor_parallel_size=2)
    report = {"single": single.generate(PROMPTS, max_new_tokens=24).token_ids,
              "tp2": tp2.generate(PROMPTS, max_new_tokens=24).token_ids,
              "dp2xtp2": engine(tensor_parallel_size=2, data_parallel_size=2).generate(
                  PROMPTS, max_new_tokens=24).token_ids,
              "bytes_single": weight_bytes(single.params, per_device=True),
              "bytes_per_device_tp2": weight_bytes(tp2.params, per_device=True)}
    print(json.dumps(report))
