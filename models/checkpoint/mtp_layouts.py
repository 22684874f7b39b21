"""The Hugging Face layouts of multi-token-prediction (MTP) modules shipped inside a target checkpoint, and the
one parameter tree they become (models/mtp.py; docs/checkpoints.md).

    layout     who                              module k's tensors (L = num_hidden_layers)     input_proj concat
    mimo       XiaomiMiMo/MiMo-7B (model_type   model.mtp_layers.{k}.{token_layernorm,         hidden first
               "mimo", MiMoForCausalLM)         hidden_layernorm, input_proj, final_layernorm}
                                                + the block's model.mtp_layers.{k}.{input_layernorm, self_attn.*, ...}
    deepseek   DeepSeek-V3's MTP structure on   model.layers.{L + k}.{enorm, hnorm, eh_proj,   embedding first
               a Llama-family target            shared_head.norm, shared_head.head,
                                                embed_tokens} + the block's model.layers.{L + k}.*

config.json ``num_nextn_predict_layers`` is the number of modules; the layout is read from the tensor names.
DeepSeek's ``embed_tokens`` and ``shared_head.head`` are copies of the target's embedding and lm_head: a copy
equal to the target's is dropped (the drafter uses the target's), a differing ``shared_head.head`` becomes the
module's own ``lm_head`` and a differing ``embed_tokens`` is refused (jspec's MTP drafter embeds with the target's
table).
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util

from models.config import ModelConfig
from models.mtp import MTP_LAYOUTS

MTP_DIR = "mtp"  # the modules' jspec directory inside a converted target directory

_MTP_TENSOR = re.compile(r"^model\.(mtp_layers|layers)\.(\d+)\.(.+)$")

# The module's own tensors, by layout: HF suffix after the module prefix -> param path in the module tree. The
# block's tensors are named as a target layer's (``input_layernorm.weight``, ``self_attn.q_proj.weight`` ...).
OWN_TENSORS: dict[str, dict[str, tuple[str, ...]]] = {
    "mimo": {
        "token_layernorm.weight": ("token_norm", "weight"),
        "hidden_layernorm.weight": ("hidden_norm", "weight"),
        "input_proj.weight": ("input_proj", "kernel"),
        "final_layernorm.weight": ("final_norm", "weight"),
    },
    "deepseek": {
        "enorm.weight": ("token_norm", "weight"),
        "hnorm.weight": ("hidden_norm", "weight"),
        "eh_proj.weight": ("input_proj", "kernel"),
        "shared_head.norm.weight": ("final_norm", "weight"),
        "shared_head.head.weight": ("lm_head", "kernel"),
    },
}
# DeepSeek's copies of target tensors: HF suffix in the module -> the target tensor it copies.
DEEPSEEK_COPIES = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}


def module_prefix(layout: str, index: int, num_target_layers: int) -> str:
    """The HF name prefix of module ``index`` (0-based): ``model.mtp_layers.{k}.`` or ``model.layers.{L + k}.``."""
    if layout not in MTP_LAYOUTS:
        raise ValueError(f"MTP layout={layout!r}: expected one of {MTP_LAYOUTS}")
    return f"model.mtp_layers.{index}." if layout == "mimo" else f"model.layers.{num_target_layers + index}."


def split_mtp_name(name: str, num_target_layers: int) -> tuple[str, int, str] | None:
    """(layout, module index, suffix) when ``name`` is an MTP module's tensor, else None (a target tensor)."""
    match = _MTP_TENSOR.match(name)
    if not match:
        return None
    kind, index, suffix = match.group(1), int(match.group(2)), match.group(3)
    if kind == "mtp_layers":
        return "mimo", index, suffix
    if index >= num_target_layers:
        return "deepseek", index - num_target_layers, suffix
    return None


def abstract_module(layer: ModelConfig, dtype: Any = jnp.float32, own_lm_head: bool = False) -> dict:
    """ShapeDtypeStructs of one module's parameter tree (models/mtp.py): token_norm, hidden_norm, input_proj
    [2H, H], block (a models.llama.DecoderLayer of ``layer``'s shapes), final_norm, and lm_head [H, V] when the
    module has its own."""
    from models.llama import param_shapes

    stacked = param_shapes(layer, dtype)["layers"]
    hidden = layer.hidden_size

    def vector(*shape):
        return jax.ShapeDtypeStruct(shape, dtype)

    tree = {
        "token_norm": {"weight": vector(hidden)},
        "hidden_norm": {"weight": vector(hidden)},
        "input_proj": {"kernel": vector(2 * hidden, hidden)},
        "block": jax.tree.map(lambda leaf: vector(*leaf.shape[1:]), stacked),  # one layer of the [1, ...] stack
        "final_norm": {"weight": vector(hidden)},
    }
    if own_lm_head:
        tree["lm_head"] = {"kernel": vector(hidden, layer.vocab_size)}
    return tree


def module_hf_names(layout: str, index: int, num_target_layers: int,
                    module: Any) -> dict[str, tuple[tuple[str, ...], tuple[int, ...], bool, int | None]]:
    """HF tensor name -> (param path in the module, shape as HF stores it, transpose?, expert or None) for every
    leaf of ``module`` (a tree of arrays or ShapeDtypeStructs) as module ``index`` of ``layout``. Linear weights
    are [out, in] in HF, kernels [in, out] here; a block's stacked experts [E, in, out] are one HF tensor per
    expert (``mlp.experts.{e}.*``, the param's slice ``e``), and DeepSeek-V3's router correction bias is
    ``mlp.gate.e_score_correction_bias``."""
    prefix = module_prefix(layout, index, num_target_layers)
    own = {path: suffix for suffix, path in OWN_TENSORS[layout].items()}
    names = {}
    for path, leaf in traverse_util.flatten_dict(module).items():
        transpose = path[-1] == "kernel"
        shape = tuple(leaf.shape)
        if path[0] == "block" and path[1:3] == ("mlp", "experts"):
            for expert in range(shape[0]):
                suffix = f"mlp.experts.{expert}.{path[3]}." + ("weight" if transpose else "bias")
                names[prefix + suffix] = (path, shape[1:][::-1] if transpose else shape[1:], transpose, expert)
            continue
        if path[0] == "block" and path[-1] == "e_score_correction_bias":
            suffix = "mlp.gate.e_score_correction_bias"
        elif path[0] == "block":
            suffix = ".".join(path[1:-1]) + (".bias" if path[-1] == "bias" else ".weight")
        elif path in own:
            suffix = own[path]
        else:
            raise ValueError(f"MTP param {'/'.join(path)} has no tensor in the {layout!r} layout (expected "
                             f"{sorted('/'.join(p) for p in own)} and block/...)")
        names[prefix + suffix] = (path, shape[::-1] if transpose else shape, transpose, None)
    return names
