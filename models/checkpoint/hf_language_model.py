"""The language model's tensors of an image-text checkpoint (Gemma-3's ``Gemma3ForConditionalGeneration``: 4B, 12B,
27B), under the names a text-only checkpoint gives them.

The Hub's Gemma-3 checkpoints store ``language_model.model.*`` (transformers >= 4.52 may write
``model.language_model.*``) beside ``vision_tower.*`` and ``multi_modal_projector.*``. :class:`LanguageModelReader`
lists the first as ``model.*`` (and ``language_model.lm_head.weight`` as ``lm_head.weight``) and leaves the vision
tower and projector unread: jspec runs text prompts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from models.checkpoint.safetensors_io import read_tensor

_RENAMED = (("language_model.model.", "model."), ("model.language_model.", "model."),
            ("language_model.lm_head.", "lm_head."))
_UNREAD = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def text_name(name: str) -> str | None:
    """A stored tensor's text-only name; None for the vision tower's and the projector's."""
    if name.startswith(_UNREAD):
        return None
    for prefix, replacement in _RENAMED:
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    return name


class LanguageModelReader:
    """``listing()`` yields (file, text-only name, shape) of the language model's tensors; ``read(file, name,
    out=None)`` reads one by that name."""

    def __init__(self, headers: dict[str, tuple[str, tuple[int, ...]]],
                 read: Callable[..., np.ndarray] = read_tensor):
        self._stored = {text_name(name): name for name in headers if text_name(name) is not None}
        self._where, self._read = headers, read

    def listing(self) -> Iterator[tuple[str, str, tuple[int, ...]]]:
        for name, stored in self._stored.items():
            file, shape = self._where[stored]
            yield file, name, shape

    def read(self, file: str, name: str, out: np.ndarray | None = None) -> np.ndarray:
        return self._read(file, self._stored[name], out=out)
