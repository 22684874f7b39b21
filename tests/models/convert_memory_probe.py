"""Peak host memory of a checkpoint conversion, measured in a fresh process.

    python tests/models/convert_memory_probe.py write HF_DIR [--layers 8 ...]   a synthetic sharded HF Llama
    python tests/models/convert_memory_probe.py baseline                         imports + a tiny orbax save
    python tests/models/convert_memory_probe.py convert HF_DIR DST [--dtype D]   converts HF_DIR to DST

``baseline`` and ``convert`` print one JSON line {"peak_rss_bytes": VmHWM}; the conversion's own peak is the
difference. The synthetic checkpoint is written tensor by tensor, so writing it needs about one tensor of memory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

# Synthetic Llama: float32, hidden 2048, intermediate 5632, vocab 32000 (TinyLlama-1.1B's shapes, fewer layers).
SYNTHETIC_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
                    "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 8,
                    "num_attention_heads": 32, "num_key_value_heads": 4, "torch_dtype": "float32",
                    "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048}


def synthetic_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape of a Llama checkpoint with ``config``, in file order."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        shapes.update({prefix + "input_layernorm.weight": (hidden,),
                       prefix + "self_attn.q_proj.weight": (hidden, hidden),
                       prefix + "self_attn.k_proj.weight": (kv, hidden),
                       prefix + "self_attn.v_proj.weight": (kv, hidden),
                       prefix + "self_attn.o_proj.weight": (hidden, hidden),
                       prefix + "post_attention_layernorm.weight": (hidden,),
                       prefix + "mlp.gate_proj.weight": (inter, hidden),
                       prefix + "mlp.up_proj.weight": (inter, hidden),
                       prefix + "mlp.down_proj.weight": (hidden, inter)})
    shapes["model.norm.weight"] = (hidden,)
    if not config.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def synthetic_tensor(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Random float32 values seeded by the name: incompressible, like real weights (orbax compresses what it
    can, and a compressible fill would understate the memory of its writes)."""
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(name))
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


def write_synthetic_checkpoint(directory: str, config: dict = SYNTHETIC_CONFIG, num_shards: int = 4) -> int:
    """Writes config.json + ``num_shards`` safetensors shards + model.safetensors.index.json; returns the bytes of
    tensor data. One tensor at a time: each shard file is written as header + raw tensors, streamed."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    shapes = synthetic_tensor_shapes(config)
    names = list(shapes)
    total = sum(4 * int(np.prod(s)) for s in shapes.values())
    per_shard = -(-total // num_shards)
    shards, current, size = [], [], 0
    for name in names:
        current.append(name)
        size += 4 * int(np.prod(shapes[name]))
        if size >= per_shard:
            shards.append(current)
            current, size = [], 0
    if current:
        shards.append(current)
    weight_map = {}
    for index, shard_names in enumerate(shards):
        file_name = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_streamed_safetensors(os.path.join(directory, file_name), shard_names, shapes)
        weight_map.update({name: file_name for name in shard_names})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


def _write_streamed_safetensors(path: str, names: list[str], shapes: dict[str, tuple[int, ...]]) -> None:
    """A float32 safetensors file (8-byte header length, JSON header, raw data) written one tensor at a time."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in names:
        nbytes = 4 * int(np.prod(shapes[name]))
        header[name] = {"dtype": "F32", "shape": list(shapes[name]), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for name in names:
            f.write(synthetic_tensor(name, shapes[name]).tobytes())


def peak_rss_bytes() -> int:
    """This process's high-water resident set size (VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _import_converter():
    import jax
    import orbax.checkpoint  # noqa: F401

    from models.checkpoint import hf_import

    jax.devices()
    return hf_import


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["write", "baseline", "convert"])
    parser.add_argument("paths", nargs="*")
    parser.add_argument("--layers", type=int, default=SYNTHETIC_CONFIG["num_hidden_layers"])
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)
    if args.mode == "write":
        config = dict(SYNTHETIC_CONFIG, num_hidden_layers=args.layers)
        print(json.dumps({"bytes": write_synthetic_checkpoint(args.paths[0], config, args.shards)}))
        return
    hf_import = _import_converter()
    if args.mode == "baseline":  # everything but the conversion: imports, the backend, one tiny orbax save
        from models.checkpoint.store import save_params
        with tempfile.TemporaryDirectory() as tmp:
            save_params(os.path.join(tmp, "params"), {"x": np.zeros((4,), np.float32)})
    else:
        hf_import.convert_hf_llama(args.paths[0], args.paths[1], dtype=args.dtype, progress=False)
    print(json.dumps({"peak_rss_bytes": peak_rss_bytes()}))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main(sys.argv[1:])
