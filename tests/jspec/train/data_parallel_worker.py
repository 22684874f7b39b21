"""Run by test_eagle3_data_parallel.py on 2 virtual CPU devices: a few EAGLE-3 head optimizer steps with
train_eagle3 on 1 device and on a ("data",) mesh of 2, from the same init and batches; prints their losses as
JSON (last stdout line).

    python -m tests.jspec.train.data_parallel_worker TARGET_HF CORPUS_ROOT TMP_DIR
"""

import json
import os
import sys

import jax

from jspec.train.eagle3_head import train_eagle3
from jspec.train.target import TrainConfig

STEPS = TrainConfig(steps=4, batch_size=4, seq_len=16, learning_rate=1e-2, warmup_steps=1, checkpoint_every=4,
                    eval_every=4, eval_batches=1)


def main(target_hf: str, corpus: str, tmp: str) -> dict:
    assert jax.device_count() == 2, jax.devices()
    result = {}
    for size in (1, 2):
        out = os.path.join(tmp, f"dp{size}")
        report = train_eagle3(out, target_hf, os.path.join(tmp, f"dp{size}_work"), STEPS, draft_vocab_size=200,
                              unroll=3, corpus_root=corpus, progress=False, log=lambda line: None,
                              data_parallel_size=size)
        result[size] = {"losses": report["first_losses"][:STEPS.steps], "heldout": report["heldout_loss"],
                        "accuracy": report["heldout_step_accuracy"]}
    return result


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:4])))
