"""Command lines of the training jobs: ``jspec train-target`` and ``jspec train-drafter``.

scripts/train_target.py and scripts/train_drafter.py call the same functions, so both spellings share one
implementation. Each ``*_main(argv)`` parses its arguments, builds the TrainConfig (a bad value raises ValueError
before any work starts), runs the job and returns 0.
"""

from __future__ import annotations

import argparse

from jspec.train.target import TrainConfig

TRAIN_FIELDS = ("steps", "batch_size", "seq_len", "learning_rate", "warmup_steps", "weight_decay", "seed",
                "checkpoint_every", "eval_every", "eval_batches")
DRAFTER_DEFAULTS = TrainConfig(steps=400, batch_size=8, seq_len=256, learning_rate=2e-3, warmup_steps=20,
                               checkpoint_every=50, eval_every=100, eval_batches=4)

TARGET_DESCRIPTION = """\
Train the bundled code model: a small Llama on the Python standard library's source.

    jspec train-target --out /tmp/code-model/target_hf --work-dir /tmp/code-model/work

Resumable: rerun the same command after a kill and it continues from the latest orbax checkpoint in
--work-dir/checkpoints. Writes a Hugging Face directory (config.json, model.safetensors, tokenizer.json) at --out.
"""

DRAFTER_DESCRIPTION = """\
Train a drafter for a trained target (an HF directory, e.g. from `jspec train-target`).

    jspec train-drafter --kind eagle3 --target TARGET_HF --out HEAD_HF --work-dir WORK
    jspec train-drafter --kind draft_model --target TARGET_HF --out DRAFT_HF --work-dir WORK
    jspec train-drafter --kind dflash --target TARGET_HF --out DFLASH_HF --work-dir WORK
    jspec train-drafter --kind pard --target TARGET_HF --out PARD_HF --work-dir WORK

eagle3: an EAGLE-3 head distilled on the frozen target's features (layers 2, L//2, L-3) and next-token
distributions over the text the target itself generates (--num-generated), with EAGLE-3's training-time test
(the head drafts --unroll steps of a chain on its own outputs, attending its earlier steps through a mask;
step i's loss weighs --decay ** i); the progress bar shows the loss and the head's top-1 agreement with the
target per step. Written in the HF EAGLE-3 layout SpecForge writes (config.json + model.safetensors with d2t
and t2d), which `jspec convert`, SGLang and vLLM read.
--data-parallel-size N trains on N devices (batch rows split, the head replicated, gradients all-reduced).
draft_model: a --num-layers Llama distilled from the target, in HF Llama layout with the target's tokenizer.
dflash: a --num-layers DFlash block drafter (SpecForge's recipe: --num-anchors random blocks per window, each over
the context strictly before its anchor, bidirectional inside, position k's loss weighted exp(-(k-1)/gamma)), on
the target's own greedy continuations (--num-generated), written in z-lab's layout (config.json +
model.safetensors) that `jspec convert`, SGLang and vLLM read.
dspark: the same backbone with a --markov-rank Markov head and a confidence head, DeepSpec's loss (0.1 CE +
0.9 L1 + 1.0 confidence BCE), written in DeepSpec's layout (Qwen3DSparkModel).
pard: a --num-layers PARD draft drafting --num-copies tokens per forward (AMD's shifted mask copies: the window
and K - 1 copies of pard tokens in one masked forward, each (copy k, position p) predicting the token after p from
the text up to p - k), distilled from the target's distributions on corpus text, in AMD's layout (a Llama
config.json with pard_token and spd_type "pard").
All resume from --work-dir/checkpoints after a kill.
"""


def _add_train_config_args(parser: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    """One --flag per TrainConfig field in TRAIN_FIELDS, typed and defaulted from ``defaults``."""
    group = parser.add_argument_group("training")
    for field in TRAIN_FIELDS:
        default = getattr(defaults, field)
        group.add_argument("--" + field.replace("_", "-"), type=type(default), default=default,
                           help=f"(default: {default})")
    parser.add_argument("--corpus-root", default=None, help="source tree to train on (default: the stdlib)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _train_config(args: argparse.Namespace) -> TrainConfig:
    """The parsed TRAIN_FIELDS as a validated TrainConfig (ValueError names a bad value)."""
    return TrainConfig(**{field: getattr(args, field) for field in TRAIN_FIELDS})


def train_target_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=TARGET_DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="HF output directory")
    parser.add_argument("--work-dir", required=True, help="tokenizer, token cache and orbax checkpoints")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=7)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--intermediate-size", type=int, default=640)
    parser.add_argument("--untied", action="store_true", help="separate lm_head (default: tied embeddings)")
    _add_train_config_args(parser, TrainConfig())
    return parser


