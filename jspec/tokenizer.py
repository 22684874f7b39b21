"""A checkpoint directory's tokenizer and generation defaults (files Hugging Face writes beside the weights)."""

from __future__ import annotations

import json
import os


def load_tokenizer(model_dir: str):
    """``tokenizers.Tokenizer`` of ``model_dir/tokenizer.json``, or None when the directory has none."""
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(path)


def generation_eos(model_dir: str) -> tuple[int, ...]:
    """The EOS ids of ``model_dir/generation_config.json`` (an int or a list there), () without one."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return ()
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return ()
    return (eos,) if isinstance(eos, int) else tuple(eos)
