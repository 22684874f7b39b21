"""Hugging Face checkpoints in: config.json + *.safetensors (one file or an index of shards) -> Flax params.

``convert_hf_checkpoint`` picks the converter from the source: a Llama-family target (``convert_hf_llama``, which
also writes the MTP modules a target ships into ``mtp/``) or an EAGLE-3 head (``convert_hf_eagle3``; see
``checkpoint_kind``), and writes a jspec directory (see ``store``).
Everything is read and checked before anything is written; a bad source raises ValueError (or
FileNotFoundError) naming the file, and nothing is left at the destination.

The public entry; the readers and converters, one per kind of source:

    safetensors_io.py  reading *.safetensors (one file or an index of shards), headers first
    hf_params.py       HF tensors -> a param tree, checked; the dtype to write
    hf_llama.py        a Llama-family target (streamed, one stacked parameter at a time)
    hf_mtp.py          the MTP modules a target ships
    hf_eagle3.py       an EAGLE-3 head (safetensors or EAGLE's pytorch_model.bin)
    hf_dflash.py       a DFlash drafter (z-lab's DFlashDraftModel)
"""

from __future__ import annotations

from models.checkpoint.hf_dflash import convert_hf_dflash
from models.checkpoint.hf_eagle3 import convert_hf_eagle3, eagle3_tensor_files, iter_torch_bin, looks_like_eagle3
from models.checkpoint.hf_llama import convert_hf_llama
from models.checkpoint.safetensors_io import tensor_names
from models.checkpoint.store import read_hf_config
from models.quantization import QuantizationConfig


def checkpoint_kind(src: str) -> str:
    """'dflash', 'eagle3' or 'llama' for the HF directory ``src``.

    DFlash when config.json's architectures names ``DFlashDraftModel`` (z-lab's) or ``Qwen3DSparkModel``
    (DeepSpec's DSpark).
    EAGLE-3 when config.json's architectures names one of ``EAGLE3_ARCHITECTURES``, or when the tensors are an
    EAGLE-3 head's (``fc.weight`` + ``midlayer.*``/``layers.0.*``; some writers leave architectures out or copy
    the target's); Llama-family otherwise.
    """
    from models.dflash import DFLASH_ARCHITECTURES, DSPARK_ARCHITECTURES
    from models.eagle3 import EAGLE3_ARCHITECTURES

    architectures = read_hf_config(src).get("architectures") or []
    if any(arch in DFLASH_ARCHITECTURES + DSPARK_ARCHITECTURES for arch in architectures):
        return "dflash"
    if any(arch in EAGLE3_ARCHITECTURES for arch in architectures):
        return "eagle3"
    files, reader = eagle3_tensor_files(src)
    if reader is iter_torch_bin:  # EAGLE's own heads say LlamaForCausalLM and ship a pickle
        return "eagle3" if looks_like_eagle3([name for name, _ in reader(files)]) else "llama"
    return "eagle3" if looks_like_eagle3(tensor_names(files)) else "llama"


def convert_hf_checkpoint(src: str, dst: str, dtype: str = "auto", overwrite: bool = False,
                          progress: bool = True, quantization: str | None = None) -> str:
    """Converts a HF directory (Llama-family target, EAGLE-3 head or DFlash drafter, see ``checkpoint_kind``) to
    ``dst``. quantization: "int8" | "fp8" | "int4" stores a target's linear layers quantized
    (``models.quantization``; loading then needs no quantizing and reads a quarter to a half of the bytes)."""
    kind = checkpoint_kind(src)
    if quantization is not None:
        if kind in ("dflash", "eagle3"):
            raise ValueError(f"quantization={quantization!r}: converting stores a target quantized; a {kind} drafter "
                             f"is quantized at load with its target (SpecEngine.from_pretrained(quantization=...))")
        return convert_hf_llama(src, dst, dtype=dtype, overwrite=overwrite, progress=progress,
                                quantization=QuantizationConfig.coerce(quantization))
    convert = {"dflash": convert_hf_dflash, "eagle3": convert_hf_eagle3}.get(kind, convert_hf_llama)
    return convert(src, dst, dtype=dtype, overwrite=overwrite, progress=progress)
