"""Writes the bundled model's acceptance profile for spec="auto" (jspec/auto.py): every candidate method's mean
accepted drafts per step on the calibration prompts, to jspec/assets/code-model/acceptance_profile.json. Rerun
after retraining a bundled drafter:

    .venv/bin/python scripts/calibrate_auto.py
"""

import json
import os

import jspec
from jspec.auto import PROFILE_FILE, calibrate_profile
from jspec.tokenizer import load_tokenizer

if __name__ == "__main__":
    target = jspec.bundled_model()
    engines = {}

    def make_engine(candidate, force_accept):
        if candidate.label not in engines:
            engines[candidate.label] = jspec.SpecEngine.from_pretrained(
                target, drafter=candidate.drafter, spec=candidate.spec, max_batch_size=1, max_seq_len=512,
                dtype="float32")
        return engines[candidate.label]

    tokenizer = load_tokenizer(target)
    profile = calibrate_profile(["eagle3", "ngram+eagle3", "draft", "ngram"], make_engine, lambda text: tokenizer.encode(text).ids)
    path = os.path.join(os.path.dirname(target), PROFILE_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(profile, f, indent=1)
    os.replace(path + ".tmp", path)
    print(json.dumps(profile["accepted"], indent=1))
    print(f"wrote {path}")
