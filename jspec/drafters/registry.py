"""The one table of drafters: the names users write (Python, CLI, bench, eval) and how each is loaded.

``load(drafter, ...)`` accepts, for every caller alike:

- a registered name: ``"ngram"`` (prompt lookup, no weights); ``"eagle3"`` or ``"draft"`` (the bundled code
  model's EAGLE-3 head or draft model: these names carry weights, so they mean the bundled parts and are only
  valid with the bundled target; for any other target pass the converted drafter's directory);
- a converted drafter directory (``jspec convert``): its ``jspec.json`` kind picks the entry ("eagle3" -> the
  EAGLE-3 head, "llama" -> a draft model with the target's vocabulary).

A new drafter: one file in this package with a ``load(source: DrafterSource) -> (drafter, params)`` function and
a class implementing ``base.Drafter``, plus one entry in ``DRAFTERS`` below.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, NamedTuple

from jspec.bundle import bundled_dir, is_bundled
from jspec.config import SpecConfig
from jspec.drafters import draft_model, eagle3, ngram
from jspec.drafters.base import Drafter
from models.checkpoint import read_jspec_meta
from models.config import ModelConfig


class DrafterSource(NamedTuple):
    """Everything a drafter's ``load`` may need: where its weights are (None for weightless drafters), the
    target it drafts for, the tree it drafts, its buffers' size and the compute dtype."""

    path: str | None
    target: ModelConfig
    target_dir: str | None
    spec: SpecConfig
    max_seq_len: int
    dtype: str


@dataclasses.dataclass(frozen=True)
class DrafterEntry:
    """load: DrafterSource -> (static drafter, params); checkpoint_kind: the ``jspec.json`` kind of its weights
    directory (None: no weights); bundled_part: the bundled code model's part its bare name stands for."""

    load: Callable[[DrafterSource], tuple[Drafter, Any]]
    checkpoint_kind: str | None
    bundled_part: str | None
    description: str


DRAFTERS: dict[str, DrafterEntry] = {
    "eagle3": DrafterEntry(eagle3.load, "eagle3", "eagle3", "an EAGLE-3 head on the target's hidden states"),
    "draft": DrafterEntry(draft_model.load, "llama", "draft", "a Llama-family draft model with the target's vocabulary"),
    "ngram": DrafterEntry(ngram.load, None, None, "prompt lookup (n-gram), no weights"),
}


def resolve(drafter: str | os.PathLike, target_dir: str | None) -> tuple[str, str | None]:
    """A drafter as a user writes it -> (registry name, weights directory or None); ValueError / FileNotFoundError
    naming the value otherwise. Nothing is loaded."""
    value = os.fspath(drafter)
    if value in DRAFTERS:
        entry = DRAFTERS[value]
        if entry.checkpoint_kind is None:
            return value, None
        if target_dir is None or not is_bundled(target_dir):
            raise ValueError(f"drafter={value!r} names the bundled code model's {entry.bundled_part} and needs the "
                             f"bundled target (jspec.bundled_model()); for target {target_dir!r} pass the converted "
                             f"drafter's directory instead")
        path = bundled_dir(entry.bundled_part)
        if path is None:
            raise FileNotFoundError(f"drafter={value!r}: the bundled code model has no {entry.bundled_part} part "
                                    f"installed")
        return value, path
    if not os.path.isdir(value):
        raise FileNotFoundError(f"drafter={value!r}: expected one of {sorted(DRAFTERS)} or a converted drafter "
                                f"directory, and no directory {value!r} exists")
    kind = read_jspec_meta(value).get("kind")
    for name, entry in DRAFTERS.items():
        if entry.checkpoint_kind is not None and entry.checkpoint_kind == kind:
            return name, value
    kinds = sorted(e.checkpoint_kind for e in DRAFTERS.values() if e.checkpoint_kind)
    raise ValueError(f"drafter directory {value!r} holds a {kind!r} checkpoint; expected one of kinds {kinds} "
                     f"(an EAGLE-3 head or a Llama-family draft model)")


def load(drafter: str | os.PathLike, *, target: ModelConfig, target_dir: str | None, spec: SpecConfig,
         max_seq_len: int, dtype: str) -> tuple[Drafter, Any]:
    """A drafter name or directory (see the module docstring) -> (static drafter, its params)."""
    name, path = resolve(drafter, target_dir)
    return DRAFTERS[name].load(DrafterSource(path, target, target_dir, spec, max_seq_len, dtype))
