"""gpt-oss's expert tensors in: the fused, interleaved ``gate_up_proj`` split into gate and up, and the MXFP4 form
the published checkpoints store (openai/gpt-oss-20b, -120b) dequantized.

What the checkpoints hold for layer i (E experts, hidden H, expert width I)::

    model.layers.i.mlp.experts.gate_up_proj          [E, H, 2I]   (bf16: transformers' save_pretrained)
    model.layers.i.mlp.experts.gate_up_proj_blocks   u8[E, 2I, H / 32, 16], _scales u8[E, 2I, H / 32]   (MXFP4)
    model.layers.i.mlp.experts.gate_up_proj_bias     [E, 2I]
    model.layers.i.mlp.experts.down_proj             [E, I, H]    (or _blocks u8[E, H, I / 32, 16], _scales)
    model.layers.i.mlp.experts.down_proj_bias        [E, H]

gate and up interleave along the last axis (gate = [..., 0::2], up = [..., 1::2], transformers' ``GptOssExperts``).
MXFP4 (OCP microscaling): each byte holds two FP4 (e2m1) codes, the low nibble first; each block of 32 values shares
an 8-bit power-of-two exponent biased by 127. A dequantized row of a block tensor is one output feature, so it is
transposed to the [in, out] kernel layout.

:class:`GptOssReader` lists the virtual tensors ``...mlp.experts.{gate,up,down}_proj`` ([E, in, out]) and
``..._proj_bias`` ([E, out]) in their place, which ``hf_llama.llama_param_path`` maps to the stacked expert params
(models/moe.py), and builds each from the stored ones when it is read.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import numpy as np

from models.checkpoint.safetensors_io import read_tensor

# FP4 e2m1 code -> value (the sign in the high bit of the nibble)
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)
_STORED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_blocks|_scales|_bias)?$")


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks u8[E, R, G, 16], scales u8[E, R, G] -> f32[E, G * 32, R]: row r of expert e dequantized (value times
    2 ** (scale - 127)), transposed to [in, out]."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape}: expected [..., G, 16] and [..., G]")
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # [E, R, G, 16, 2]: low nibble first
    values = FP4_VALUES[codes].reshape(scales.shape + (32,))
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return np.swapaxes(values.reshape(scales.shape[:-1] + (-1,)), 1, 2)


class GptOssReader:
    """A gpt-oss checkpoint's tensors as the importer expects them: ``listing()`` yields (file, name, shape) with
    each layer's stored expert tensors replaced by the virtual gate/up/down kernels and biases; ``read(file, name,
    out=None)`` builds a virtual one (other tensors as stored)."""

    def __init__(self, headers: dict[str, tuple[str, tuple[int, ...]]],
                 read: Callable[..., np.ndarray] = read_tensor):
        """headers: tensor name -> (file, shape) (``safetensors_io.tensor_headers``)."""
        self._where = headers
        self._read = read
        self._virtual: dict[str, tuple[tuple[int, ...], Callable[[], np.ndarray]]] = {}
        for name, (_, shape) in headers.items():
            match = _STORED.match(name)
            if match is None:
                continue
            module, proj, kind = match.group(1), match.group(2), match.group(3) or ""
            if kind == "_scales":
                continue
            if kind == "_blocks":
                if f"{module}.{proj}_scales" not in headers:
                    raise ValueError(f"{name}: MXFP4 blocks without {module}.{proj}_scales")
                num_experts, rows, groups, _ = shape
                kernel_shape = (num_experts, groups * 32, rows)
                self._add(module, proj, "", kernel_shape, lambda m=module, p=proj: self._mxfp4(m, p))
            else:  # a kernel [E, in, out] as stored, or a bias [E, out]
                self._add(module, proj, kind, tuple(shape), lambda n=name: self._tensor(n))

    def _tensor(self, name: str) -> np.ndarray:
        return self._read(self._where[name][0], name).astype(np.float32)

    def _mxfp4(self, module: str, proj: str) -> np.ndarray:
        blocks = self._read(self._where[f"{module}.{proj}_blocks"][0], f"{module}.{proj}_blocks")
        scales = self._read(self._where[f"{module}.{proj}_scales"][0], f"{module}.{proj}_scales")
        return dequantize_mxfp4(np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8))

    def _add(self, module: str, proj: str, suffix: str, shape: tuple[int, ...], build: Callable[[], np.ndarray]):
        """The virtual tensor(s) of a stored one: down_proj as it is; gate_up_proj's even columns as gate_proj, its
        odd ones as up_proj. suffix: "" (a kernel [E, in, out]) or "_bias" ([E, out])."""
        if proj == "down_proj":
            self._virtual[f"{module}.down_proj{suffix}"] = shape, build
            return
        half = shape[:-1] + (shape[-1] // 2,)
        self._virtual[f"{module}.gate_proj{suffix}"] = half, lambda: build()[..., 0::2]
        self._virtual[f"{module}.up_proj{suffix}"] = half, lambda: build()[..., 1::2]

    def listing(self) -> Iterator[tuple[str, str, tuple[int, ...]]]:
        for name, (file, shape) in self._where.items():
            if _STORED.match(name) is None:
                yield file, name, shape
        for name, (shape, _) in self._virtual.items():
            yield "", name, shape

    def read(self, file: str, name: str, out: np.ndarray | None = None) -> np.ndarray:
        if name not in self._virtual:
            return self._read(file, name, out=out)
        value = self._virtual[name][1]()
        if out is None:
            return value
        out[...] = value
        return out
