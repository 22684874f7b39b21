"""Drafters: each proposes a draft tree inside the jitted loop (``base.Drafter`` is the protocol).

eagle3.Eagle3Drafter (an EAGLE-3 head on the target's features), draft_model.DraftModelDrafter (a separate
Llama-family model with the target's vocabulary), mtp.MtpDrafter (the MTP modules shipped inside the target's own
checkpoint: names "mtp" = MTP-EAGLE, module 0 recurrent, and "mtp_vanilla" = module d drafts depth d + 1),
ngram.NgramDrafter (prompt lookup, no weights). ``load`` turns what a user writes (a registered name or a converted
directory) into a drafter; ``registry.py`` is the table.

What a drafter written outside this package needs (docs/drafters.md): the protocol and its contexts
(``Drafter``, ``DraftTree``, ``PrefillContext``, ``CommitContext``), ``DrafterBase`` (the shared members),
``DrafterSource`` (what its ``load`` gets), ``static_draft_tree`` (a static tree's verification buffers),
``StaticTree`` and ``register`` (or an entry point in the group ``"jspec.drafters"``).
"""

from jspec.drafters.base import CommitContext, DraftTree, Drafter, DrafterSource, PrefillContext, check_drafter
from jspec.drafters.common import DrafterBase
from jspec.drafters.registry import DRAFTERS, ENTRY_POINT_GROUP, DrafterEntry, load, register, resolve
from jspec.drafters.tree_search import static_draft_tree
from jspec.trees import StaticTree

__all__ = ["CommitContext", "DRAFTERS", "DraftTree", "Drafter", "DrafterBase", "DrafterEntry", "DrafterSource",
           "ENTRY_POINT_GROUP", "PrefillContext", "StaticTree", "check_drafter", "load", "register", "resolve",
           "static_draft_tree"]
