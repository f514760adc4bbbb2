"""``moelab train-tiny``: train a bundled-style tiny MoE model on the synthetic tasks."""

from __future__ import annotations

import argparse
from pathlib import Path

from moelab.cli._util import emit_json, positive_int


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train-tiny",
        help="train a tiny MoE model on the synthetic arith/pycode tasks",
        description=(
            "Train a tiny Mixtral- or Qwen2-MoE-style model on moelab's synthetic tasks "
            "(seeded, checkpointed, resumable) and save it with save_pretrained plus a model card."
        ),
    )
    p.add_argument("--model", required=True, choices=["mixtral", "qwen2moe"], help="preset")
    p.add_argument("--out", required=True, help="directory for the trained model")
    p.add_argument("--minutes", type=float, default=None, help="wall-time budget for training")
    p.add_argument(
        "--max-steps",
        type=positive_int,
        default=None,
        help="total optimizer steps (exactly reproducible; on --resume, extends a finished run)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint")
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        help="checkpoint and tokenizer directory (default runs/train-tiny/<model>)",
    )
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default 2)")
    p.add_argument("--seed", type=int, default=None, help="seed (default 0)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moelab._output import reserve_output
    from moelab.training import Trainer, preset

    # claim --out before training: refused if it exists (without --overwrite) or is being written
    reservation = reserve_output(args.out, args.overwrite, what="model output",
                                 hint="pass --overwrite to replace it or choose another --out")
    cfg = preset(args.model)
    if args.threads is not None:
        cfg.threads = args.threads
    if args.seed is not None:
        cfg.seed = args.seed
    ckpt = Path(args.checkpoint_dir or Path("runs") / "train-tiny" / args.model)
    with reservation:
        trainer = Trainer(
            cfg,
            ckpt,
            minutes=args.minutes,
            resume=args.resume,
            progress=not args.no_progress,
            max_steps=args.max_steps,
        )
        trainer.run()
        summary = trainer.export(args.out, reservation=reservation)
    emit_json(
        {k: summary[k] for k in ("name", "parameters", "steps", "train_wall_s", "validation")}
    )
    return 0
