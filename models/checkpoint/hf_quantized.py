"""Reading the quantized Llama checkpoints users download: compressed-tensors (vLLM / llm-compressor) and ModelOpt
FP8, as far as their weights map to weight-only quantization.

What is read, and how it maps (``weight`` is a Linear's [out, in]):

- compressed-tensors, ``format`` "int-quantized" / "naive-quantized" / "float-quantized": ``weight`` int8 or
  float8_e4m3fn, ``weight_scale`` [out, 1] ("channel"), [1] or [] ("tensor"), or [out, in / g] ("group"),
  symmetric (no ``weight_zero_point``) -> scheme "int8" or "fp8" (int8 groups: "int8" per channel).
- compressed-tensors, ``format`` "pack-quantized", 4 bits: ``weight_packed`` int32 [out, in / 8] (eight values per
  word, the lowest bits first, each stored as value + 8), ``weight_scale`` [out, in / g], ``weight_shape`` [2],
  symmetric -> scheme "int4" with group size g.
- ModelOpt, ``quant_algo`` "FP8" (``quantization_config.quant_method`` "modelopt" or ``hf_quant_config.json``):
  ``weight`` float8_e4m3fn with a per-tensor ``weight_scale`` -> scheme "fp8".
- DeepSeek's block FP8 (``quant_method`` "fp8" with ``weight_block_size`` [b0, b1], as DeepSeek-V3/R1 ship and
  transformers' FineGrainedFP8 writes): ``weight`` float8_e4m3fn [out, in], ``weight_scale_inv`` f32
  [ceil(out / b0), ceil(in / b1)], one scale per block, by which the block is multiplied -> scheme "fp8".

Each quantized weight is dequantized (q * scale, in float32) into the float tensor the importer expects, stored in
the conversion dtype, and ``jspec.json`` records the scheme, so ``SpecEngine.from_pretrained`` quantizes the loaded
model again with it (qwix's absmax scales: close to the checkpoint's integers, not always equal; fp8 per tensor
becomes fp8 per channel) unless told otherwise. Keeping the checkpoint's own integers needs jspec to store quantized
params, which it does not yet. Activation scales (``input_scale``, W8A8's dynamic activations) are dropped:
activations run in the compute dtype. Refused by name: zero points (asymmetric), other bit widths, sparsity
compressors, ModelOpt algorithms other than FP8 (NVFP4, INT4_AWQ, W4A8...), and modules that target anything but
Linear layers.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from models.checkpoint.safetensors_io import read_tensor

QUANTIZED_SUFFIXES = ("weight_scale", "weight_scale_inv", "weight_zero_point", "weight_packed", "weight_shape", "input_scale",
                      "weight_global_scale", "input_global_scale", "k_scale", "v_scale")


@dataclasses.dataclass(frozen=True)
class QuantizedCheckpoint:
    """method: "compressed-tensors" | "modelopt"; scheme / group_size: how ``models.quantization`` re-quantizes."""

    method: str
    scheme: str
    group_size: int | None = None
    block_size: tuple[int, int] | None = None  # block FP8's weight_block_size (read by the DequantizingReader)

    def meta(self) -> dict:
        """What jspec.json records (``models.quantization.QuantizationConfig``'s fields)."""
        return {"scheme": self.scheme, **({} if self.group_size is None else {"group_size": self.group_size})}


def read_quantization(src: str, hf_config: dict) -> QuantizedCheckpoint | None:
    """The checkpoint's quantization as jspec reads it, None for a float checkpoint; ValueError naming what is not
    supported."""
    config = hf_config.get("quantization_config")
    modelopt = os.path.join(src, "hf_quant_config.json")
    if config is None and os.path.isfile(modelopt):
        with open(modelopt) as f:
            config = {"quant_method": "modelopt", **json.load(f).get("quantization", {})}
    if config is None:
        return None
    method = config.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    if method == "modelopt":
        algo = config.get("quant_algo")
        if algo != "FP8":
            raise ValueError(f"ModelOpt quant_algo={algo!r}: only 'FP8' maps to weight-only quantization")
        return QuantizedCheckpoint("modelopt", "fp8")
    if method == "fp8":
        block = config.get("weight_block_size")
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0
                                                                             for b in block)):
            raise ValueError(f"quantization_config quant_method='fp8' weight_block_size={block!r}: expected [b0, b1] "
                             f"(DeepSeek's block FP8)")
        if config.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"quantization_config fmt={config['fmt']!r}: expected 'e4m3'")
        return QuantizedCheckpoint("fp8-block", "fp8", block_size=(int(block[0]), int(block[1])))
    raise ValueError(f"quantization_config.quant_method={method!r}: jspec reads 'compressed-tensors', 'modelopt' "
                     f"(FP8) and 'fp8' (block FP8) checkpoints")


