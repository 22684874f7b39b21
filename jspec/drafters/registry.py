"""The one table of drafters: the names users write (Python, CLI, bench, eval) and how each is loaded.

``load(drafter, ...)`` accepts, for every caller alike:

- a registered name: ``"ngram"`` (prompt lookup, no weights); ``"eagle3"`` or ``"draft"`` (the bundled code
  model's EAGLE-3 head or draft model: these names carry weights, so they mean the bundled parts and are only
  valid with the bundled target; for any other target pass the converted drafter's directory);
- ``"ngram+eagle3"``: prompt lookup first, the bundled EAGLE-3 head where lookup finds nothing (hybrid.py);
- a converted drafter directory (``jspec convert``): its ``jspec.json`` kind picks the entry ("eagle3" -> the
  EAGLE-3 head, "llama" -> a draft model with the target's vocabulary; the first entry of a kind wins);
- ``"mtp"`` (MTP-EAGLE: the target's MTP module 0 applied recurrently, the common deployment) or ``"mtp_vanilla"``
  (module d drafts depth d + 1): the weights are the MTP modules inside the target's own converted directory
  (``<target_dir>/mtp/``, written by ``jspec convert`` from a checkpoint with ``num_nextn_predict_layers``), so
  these names resolve to the target directory.

A new drafter: one file in this package with a ``load(source: base.DrafterSource) -> (drafter, params)`` function
and a class implementing ``base.Drafter``, plus one entry in ``DRAFTERS`` below.

A drafter written outside this package (TensorRT-LLM's USER_PROVIDED mode) joins the same table at run time:
``register(name, load, description=...)``, or, for ``jspec generate --drafter NAME`` too, an entry point in the
group ``"jspec.drafters"`` of the user's own package (its object: a zero-argument function that calls
``register``, or a ``DrafterEntry``), looked up when a name is not registered, as vLLM loads its plugins.
docs/drafters.md walks through one.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
from typing import Any, Callable

from jspec.bundle import PARTS, bundled_dir, is_bundled
from jspec.config import SpecConfig
from jspec.drafters import dflash, eagle3, hybrid, mtp, ngram, pard
from jspec.drafters.base import Drafter, DrafterSource, check_drafter
from models.checkpoint import MTP_DIR, has_mtp, read_jspec_meta
from models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class DrafterEntry:
    """load: DrafterSource -> (static drafter, params); checkpoint_kind: the ``jspec.json`` kind of its weights
    directory (None: no weights of its own); bundled_part: the bundled code model's part its bare name stands for;
    weights_from_target: the weights live inside the target's directory (MTP modules): the name resolves to it."""

    load: Callable[[DrafterSource], tuple[Drafter, Any]]
    checkpoint_kind: str | None
    bundled_part: str | None
    description: str
    weights_from_target: bool = False
    default_spec: Callable[[str | None], SpecConfig | None] | None = None  # weights directory -> the tree drafted
                                                                            # when none is given (None: SpecConfig())


DRAFTERS: dict[str, DrafterEntry] = {
    "eagle3": DrafterEntry(eagle3.load, "eagle3", "eagle3", "an EAGLE-3 head on the target's hidden states"),
    "draft": DrafterEntry(pard.load, "llama", "draft", "a Llama-family draft model with the target's vocabulary (a "
                          "PARD draft: K tokens in one forward)", default_spec=pard.default_spec),
    "ngram": DrafterEntry(ngram.load, None, None, "prompt lookup (n-gram), no weights"),
    "ngram+eagle3": DrafterEntry(hybrid.load_ngram_eagle3, "eagle3", "eagle3", "prompt lookup where the last 3 "
                                 "tokens were seen before, the bundled EAGLE-3 head elsewhere (chains)"),
    "mtp": DrafterEntry(mtp.load, None, None, "the target's own MTP module 0, applied recurrently (MTP-EAGLE)",
                        weights_from_target=True),
    "mtp_vanilla": DrafterEntry(mtp.load_vanilla, None, None, "the target's own MTP modules, module d drafting "
                                "depth d + 1 (DeepSeek-V3's vanilla MTP)", weights_from_target=True),
    "dflash": DrafterEntry(dflash.load, "dflash", None, "a DFlash block drafter on the target's hidden states "
                           "(block_size - 1 drafts in one forward)", default_spec=dflash.default_spec),
}


