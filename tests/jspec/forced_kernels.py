"""The engine with every tree kernel forced to one Pallas lowering (run in a Pallas interpreter on this CPU), on one
device and on a 4-device mesh (tests/jspec/test_forced_kernels.py runs this in a subprocess with 4 virtual CPU
devices).

The bundled code model with its trained EAGLE-3 head and a dynamic tree, so the tree build, tree verify and the
target's tree attention kernels all run at every step. Prints one JSON object: plain decoding's greedy tokens, and
for each lowering named on the command line the speculative engine's on one device and on dp 2 x tp 2.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import jax

import jspec
from jspec.tools.bundled import DEFAULT_SPEC

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):"]
MAX_NEW_TOKENS = 12
# A small tree keeps the interpreters' time down; still branching (topk 2) and deeper than one step.
SPEC = dataclasses.replace(DEFAULT_SPEC, num_steps=3, topk=2, num_draft_tokens=6, selection="eagle2")


def tokens(drafter: str | None, spec: jspec.SpecConfig | None, **mesh) -> list[list[int]]:
    engine = jspec.SpecEngine.from_pretrained(jspec.bundled_model(), drafter=drafter, spec=spec, max_batch_size=2,
                                              max_seq_len=128, **mesh)
    return engine.generate(PROMPTS, max_new_tokens=MAX_NEW_TOKENS).token_ids


def main(kernels: list[str]) -> dict:
    assert len(jax.devices()) == 4, jax.devices()
    report = {"plain": tokens(None, None)}
    for name in kernels:
        spec = dataclasses.replace(SPEC, kernels=name)
        report[name] = {"single": tokens("eagle3", spec),
                        "dp2xtp2": tokens("eagle3", spec, tensor_parallel_size=2, data_parallel_size=2)}
    return report


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
