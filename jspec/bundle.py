"""Where the bundled code model lives: a small Llama trained here on the Python standard library, with its
EAGLE-3 head and a 2-layer draft model, converted to bf16 under ``jspec/assets/code-model/``::

    target/   kind "llama"
    eagle3/   kind "eagle3"
    draft/    kind "llama"

``jspec.bundled_model()`` is the public way to get the target's directory (``SpecEngine.from_pretrained`` takes
it); how the bundle is built and the presets tuned for it live in ``jspec.tools.bundled``.
"""

from __future__ import annotations

import os

BUNDLE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "code-model")
PARTS = ("target", "eagle3", "draft")


def bundled_dir(part: str = "target", root: str = BUNDLE_DIR) -> str | None:
    """The converted directory of one part of the bundle, or None when it is not installed."""
    if part not in PARTS:
        raise ValueError(f"part={part!r}: expected one of {PARTS}")
    path = os.path.join(root, part)
    return path if os.path.isfile(os.path.join(path, "jspec.json")) else None


def bundled_model(part: str = "target") -> str:
    """The directory of one part of the bundled code model ("target", "eagle3" or "draft"), for
    ``SpecEngine.from_pretrained``. Raises FileNotFoundError when this installation has no bundle."""
    path = bundled_dir(part)
    if path is None:
        raise FileNotFoundError(f"the bundled code model's {part!r} part is not installed at "
                                f"{os.path.join(BUNDLE_DIR, part)}")
    return path


def is_bundled(model_dir: str) -> bool:
    """Whether ``model_dir`` is the bundled target."""
    target = bundled_dir("target")
    return target is not None and os.path.realpath(model_dir) == os.path.realpath(target)