def _compressed_tensors(config: dict) -> QuantizedCheckpoint:
    fmt = config.get("format")
    if config.get("sparsity_config"):
        raise ValueError("compressed-tensors sparsity_config: sparse checkpoints are not supported")
    groups = list((config.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors with {len(groups)} config_groups: jspec reads one scheme per model")
    group = groups[0]
    weights = group.get("weights") or {}
    if set(group.get("targets") or []) != {"Linear"}:
        raise ValueError(f"compressed-tensors targets={group.get('targets')!r}: expected ['Linear']")
    if not weights.get("symmetric", True):
        raise ValueError("compressed-tensors weights.symmetric=false: zero points are not supported")
    bits, kind, strategy = weights.get("num_bits"), weights.get("type"), weights.get("strategy")
    if fmt == "pack-quantized" and bits == 4 and kind == "int" and strategy == "group":
        return QuantizedCheckpoint("compressed-tensors", "int4", int(weights["group_size"]))
    if fmt in ("int-quantized", "naive-quantized") and bits == 8 and kind == "int":
        return QuantizedCheckpoint("compressed-tensors", "int8")
    if fmt == "float-quantized" and bits == 8 and kind == "float":
        return QuantizedCheckpoint("compressed-tensors", "fp8")
    raise ValueError(f"compressed-tensors format={fmt!r} with {bits}-bit {kind} weights ({strategy}): jspec reads "
                     f"int-quantized / naive-quantized int8, float-quantized fp8 and pack-quantized int4 groups")


class DequantizingReader:
    """The quantized checkpoint's tensors as the float ones the importer expects: ``listing()`` yields (file, name,
    shape) with every quantized Linear's ``weight`` at its logical [out, in] shape and the quantization tensors
    left out; ``read(file, name, out=None)`` returns a weight dequantized in float32 (other tensors as stored)."""

    def __init__(self, headers: dict[str, tuple[str, tuple[int, ...]]], block_size: tuple[int, int] | None = None):
        """headers: tensor name -> (file, shape) (``safetensors_io.tensor_headers``); block_size: block FP8's
        [b0, b1] (``QuantizedCheckpoint.block_size``)."""
        self._where, self._block = headers, block_size
        zero_points = [n for n in headers if n.endswith(".weight_zero_point")]
        if zero_points:
            raise ValueError(f"{zero_points[0]}: asymmetric quantization (zero points) is not supported")

    def listing(self):
        for name, (file, shape) in self._where.items():
            module, _, leaf = name.rpartition(".")
            if leaf == "weight_packed":
                file_shape = self._where[f"{module}.weight_shape"]
                shape = tuple(int(x) for x in read_tensor(file_shape[0], f"{module}.weight_shape"))
                yield file, f"{module}.weight", shape
            elif leaf not in QUANTIZED_SUFFIXES:
                yield file, name, shape

    def read(self, file: str, name: str, out: np.ndarray | None = None) -> np.ndarray:
        module = name.rpartition(".")[0]
        scale_name = f"{module}.weight_scale"
        if name.endswith(".weight") and f"{module}.weight_scale_inv" in self._where:
            return self._read_blocks(file, name, f"{module}.weight_scale_inv", out)
        if not name.endswith(".weight") or scale_name not in self._where:
            return read_tensor(file, name, out=out)
        scale = read_tensor(self._where[scale_name][0], scale_name).astype(np.float32)
        if f"{module}.weight_packed" in self._where:
            q = _unpack_int4(read_tensor(self._where[f"{module}.weight_packed"][0], f"{module}.weight_packed"),
                             tuple(int(x) for x in read_tensor(self._where[f"{module}.weight_shape"][0],
                                                               f"{module}.weight_shape")))
        else:
            q = read_tensor(file, name).astype(np.float32)
        value = q.astype(np.float32) * _broadcast_scale(scale, q.shape, scale_name)
        if out is None:
            return value
        out[...] = value
        return out


    def _read_blocks(self, file: str, name: str, scale_name: str, out: np.ndarray | None) -> np.ndarray:
        """A block-FP8 weight [out, in] times its block's scale (``weight_scale_inv`` [ceil(out / b0), ceil(in /
        b1)])."""
        q = read_tensor(file, name).astype(np.float32)
        scale = read_tensor(self._where[scale_name][0], scale_name).astype(np.float32)
        if self._block is None:
            raise ValueError(f"{scale_name}: a block scale, but quantization_config gives no weight_block_size")
        rows, cols = self._block
        grid = (-(-q.shape[0] // rows), -(-q.shape[1] // cols)) if q.ndim == 2 else None
        if scale.shape != grid:
            raise ValueError(f"{scale_name} {scale.shape}: expected {grid} for {name} {q.shape} in blocks of "
                             f"{self._block}")
        value = q * np.repeat(np.repeat(scale, rows, axis=0), cols, axis=1)[:q.shape[0], :q.shape[1]]
        if out is None:
            return value
        out[...] = value
        return out


def _unpack_int4(packed: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """int32 [out, ceil(in / 8)] (value + 8 in each 4-bit field, the lowest first) -> int8 [out, in]."""
    words = packed.astype(np.int64) & 0xFFFFFFFF
    fields = (words[:, :, None] >> (4 * np.arange(8))[None, None, :]) & 0xF
    return (fields.reshape(packed.shape[0], -1)[:, :shape[1]] - 8).astype(np.int8)


def _broadcast_scale(scale: np.ndarray, shape: tuple[int, int], name: str) -> np.ndarray:
    """weight_scale: [] / [1] (tensor), [out, 1] (channel) or [out, in / g] (group) -> broadcastable to [out, in]."""
    if scale.size == 1:
        return scale.reshape(1, 1)
    out_features, in_features = shape
    if scale.ndim == 2 and scale.shape[0] == out_features and in_features % scale.shape[1] == 0:
        return np.repeat(scale, in_features // scale.shape[1], axis=1)
    raise ValueError(f"{name} {scale.shape}: expected [], [1], [{out_features}, 1] or [{out_features}, "
                     f"{in_features} / group]")

