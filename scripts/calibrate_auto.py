"""Writes what the bundled model ships for spec="auto" (jspec/auto.py), beside its parts in jspec/assets/code-model/:

    .venv/bin/python scripts/calibrate_auto.py                # acceptance_profile.json: accepted drafts per step
    .venv/bin/python scripts/calibrate_auto.py --step-costs   # step_costs.json: this device's step costs

The acceptance profile depends on the model and drafters only: rerun after retraining a bundled drafter. The step
costs are the prior a first `jspec generate` chooses by on a device of the same backend (no timing up front);
--step-costs times every candidate here, as `jspec tune` does, for one streamed prompt and for whole generate calls,
at jspec generate's defaults (batch 1, 1024 slots, the default dtype), and replaces this backend's entries.
"""

import argparse
import datetime
import json
import os
import platform

import jax

import jspec
from jspec.autotune import (PROFILE_FILE, STEP_COST_FILE, calibrate_profile, from_pretrained_auto,
                            prior_entry_of)
from jspec.tokenizer import load_tokenizer

MAX_SEQ_LEN = 1024  # jspec generate's default


def write_json(path: str, data: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(path + ".tmp", path)


def acceptance_profile(target: str) -> None:
    engines = {}

    def make_engine(candidate, force_accept):
        if candidate.label not in engines:
            engines[candidate.label] = jspec.SpecEngine.from_pretrained(
                target, drafter=candidate.drafter, spec=candidate.spec, max_batch_size=1, max_seq_len=512,
                dtype="float32")
        return engines[candidate.label]

    tokenizer = load_tokenizer(target)
    profile = calibrate_profile(["eagle3", "ngram+eagle3", "draft", "ngram"], make_engine,
                                lambda text: tokenizer.encode(text).ids)
    path = os.path.join(os.path.dirname(target), PROFILE_FILE)
    write_json(path, profile)
    print(json.dumps(profile["accepted"], indent=1))
    print(f"wrote {path}")


def step_costs(target: str) -> None:
    path = os.path.join(os.path.dirname(target), STEP_COST_FILE)
    kept = []
    if os.path.isfile(path):
        with open(path) as f:
            kept = [e for e in json.load(f)["entries"] if e["backend"] != jax.default_backend()]
    host = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, JAX {jax.__version__}"
    date = datetime.date.today().isoformat()
    entries = []
    for streamed in (True, False):
        engine = from_pretrained_auto(jspec.SpecEngine, target, None, max_batch_size=1, max_seq_len=MAX_SEQ_LEN,
                                      dtype=None, streamed=streamed, retime=True, log=print)
        print(engine.auto_choice.describe())
        entries.append(prior_entry_of(engine.auto_choice, batch_size=1, max_seq_len=MAX_SEQ_LEN, dtype=None,
                                      layout="", streamed=streamed, host=host, date=date))
    write_json(path, {"entries": kept + entries,
                      "note": "seconds per step of each spec='auto' candidate (timing key: method | forced "
                              "acceptance | streamed or loop), written by scripts/calibrate_auto.py --step-costs"})
    print(f"wrote {path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-costs", action="store_true", help="write step_costs.json instead of the profile")
    args = parser.parse_args()
    (step_costs if args.step_costs else acceptance_profile)(jspec.bundled_model())
