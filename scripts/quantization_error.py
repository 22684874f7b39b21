"""How far a weight-only quantized target is from its unquantized self: teacher-forced logits over HumanEval prompts.

    python scripts/quantization_error.py --out docs/results/cpu_quantization_error.json
    python scripts/quantization_error.py --model DIR --schemes int8,int4 --num-prompts 40

For each scheme (``models.quantization``, qwix weight-only: int8 / fp8 per output channel, int4 per group of 128;
lm_head and embeddings kept), every prompt position's next-token logits from one forward pass over the prompt,
against the unquantized model's on the same tokens: top-1 agreement (the argmax is the same token), the largest and
the mean absolute logit difference, and the mean KL(unquantized || quantized) in nats. float32 compute.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec.train.corpus import human_eval_prompts
from models.attention import KVCache


def prompt_logits(engine: jspec.SpecEngine, ids: list[list[int]]) -> list[np.ndarray]:
    """The target's logits at every position of each prompt (one forward pass, right-padded batch)."""
    config = engine.config
    width = max(len(p) for p in ids)
    tokens = np.zeros((len(ids), width), np.int32)
    for row, prompt in enumerate(ids):
        tokens[row, :len(prompt)] = prompt
    cache = KVCache.zeros(config.num_layers, len(ids), width, config.num_kv_heads, config.head_dim, jnp.float32,
                          per_layer=True)
    positions = jnp.broadcast_to(jnp.arange(width), tokens.shape)
    model = engine.setup.target_model()
    logits = jax.jit(lambda p, t: model.apply({"params": p}, t, positions, cache,
                                              jnp.zeros((len(ids),), jnp.int32)).logits)(engine.params, tokens)
    logits = np.asarray(logits, np.float64)
    return [logits[row, :len(prompt)] for row, prompt in enumerate(ids)]


def compare(reference: list[np.ndarray], other: list[np.ndarray]) -> dict:
    ref, got = np.concatenate(reference), np.concatenate(other)
    log_p = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
    log_q = got - np.logaddexp.reduce(got, axis=-1, keepdims=True)
    return {"positions": int(len(ref)),
            "top1_agreement": float(np.mean(ref.argmax(-1) == got.argmax(-1))),
            "max_abs_logit_error": float(np.abs(ref - got).max()),
            "mean_abs_logit_error": float(np.abs(ref - got).mean()),
            "mean_kl_nats": float(np.mean(np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)))}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="converted target (default: the bundled code model)")
    parser.add_argument("--schemes", default="int8,fp8,int4")
    parser.add_argument("--num-prompts", type=int, default=164, help="the first N HumanEval prompts")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    model = args.model or jspec.bundled_model()

    def engine(scheme):
        return jspec.SpecEngine.from_pretrained(model, max_batch_size=1, max_seq_len=1024, dtype="float32",
                                                quantization=scheme)

    base = engine(None)
    ids = base.encode([p["prompt"] for p in human_eval_prompts()[:args.num_prompts]])
    batches = [ids[i:i + args.batch_size] for i in range(0, len(ids), args.batch_size)]
    reference = [x for batch in batches for x in prompt_logits(base, batch)]
    report = {"model": model, "prompts": len(ids), "dtype": "float32", "schemes": {}}
    for scheme in [s for s in args.schemes.split(",") if s]:
        quantized = engine(scheme)
        logits = [x for batch in batches for x in prompt_logits(quantized, batch)]
        report["schemes"][scheme] = compare(reference, logits)
        print(scheme, json.dumps(report["schemes"][scheme]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
