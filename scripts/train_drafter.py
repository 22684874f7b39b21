"""Train a drafter for a trained target (an HF directory, e.g. from scripts/train_target.py).

    python scripts/train_drafter.py --kind eagle3 --target TARGET_HF --out HEAD_HF --work-dir WORK
    python scripts/train_drafter.py --kind draft_model --target TARGET_HF --out DRAFT_HF --work-dir WORK

eagle3: an EAGLE-3 head distilled on the frozen target's features (layers 2, L//2, L-3) and next-token
distributions, with the training-time test (head unrolled --unroll steps on its own outputs, weights
--decay ** i); written in the HF EAGLE-3 layout (config.json + model.safetensors with d2t; t2d.npy beside).
draft_model: a --num-layers Llama distilled from the target, in HF Llama layout with the target's tokenizer.
Both resume from --work-dir/checkpoints after a kill.
"""

import argparse

from jspec.train.target import TrainConfig


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", required=True, choices=["eagle3", "draft_model"])
    parser.add_argument("--target", required=True, help="HF directory of the trained target")
    parser.add_argument("--out", required=True, help="HF output directory")
    parser.add_argument("--work-dir", required=True, help="token cache and orbax checkpoints")
    parser.add_argument("--draft-vocab-size", type=int, default=None,
                        help="eagle3: most frequent target tokens kept (default: the whole target vocab)")
    parser.add_argument("--unroll", type=int, default=3, help="eagle3: training-time-test steps")
    parser.add_argument("--decay", type=float, default=0.8, help="eagle3: loss weight of step i is decay ** i")
    parser.add_argument("--num-layers", type=int, default=2, help="draft_model: layers")
    parser.add_argument("--num-generated", type=int, default=0,
                        help="eagle3: train half on the target's greedy continuations of this many corpus windows")
    defaults = TrainConfig(steps=400, batch_size=8, seq_len=256, learning_rate=2e-3, warmup_steps=20,
                           checkpoint_every=50, eval_every=100, eval_batches=4)
    fields = ("steps", "batch_size", "seq_len", "learning_rate", "warmup_steps", "weight_decay", "seed",
              "checkpoint_every", "eval_every", "eval_batches")
    for field in fields:
        parser.add_argument("--" + field.replace("_", "-"), type=type(getattr(defaults, field)),
                            default=getattr(defaults, field))
    parser.add_argument("--corpus-root", default=None, help="source tree to train on (default: the stdlib)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    train = TrainConfig(**{f: getattr(args, f) for f in fields})
    if args.kind == "eagle3":
        from jspec.train.eagle3_head import train_eagle3
        report = train_eagle3(args.out, args.target, args.work_dir, train, args.draft_vocab_size, args.unroll,
                              args.decay, args.corpus_root, progress=not args.no_progress,
                              num_generated=args.num_generated)
        print(f"held-out distillation loss {report['heldout_loss']:.3f}; wrote {args.out}")
    else:
        from jspec.train.draft_model import train_draft_model
        report = train_draft_model(args.out, args.target, args.work_dir, train, args.num_layers,
                                   args.corpus_root, progress=not args.no_progress)
        print(f"held-out distillation loss {report['heldout_distill_loss']:.3f}; wrote {args.out}")


if __name__ == "__main__":
    main()