def resolve(drafter: str | os.PathLike, target_dir: str | None) -> tuple[str, str | None]:
    """A drafter as a user writes it -> (registry name, weights directory or None); ValueError / FileNotFoundError
    naming the value otherwise. Nothing is loaded."""
    value = os.fspath(drafter)
    if value not in DRAFTERS:
        _register_plugin(value)
    if value in DRAFTERS:
        entry = DRAFTERS[value]
        if entry.weights_from_target:
            return value, _target_with_mtp(value, target_dir)
        if entry.checkpoint_kind is None:
            return value, None
        if entry.bundled_part is None:
            raise ValueError(f"drafter={value!r} loads weights (jspec.json kind {entry.checkpoint_kind!r}): pass "
                             f"the drafter's directory instead of its name")
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
        raise FileNotFoundError(f"drafter={value!r}: expected one of {sorted(set(DRAFTERS) | _plugin_names())} "
                                f"or a converted drafter directory, and no directory {value!r} exists")
    kind = read_jspec_meta(value).get("kind")
    if all(entry.checkpoint_kind != kind for entry in DRAFTERS.values()):
        for name in sorted(_plugin_names() - set(DRAFTERS)):  # a plugin may register this kind
            _register_plugin(name)
    for name, entry in DRAFTERS.items():
        if entry.checkpoint_kind is not None and entry.checkpoint_kind == kind:
            return name, value
    kinds = sorted(e.checkpoint_kind for e in DRAFTERS.values() if e.checkpoint_kind)
    raise ValueError(f"drafter directory {value!r} holds a {kind!r} checkpoint; expected one of kinds {kinds} "
                     f"(an EAGLE-3 head, a DFlash drafter or a Llama-family draft model)")


def _target_with_mtp(name: str, target_dir: str | None) -> str:
    """The target directory that holds the MTP modules drafter ``name`` loads; ValueError naming it otherwise."""
    if target_dir is None:
        raise ValueError(f"drafter={name!r} loads the MTP modules inside the target directory, and no target "
                         f"directory was given (use SpecEngine.from_pretrained(target_dir, drafter={name!r}))")
    if not has_mtp(target_dir):
        raise ValueError(f"drafter={name!r}: target directory {target_dir!r} holds no MTP modules (no "
                         f"{MTP_DIR}/ of kind 'mtp'; convert a checkpoint whose config.json has "
                         f"num_nextn_predict_layers > 0)")
    return os.fspath(target_dir)


def load(drafter: str | os.PathLike, *, target: ModelConfig, target_dir: str | None, spec: SpecConfig | None,
         max_seq_len: int, dtype: str) -> tuple[Drafter, Any]:
    """A drafter name or directory (see the module docstring) -> (static drafter, its params); spec None: the
    drafter's default tree (``SpecConfig()``, a DFlash drafter's whole block as a chain)."""
    name, path = resolve(drafter, target_dir)
    entry = DRAFTERS[name]
    if spec is None:
        spec = (entry.default_spec and entry.default_spec(path)) or SpecConfig()
    loaded = entry.load(DrafterSource(path, target, target_dir, spec, max_seq_len, dtype))
    what = f"drafter {name!r} (load={_qualname(entry.load)})"
    if not isinstance(loaded, tuple) or len(loaded) != 2:
        raise TypeError(f"{what} returned {type(loaded).__name__}: expected a (drafter, params) pair")
    check_drafter(loaded[0], what)
    return loaded


# --- drafters from outside the package --------------------------------------------------------------------------

ENTRY_POINT_GROUP = "jspec.drafters"
_RESERVED_NAMES = ("none",)  # the CLI's --drafter none: plain decoding


