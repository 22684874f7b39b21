"""Drafters: each proposes a draft tree inside the jitted loop (see base.py for the protocol)."""

from jspec.drafters.base import CommitContext, DraftTree, Drafter, PrefillContext

__all__ = ["CommitContext", "DraftTree", "Drafter", "PrefillContext"]
