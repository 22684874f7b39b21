"""One process of the 2-process test (tests/jspec/test_multihost.py): 2 CPU devices of its own, joined to the
other process through jax.distributed (gloo collectives), tp=4 over both, greedy generation; prints its tokens.

Usage: python -m tests.jspec.multihost_worker COORDINATOR_ADDRESS PROCESS_ID (XLA_FLAGS gives it 2 devices).
"""

from __future__ import annotations

import json
import sys

import jax

from tests.jspec.test_multihost import CHAIN, DRAFTER, MAX_NEW_TOKENS, PROMPTS


def main(coordinator: str, process_id: int) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=2, process_id=process_id,
                               initialization_timeout=60)
    import jspec

    assert jax.process_count() == 2 and len(jax.devices()) == 4 and len(jax.local_devices()) == 2
    engine = jspec.SpecEngine.from_pretrained(jspec.bundled_model(), drafter=DRAFTER, tensor_parallel_size=4,
                                              spec=jspec.SpecConfig(tree="chain", num_steps=CHAIN),
                                              max_batch_size=2, max_seq_len=256)
    out = engine.generate(PROMPTS, max_new_tokens=MAX_NEW_TOKENS)
    print(json.dumps({"process": jax.process_index(), "token_ids": out.token_ids}), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