def register(name: str, load: Callable[[DrafterSource], tuple[Drafter, Any]], *, description: str,
             checkpoint_kind: str | None = None, bundled_part: str | None = None,
             overwrite: bool = False) -> DrafterEntry:
    """Adds a drafter to the table under ``name`` -> its entry. From then on ``name`` works wherever a drafter
    name does (``SpecEngine.from_pretrained(target, drafter=name)``, ``jspec generate --drafter name``).

    load: ``DrafterSource -> (drafter, params)``; the drafter is checked against the ``Drafter`` protocol each
    time it is loaded. checkpoint_kind: the ``jspec.json`` kind of the drafter's weights directory (a directory of
    that kind then resolves to ``name``; None: no weights). bundled_part: the bundled code model's part the bare
    name stands for (``jspec.bundle.PARTS``; needs checkpoint_kind). overwrite: replace a registered ``name``
    (otherwise a clash is a ValueError).
    """
    entry = DrafterEntry(load=load, checkpoint_kind=checkpoint_kind, bundled_part=bundled_part,
                         description=description)
    _add(name, entry, overwrite=overwrite)
    return entry


def _add(name: str, entry: DrafterEntry, *, overwrite: bool) -> None:
    """Validates ``entry`` under ``name`` and puts it in DRAFTERS."""
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise ValueError(f"drafter name {name!r}: expected a non-empty string without surrounding spaces")
    if name in _RESERVED_NAMES:
        raise ValueError(f"drafter name {name!r} is reserved (the CLI's --drafter {name} means plain decoding)")
    if name in DRAFTERS and not overwrite:
        raise ValueError(f"drafter name {name!r} is already registered ({DRAFTERS[name].description}); choose "
                         f"another name or pass overwrite=True")
    if not callable(entry.load):
        raise ValueError(f"drafter {name!r}: load={entry.load!r} is not callable; expected a function "
                         f"DrafterSource -> (drafter, params)")
    if not isinstance(entry.description, str) or not entry.description.strip():
        raise ValueError(f"drafter {name!r}: description={entry.description!r}: expected a non-empty string")
    kind = entry.checkpoint_kind
    if kind is not None:
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"drafter {name!r}: checkpoint_kind={kind!r}: expected a non-empty string or None")
        owners = [other for other, e in DRAFTERS.items() if e.checkpoint_kind == kind and other != name]
        if owners:
            raise ValueError(f"drafter {name!r}: checkpoint_kind={kind!r} already belongs to drafter "
                             f"{owners[0]!r} (a directory of that kind must resolve to one drafter)")
    if entry.bundled_part is not None and (entry.bundled_part not in PARTS or kind is None):
        raise ValueError(f"drafter {name!r}: bundled_part={entry.bundled_part!r}: expected one of {PARTS} with a "
                         f"checkpoint_kind, or None")
    DRAFTERS[name] = entry


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """The installed distributions' entry points in ENTRY_POINT_GROUP, by name."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _plugin_names() -> set[str]:
    return set(_entry_points())


def _register_plugin(name: str) -> None:
    """Runs the entry point called ``name`` (if any) so that it registers ``name``; ValueError naming the entry
    point when it fails or registers something else."""
    ep = _entry_points().get(name)
    if ep is None:
        return
    where = f"entry point {ep.name} = {ep.value!r} (group {ENTRY_POINT_GROUP!r})"
    try:
        obj = ep.load()
        if isinstance(obj, DrafterEntry):
            _add(name, obj, overwrite=False)
        elif callable(obj):
            obj()
        else:
            raise TypeError(f"it is a {type(obj).__name__}: expected a DrafterEntry or a zero-argument function "
                            f"that calls jspec.drafters.register")
    except Exception as error:
        raise ValueError(f"drafter {name!r}: {where} failed: {type(error).__name__}: {error}") from error
    if name not in DRAFTERS:
        raise ValueError(f"drafter {name!r}: {where} ran but registered no drafter named {name!r} (registered: "
                         f"{sorted(DRAFTERS)})")


def _qualname(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
