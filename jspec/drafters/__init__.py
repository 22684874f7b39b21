"""Drafters: each proposes a draft tree inside the jitted loop (``base.Drafter`` is the protocol).

eagle3.Eagle3Drafter (an EAGLE-3 head on the target's features), draft_model.DraftModelDrafter (a separate
Llama-family model with the target's vocabulary), ngram.NgramDrafter (prompt lookup, no weights). ``load`` turns
what a user writes (a registered name or a converted directory) into a drafter; ``registry.py`` is the table.
"""

from jspec.drafters.base import CommitContext, DraftTree, Drafter, PrefillContext
from jspec.drafters.registry import DRAFTERS, DrafterSource, load, resolve

__all__ = ["CommitContext", "DRAFTERS", "DraftTree", "Drafter", "DrafterSource", "PrefillContext", "load",
           "resolve"]
