"""Side by side: tokens/s and acceptance length of drafter=None, a separate draft model, and n-gram lookup.

    python scripts/compare_drafters.py                                   # synthetic target, no files needed
    python scripts/compare_drafters.py --target DIR --draft-model DIR    # converted checkpoints

Synthetic mode (no trained weights needed): a random "near-bigram" target (attention damped, sharp lm_head, so
its greedy output soon cycles, as real models often repeat themselves; the MLPs after the first layer damped too)
and, as draft model, the target cut to its first layer (embeddings, first decoder layer, final norm, lm_head: a layer-skip self-drafter). Each engine is
warmed up (compiled) on the same prompts first; the timed calls (median of 3) compile nothing. Speed numbers on CPU say
little about a GPU; the acceptance lengths carry over.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import numpy as np

import jspec
from jspec.bench import compare_methods, format_table
from jspec.drafters.draft_model import DraftModelDrafter
from jspec.drafters.ngram import NgramDrafter
from models.config import ModelConfig
from models.llama import init_params

SYNTHETIC = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_layers=6, num_heads=8,
                        num_kv_heads=4, head_dim=32)


def synthetic_models(seed: int = 0) -> tuple[ModelConfig, dict, ModelConfig, dict]:
    """(target config, near-bigram target params, draft config, the target's first layer as draft params)."""
    params = init_params(SYNTHETIC, jax.random.key(seed))
    layers = params["layers"]
    layers["self_attn"]["o_proj"]["kernel"] = layers["self_attn"]["o_proj"]["kernel"] * 0.02
    later = (np.arange(SYNTHETIC.num_layers) > 0).astype(np.float32)[:, None, None]
    layers["mlp"]["down_proj"]["kernel"] = layers["mlp"]["down_proj"]["kernel"] * (1.0 - 0.8 * later)
    params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * 8.0
    draft_config = ModelConfig(**{**SYNTHETIC.__dict__, "num_layers": 1})
    draft = dict(params, layers=jax.tree.map(lambda a: a[:1], params["layers"]))
    return SYNTHETIC, params, draft_config, draft


def build_engines(args) -> tuple[dict[str, jspec.SpecEngine], int]:
    spec = jspec.SpecConfig(tree=args.tree, num_steps=args.num_steps, topk=args.topk,
                            num_draft_tokens=args.num_draft_tokens)
    common = dict(max_batch_size=args.batch, max_seq_len=args.max_seq_len)
    if args.target:
        engines = {"none": jspec.SpecEngine.from_pretrained(args.target, **common)}
        if args.draft_model:
            engines["draft_model"] = jspec.SpecEngine.from_pretrained(args.target, drafter=args.draft_model,
                                                                      spec=spec, **common)
        engines["ngram"] = jspec.SpecEngine.from_pretrained(args.target, drafter="ngram", spec=spec, **common)
        return engines, engines["none"].config.vocab_size
    config, params, draft_config, draft = synthetic_models()
    engines = {
        "none": jspec.SpecEngine(config, params, **common),
        "draft_model": jspec.SpecEngine(config, params, drafter=DraftModelDrafter(draft_config, config, spec,
                                                                                  args.max_seq_len),
                                        drafter_params=draft, **common),
        "ngram": jspec.SpecEngine(config, params, drafter=NgramDrafter(spec, args.max_seq_len), drafter_params={},
                                  **common),
    }
    return engines, config.vocab_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="converted target directory (default: synthetic)")
    parser.add_argument("--draft-model", help="converted Llama-family draft directory (with --target)")
    parser.add_argument("--tree", default="chain", choices=["chain", "dynamic"])
    parser.add_argument("--num-steps", type=int, default=4)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--num-draft-tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    engines, vocab = build_engines(args)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, args.prompt_len).tolist() for _ in range(args.batch)]
    results = compare_methods(engines, prompts, args.max_new_tokens)
    print(f"backend={jax.default_backend()} tree={args.tree} num_steps={args.num_steps} batch={args.batch} "
          f"prompt_len={args.prompt_len} max_new_tokens={args.max_new_tokens} (greedy)")
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=2)


if __name__ == "__main__":
    main()
