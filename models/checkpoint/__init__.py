"""Checkpoints: Hugging Face safetensors -> Flax params, the orbax directory that jspec loads, and back to HF.

    hf_import.py   config.json + *.safetensors (one file or sharded; a Llama-family target or an EAGLE-3 head)
                   -> params, checked tensor by tensor; ``convert_hf_checkpoint`` writes a jspec directory
    hf_export.py   params -> an HF directory (``write_hf_llama``, ``write_hf_eagle3``)
    store.py       the jspec directory (config.json + jspec.json + orbax params/): ``load_llama``,
                   ``load_eagle3``, ``load_mtp``/``has_mtp`` (a target's MTP modules in its mtp/),
                   ``read_jspec_meta``, ``DTYPES``, atomic writes
    mtp_layouts.py the HF layouts of MTP modules inside a target checkpoint (MiMo, DeepSeek)

Every name is importable from ``models.checkpoint``.
"""

from models.checkpoint.hf_export import write_hf_eagle3, write_hf_llama
from models.checkpoint.hf_import import (checkpoint_kind, convert_hf_checkpoint, convert_hf_eagle3, convert_hf_llama,
                                         count_tensors, eagle3_param_path, hf_to_params, iter_safetensors,
                                         llama_param_path, looks_like_eagle3, resolve_dtype, safetensors_files,
                                         tensor_names)
# Private, but jspec/train/target.py reads HF weights with the importer's pieces, this one included.
from models.checkpoint.hf_import import _ignore_tied_lm_head  # noqa: F401
from models.checkpoint.mtp_layouts import MTP_DIR
from models.checkpoint.store import (DTYPES, FORMAT_VERSION, TOKENIZER_FILES, atomic_directory, check_destination,
                                     has_mtp, load_eagle3, load_llama, load_mtp, load_params, read_hf_config,
                                     read_jspec_meta, save_params, write_jspec_dir)

__all__ = [
    # hf_import
    "checkpoint_kind", "convert_hf_checkpoint", "convert_hf_eagle3", "convert_hf_llama", "count_tensors",
    "eagle3_param_path", "hf_to_params", "iter_safetensors", "llama_param_path", "looks_like_eagle3",
    "resolve_dtype", "safetensors_files", "tensor_names",
    # hf_export
    "write_hf_eagle3", "write_hf_llama",
    # store
    "DTYPES", "FORMAT_VERSION", "TOKENIZER_FILES", "atomic_directory", "check_destination", "has_mtp",
    "load_eagle3", "load_llama", "load_mtp", "load_params", "read_hf_config", "read_jspec_meta", "save_params",
    "write_jspec_dir",
    # mtp_layouts
    "MTP_DIR",
]
