"""The Hugging Face layouts of EAGLE-3 heads, by writer, resolved into one: jspec's (docs/checkpoints.md).

    layout        marks                                              tensor names         tap convention
    eagle         pytorch_model.bin (EAGLE's own, yuhuili/EAGLE3-*)  midlayer.*           default rule
    specforge     eagle_config (SpecForge, AngelSlim), or nothing    midlayer.*           eagle_config ids = OUTPUT
                  but the architecture                                                     of layer id: hs[id + 1]
    modelopt      eagle_config with ModelOpt's flags                 layers.0.* or        as specforge
                                                                     midlayer.*
    speculators   architectures Eagle3Speculator /                   layers.0.*           top-level ids = INPUT of
                  transformer_layer_config                           (+ embed_tokens)     layer id: hs[id]

``resolve_layout`` returns the flat config.json that ``eagle3_config_from_hf`` reads, with the resolved taps
recorded as ``jspec_eagle3.tap_layers`` (HF ``hidden_states`` indices: the inputs of those target layers; None
when the writer used the default rule (2, L//2, L-3), which needs the target's layer count). Every field that
changes the head's math and that jspec does not implement is refused by name (ValueError) before anything is
read or written.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

# A field -> (is its value one jspec computes exactly?, what the accepted value means). Checked in the
# top-level config, eagle_config and transformer_layer_config alike; absent fields are fine.
_MATH_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "norm_before_fc": (lambda v: not v, "false (no norm before fc)"),
    "norm_before_residual": (lambda v: not v, "false (the residual is the un-normed fused feature)"),
    "use_mtp_layernorm": (lambda v: not v, "false"),
    "parallel_draft_step": (lambda v: v in (None, 1), "1"),
    "use_aux_hidden_state": (lambda v: v in (None, True), "true (EAGLE-3 fuses 3 target layers)"),
    "use_input_layernorm_in_first_layer": (lambda v: v in (None, True), "true"),
    "use_last_layernorm": (lambda v: v in (None, True), "true"),
    "eagle_decoder_type": (lambda v: v in (None, "llama"), "'llama'"),
    "hidden_act": (lambda v: v in (None, "silu"), "'silu'"),
    "attention_bias": (lambda v: not v, "false"),
    "mlp_bias": (lambda v: not v, "false"),
    "tie_word_embeddings": (lambda v: not v, "false (the head has its own lm_head)"),
}

# Tensors a writer may add that hold nothing jspec needs: t2d is d2t's inverse (a membership mask);
# embed_tokens is a copy of the target's embedding, which the head shares (its shape is checked).
IGNORED_TENSORS = ("t2d", "embed_tokens.weight")


def detect_layout(hf_config: dict, src: str) -> str:
    """'eagle', 'speculators', 'modelopt' or 'specforge' for the EAGLE-3 head directory ``src``."""
    architectures = hf_config.get("architectures") or []
    if "Eagle3Speculator" in architectures or "transformer_layer_config" in hf_config \
            or "speculators_config" in hf_config:
        return "speculators"
    has_safetensors = any(f.endswith(".safetensors") for f in os.listdir(src))
    if not has_safetensors and (os.path.isfile(os.path.join(src, "pytorch_model.bin"))
                                or os.path.isfile(os.path.join(src, "pytorch_model.bin.index.json"))):
        return "eagle"
    eagle_config = hf_config.get("eagle_config") or {}
    if any(flag in eagle_config for flag in ("use_aux_hidden_state", "parallel_draft_step", "use_mtp_layernorm",
                                             "use_input_layernorm_in_first_layer", "use_last_layernorm",
                                             "eagle_decoder_type")):
        return "modelopt"
    return "specforge"


def check_math_fields(config: dict, where: str) -> None:
    """ValueError naming the first field of ``config`` whose value changes the math in a way jspec lacks."""
    for field, (supported, meaning) in _MATH_FIELDS.items():
        if field in config and not supported(config[field]):
            raise ValueError(f"EAGLE-3 {where}{field}={config[field]!r} is not supported by jspec (it computes "
                             f"only {field} = {meaning}); refusing to convert rather than run a different head")


def _layer_ids(value: Any, field: str) -> list[int]:
    if (not isinstance(value, list) or len(value) != 3
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)):
        raise ValueError(f"EAGLE-3 config {field}={value!r}: expected 3 non-negative layer ids (jspec's head fuses "
                         f"exactly 3 target layers)")
    return value


def resolve_layout(hf_config: dict, src: str) -> tuple[str, dict]:
    """-> (layout, flat config.json for ``eagle3_config_from_hf`` with ``jspec_eagle3`` recorded).

    Raises ValueError naming any field jspec does not implement."""
    layout = detect_layout(hf_config, src)
    check_math_fields(hf_config, "config.json ")
    eagle_config = hf_config.get("eagle_config") or {}
    if not isinstance(eagle_config, dict):
        raise ValueError(f"EAGLE-3 config.json eagle_config={eagle_config!r}: expected an object")
    check_math_fields(eagle_config, "config.json eagle_config.")
    flat = {k: v for k, v in hf_config.items() if k not in ("jspec_eagle3",)}
    taps = None
    num_steps = None
    if layout == "speculators":
        layer = hf_config.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise ValueError("speculators EAGLE-3 config.json: no transformer_layer_config object")
        check_math_fields(layer, "config.json transformer_layer_config.")
        if hf_config.get("norm_before_residual") is not False:
            # speculators' own default and vLLM's reading of an absent field differ: only an explicit false is
            # the math jspec computes.
            raise ValueError(f"speculators EAGLE-3 config.json norm_before_residual="
                             f"{hf_config.get('norm_before_residual')!r} is not supported by jspec (it computes only "
                             f"norm_before_residual = false, which the config must state)")
        flat = dict(layer, **{k: hf_config[k] for k in ("draft_vocab_size", "target_hidden_size")
                              if hf_config.get(k) is not None})
        flat["architectures"] = list(hf_config.get("architectures") or ["Eagle3Speculator"])
        flat.setdefault("torch_dtype", hf_config.get("torch_dtype") or layer.get("torch_dtype"))
        ids = hf_config.get("eagle_aux_hidden_state_layer_ids")
        if ids:  # INPUT ids: vLLM taps the residual stream entering layer id = HF hidden_states[id]
            taps = list(_layer_ids(ids, "eagle_aux_hidden_state_layer_ids"))
        for method in (hf_config.get("speculators_config") or {}).get("proposal_methods") or []:
            if isinstance(method, dict) and isinstance(method.get("speculative_tokens"), int):
                num_steps = method["speculative_tokens"]
                break
    else:
        if hf_config.get("eagle_aux_hidden_state_layer_ids"):
            raise ValueError(f"EAGLE-3 config.json eagle_aux_hidden_state_layer_ids at the top level of a {layout} "
                             f"layout: its convention (input or output ids) is ambiguous outside speculators' "
                             f"Eagle3Speculator; put the ids in eagle_config (output ids) instead")
        ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
        if ids:  # OUTPUT ids: SpecForge/ModelOpt hook the output of layers[id] = HF hidden_states[id + 1]
            taps = [i + 1 for i in _layer_ids(ids, "eagle_config.eagle_aux_hidden_state_layer_ids")]
    flat["jspec_eagle3"] = {"layout": layout, "tap_layers": taps, "suggested_num_steps": num_steps}
    return layout, flat


def canonical_tensor_name(name: str) -> str:
    """A writer's tensor name -> the ``midlayer.`` spelling (no ``model.`` prefix, ``layers.0.`` -> midlayer)."""
    name = name.removeprefix("model.")
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name
