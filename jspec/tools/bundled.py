"""Presets for the bundled code model (``jspec/bundle.py`` says where it lives), and how it is built::

    target/   kind "llama"   (scripts/train_target.py)
    eagle3/   kind "eagle3"  (scripts/train_drafter.py --kind eagle3)
    draft/    kind "llama"   (scripts/train_drafter.py --kind draft_model)

``jspec generate`` with no --model uses it (dynamic-tree EAGLE-3 by default). ``build_bundle`` converts the
three HF directories the training scripts write into this layout (scripts/bundle_code_model.py).
"""

from __future__ import annotations

import os
import shutil

from jspec.bundle import BUNDLE_DIR, PARTS, bundled_dir
from jspec.config import SpecConfig

__all__ = ["BUNDLE_DIR", "DEFAULT_SPEC", "PARTS", "RANKED_PATHS", "build_bundle", "bundled_dir", "spec_for"]

# The best acceptance of the bundled head on the 164 HumanEval prompts (greedy, 128 tokens; docs/bundled-model.md):
# 5.69 tokens per step, keeping the head's top-1 chain to depth 8 (EAGLE-2's selection gets 4.74 from this tree).
DEFAULT_SPEC = SpecConfig(tree="dynamic", num_steps=8, topk=4, num_draft_tokens=32, selection="top1_chain")
# On a CPU, drafts that cost nothing to make pay most: a verify pass of this small target costs several plain
# steps there and each head forward a good part of one (measured in docs/benchmarks.md).
CPU_DRAFTER, CPU_SPEC = "ngram", SpecConfig(tree="chain", num_steps=9)


def default_method(backend: str) -> tuple[str, SpecConfig]:
    """The bundled model's default (drafter name, tree) on ``backend`` ("cpu", "gpu", "tpu") where auto does not
    choose (``jspec serve``): prompt lookup on a CPU, the fastest drafter measured there; the EAGLE-3 head
    elsewhere."""
    return (CPU_DRAFTER, CPU_SPEC) if backend == "cpu" else ("eagle3", DEFAULT_SPEC)


def default_spec(drafter: str) -> SpecConfig:
    """The tree a drafter runs when no tree flag is given: the n-gram chain for prompt lookup (drafts cost nothing,
    so long chains pay), a converted directory's own default where its drafter has one (a DFlash/DSpark block as a
    chain, a PARD draft's chain), DEFAULT_SPEC for model drafters."""
    if drafter == CPU_DRAFTER:
        return CPU_SPEC
    if os.path.isdir(drafter):
        from jspec.drafters import DRAFTERS, resolve

        name, path = resolve(drafter, None)
        own = DRAFTERS[name].default_spec and DRAFTERS[name].default_spec(path)
        if own is not None:
            return own
    return DEFAULT_SPEC
# Static tree paths, most likely first (every path's parent precedes it): a static tree of T nodes is the first
# T - 1 of them, so static, chain and dynamic trees can be compared at the same num_draft_tokens.
RANKED_PATHS = ((0,), (0, 0), (1,), (0, 0, 0), (0, 1), (2,), (1, 0), (0, 0, 0, 0), (0, 0, 1), (0, 2), (3,),
                (0, 0, 0, 0, 0), (0, 1, 0), (1, 1), (0, 0, 0, 1), (2, 0), (0, 0, 0, 0, 0, 0), (0, 0, 1, 0),
                (1, 0, 0), (0, 0, 0, 0, 1), (0, 0, 0, 0, 0, 0, 0), (0, 0, 2), (0, 1, 1), (1, 2), (4,),
                (0, 0, 0, 2), (0, 0, 0, 0, 0, 1), (0, 0, 0, 0, 0, 0, 0, 0), (0, 0, 1, 0, 0), (0, 1, 0, 0),
                (1, 0, 0, 0))


def spec_for(tree: str, num_draft_tokens: int, num_steps: int = 6, topk: int = 4,
             selection: str = "eagle2") -> SpecConfig:
    """A tree of ``num_draft_tokens`` nodes (root included) of the given kind: chain (depth T - 1), static (the
    first T - 1 of RANKED_PATHS) or dynamic (``num_steps`` x ``topk`` candidates, chosen by ``selection``)."""
    if tree == "chain":
        if num_draft_tokens < 2:
            raise ValueError(f"num_draft_tokens={num_draft_tokens}: a chain needs at least 2 (the root and a draft)")
        return SpecConfig(tree="chain", num_steps=num_draft_tokens - 1)
    if tree == "static":
        if not 2 <= num_draft_tokens <= len(RANKED_PATHS) + 1:
            raise ValueError(f"num_draft_tokens={num_draft_tokens}: static trees here have 2..{len(RANKED_PATHS) + 1}")
        return SpecConfig(tree="static", tree_choices=RANKED_PATHS[:num_draft_tokens - 1])
    return SpecConfig(tree=tree, num_steps=num_steps, topk=topk, num_draft_tokens=num_draft_tokens,
                      selection=selection)


def build_bundle(target_hf: str, eagle3_hf: str, draft_hf: str, root: str = BUNDLE_DIR,
                 dtype: str = "bfloat16") -> dict[str, str]:
    """Converts the three HF directories into ``root/{target,eagle3,draft}`` (``dtype``); copies the target's
    training report beside them. Returns part -> converted directory."""
    from models.checkpoint import convert_hf_checkpoint

    out = {}
    for part, src in zip(PARTS, (target_hf, eagle3_hf, draft_hf)):
        out[part] = convert_hf_checkpoint(src, os.path.join(root, part), dtype=dtype, overwrite=True,
                                          progress=False)
        report = os.path.join(src, "train_report.json")
        if os.path.isfile(report):
            shutil.copy2(report, os.path.join(out[part], "train_report.json"))
    return out
