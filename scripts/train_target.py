"""Train the bundled code model: a small Llama on the Python standard library's source.

    python scripts/train_target.py --out /tmp/code-model/target_hf --work-dir /tmp/code-model/work

Resumable: rerun the same command after a kill and it continues from the latest orbax checkpoint in
--work-dir/checkpoints. Writes a Hugging Face directory (config.json, model.safetensors, tokenizer.json) at --out.
"""

import argparse

from jspec.train.target import TrainConfig, llama_hf_config, train_target


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="HF output directory")
    parser.add_argument("--work-dir", required=True, help="tokenizer, token cache and orbax checkpoints")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=7)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--intermediate-size", type=int, default=640)
    parser.add_argument("--untied", action="store_true", help="separate lm_head (default: tied embeddings)")
    defaults = TrainConfig()
    for field in ("steps", "batch_size", "seq_len", "learning_rate", "warmup_steps", "weight_decay", "seed",
                  "checkpoint_every", "eval_every", "eval_batches"):
        parser.add_argument("--" + field.replace("_", "-"), type=type(getattr(defaults, field)),
                            default=getattr(defaults, field))
    parser.add_argument("--corpus-root", default=None, help="source tree to train on (default: the stdlib)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    hf_config = llama_hf_config(args.vocab_size, args.hidden_size, args.num_layers, args.num_heads,
                                args.num_kv_heads, args.intermediate_size, tie_word_embeddings=not args.untied)
    train = TrainConfig(**{f: getattr(args, f) for f in ("steps", "batch_size", "seq_len", "learning_rate",
                                                           "warmup_steps", "weight_decay", "seed",
                                                           "checkpoint_every", "eval_every", "eval_batches")})
    report = train_target(args.out, args.work_dir, hf_config, train, args.corpus_root,
                          progress=not args.no_progress)
    print(f"held-out loss {report['heldout_loss']:.3f} nats/token; wrote {args.out}")


if __name__ == "__main__":
    main()
