"""Checkpoints: Hugging Face safetensors -> Flax params, the orbax directory that jspec loads, and back to HF.

    hf_import.py      ``convert_hf_checkpoint``: config.json + *.safetensors (one file or sharded; a Llama-family
                      target or an EAGLE-3 head) -> params, checked tensor by tensor, written as a jspec directory
    safetensors_io.py reading *.safetensors (one file or an index of shards), headers first, one tensor at a time
    hf_params.py      HF tensors -> a param tree, every missing, unexpected and misshapen tensor reported at once
    hf_llama.py       a Llama-family target in (``convert_hf_llama``, streamed one stacked parameter at a time)
    hf_mtp.py         the MTP modules a target checkpoint ships, written into its mtp/
    hf_eagle3.py      an EAGLE-3 head in (``convert_hf_eagle3``; safetensors or EAGLE's pytorch_model.bin)
    hf_dflash.py      a DFlash drafter in (``convert_hf_dflash``: z-lab's DFlashDraftModel)
    hf_export.py      params -> an HF directory (``write_hf_llama``, ``write_hf_eagle3``)
    store.py          the jspec directory (config.json + jspec.json + orbax params/): ``load_llama``,
                      ``load_eagle3``, ``load_dflash``, ``load_mtp``/``has_mtp`` (a target's MTP modules in its mtp/),
                      ``read_jspec_meta``, ``DTYPES``, atomic writes
    mtp_layouts.py    the HF layouts of MTP modules inside a target checkpoint (MiMo, DeepSeek)
    eagle3_layouts.py the HF layouts of EAGLE-3 heads, by writer, resolved into one

Every name is importable from ``models.checkpoint``.
"""

from models.checkpoint.hf_dflash import convert_hf_dflash, dflash_param_path
from models.checkpoint.hf_eagle3 import convert_hf_eagle3, eagle3_param_path, looks_like_eagle3
from models.checkpoint.hf_export import write_hf_eagle3, write_hf_llama
from models.checkpoint.hf_import import checkpoint_kind, convert_hf_checkpoint
from models.checkpoint.hf_llama import convert_hf_llama, ignore_tied_lm_head, llama_param_path
from models.checkpoint.hf_params import hf_to_params, resolve_dtype
from models.checkpoint.mtp_layouts import MTP_DIR
from models.checkpoint.safetensors_io import count_tensors, iter_safetensors, safetensors_files, tensor_names
from models.checkpoint.store import (DTYPES, FORMAT_VERSION, TOKENIZER_FILES, atomic_directory, check_destination,
                                     has_mtp, load_dflash, load_eagle3, load_llama, load_mtp, load_params,
                                     read_hf_config, read_jspec_meta, save_params, write_jspec_dir)

__all__ = [
    # hf_import and the readers behind it
    "checkpoint_kind", "convert_hf_checkpoint", "convert_hf_dflash", "convert_hf_eagle3", "convert_hf_llama",
    "count_tensors", "dflash_param_path", "eagle3_param_path", "hf_to_params", "ignore_tied_lm_head",
    "iter_safetensors", "llama_param_path", "looks_like_eagle3", "resolve_dtype", "safetensors_files", "tensor_names",
    # hf_export
    "write_hf_eagle3", "write_hf_llama",
    # store
    "DTYPES", "FORMAT_VERSION", "TOKENIZER_FILES", "atomic_directory", "check_destination", "has_mtp",
    "load_dflash", "load_eagle3", "load_llama", "load_mtp", "load_params", "read_hf_config", "read_jspec_meta",
    "save_params", "write_jspec_dir",
    # mtp_layouts
    "MTP_DIR",
]