def train_target_main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Trains a target from the command line ``argv`` (default: sys.argv[1:]); see TARGET_DESCRIPTION."""
    from jspec.train.target import llama_hf_config, train_target

    args = train_target_parser(prog).parse_args(argv)
    train = _train_config(args)
    hf_config = llama_hf_config(args.vocab_size, args.hidden_size, args.num_layers, args.num_heads,
                                args.num_kv_heads, args.intermediate_size, tie_word_embeddings=not args.untied)
    report = train_target(args.out, args.work_dir, hf_config, train, args.corpus_root,
                          progress=not args.no_progress)
    print(f"held-out loss {report['heldout_loss']:.3f} nats/token; wrote {args.out}")
    return 0


def train_drafter_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=DRAFTER_DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", required=True, choices=["eagle3", "draft_model", "dflash", "dspark", "pard"])
    parser.add_argument("--target", required=True, help="HF directory of the trained target")
    parser.add_argument("--out", required=True, help="HF output directory")
    parser.add_argument("--work-dir", required=True, help="token cache and orbax checkpoints")
    parser.add_argument("--draft-vocab-size", type=int, default=None,
                        help="eagle3: most frequent target tokens kept (default: the whole target vocab)")
    parser.add_argument("--unroll", type=int, default=7, help="eagle3: training-time-test steps")
    parser.add_argument("--decay", type=float, default=0.8, help="eagle3: loss weight of step i is decay ** i")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="draft_model, pard: layers (default 2); dflash, dspark: draft layers (default 1)")
    parser.add_argument("--block-size", type=int, default=8,
                        help="dflash, dspark: tokens per block (DFlash drafts block_size - 1, DSpark block_size)")
    parser.add_argument("--num-anchors", type=int, default=16, help="dflash, dspark: blocks per training window")
    parser.add_argument("--loss-decay-gamma", type=float, default=None,
                        help="dflash, dspark: draft i's loss weighs exp(-i / gamma) (default: 7 as SpecForge's DFlash "
                             "recipes, 4 as DeepSpec's DSpark configs)")
    parser.add_argument("--markov-rank", type=int, default=64, help="dspark: rank of the Markov head")
    parser.add_argument("--num-copies", type=int, default=8,
                        help="pard: drafts per forward, K (the shifted mask copies trained together)")
    parser.add_argument("--mask-token-id", type=int, default=None,
                        help="dflash, dspark: the mask token; pard: the pard token (default: the tokenizer's mask "
                             "token, an unused embedding row, <unk> or </s>, in that order)")
    parser.add_argument("--num-generated", type=int, default=2048,
                        help="eagle3, dflash, dspark: regenerate the data: the target's greedy continuations of this "
                             "many corpus windows (cached in --work-dir; 0: train on the corpus itself)")
    parser.add_argument("--generated-fraction", type=float, default=1.0,
                        help="eagle3, dflash, dspark: share of the training text that is the target's continuations "
                             "(1.0: only them, as SpecForge recommends; the rest is corpus text)")
    parser.add_argument("--data-parallel-size", type=int, default=1,
                        help="eagle3, dflash: split each batch's rows over this many devices (a data-parallel mesh; "
                             "--batch-size must be a multiple of it)")
    parser.add_argument("--init-head", default=None,
                        help="eagle3: start from this HF head's weights and draft vocabulary (a second stage)")
    _add_train_config_args(parser, DRAFTER_DEFAULTS)
    return parser


def train_drafter_main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Trains an EAGLE-3 head, a draft model or a DFlash drafter from the command line ``argv``; see
    DRAFTER_DESCRIPTION."""
    args = train_drafter_parser(prog).parse_args(argv)
    train = _train_config(args)
    if args.kind == "eagle3":
        from jspec.train.eagle3_head import train_eagle3

        report = train_eagle3(args.out, args.target, args.work_dir, train, args.draft_vocab_size, args.unroll,
                              args.decay, args.corpus_root, progress=not args.no_progress,
                              num_generated=args.num_generated, generated_fraction=args.generated_fraction,
                              data_parallel_size=args.data_parallel_size, init_head=args.init_head)
        print(f"held-out distillation loss {report['heldout_loss']:.3f}; wrote {args.out}")
    elif args.kind in ("dflash", "dspark"):
        from jspec.train.dflash import train_dflash

        dspark = args.kind == "dspark"
        gamma = args.loss_decay_gamma or (4.0 if dspark else 7.0)
        report = train_dflash(args.out, args.target, args.work_dir, train, args.num_layers or 1, args.block_size,
                              args.num_anchors, gamma, mask_token_id=args.mask_token_id,
                              corpus_root=args.corpus_root, progress=not args.no_progress,
                              num_generated=args.num_generated, data_parallel_size=args.data_parallel_size,
                              markov_rank=args.markov_rank if dspark else None,
                              generated_fraction=args.generated_fraction)
        print(f"held-out loss {report['heldout_loss']:.3f}, {report['heldout_accepted']:.2f} greedy drafts accepted "
              f"per block; wrote {args.out}")
    elif args.kind == "pard":
        from jspec.train.pard import train_pard

        train_pard(args.out, args.target, args.work_dir, train, args.num_layers or 2, args.num_copies,
                   args.mask_token_id, args.corpus_root, progress=not args.no_progress)
    else:
        from jspec.train.draft_model import train_draft_model

        report = train_draft_model(args.out, args.target, args.work_dir, train, args.num_layers or 2,
                                   args.corpus_root, progress=not args.no_progress)
        print(f"held-out distillation loss {report['heldout_distill_loss']:.3f}; wrote {args.out}")
    return 0
