"""Drafters: each proposes a draft tree inside the jitted loop (see base.py for the protocol).

eagle3.Eagle3Drafter (an EAGLE-3 head on the target's features), draft_model.DraftModelDrafter (a separate
Llama-family model with the target's vocabulary), ngram.NgramDrafter (prompt lookup, no weights).
"""

from jspec.drafters.base import CommitContext, DraftTree, Drafter, PrefillContext

__all__ = ["CommitContext", "DraftTree", "Drafter", "PrefillContext"]
