"""Training the bundled tiny MoE models on moelab's synthetic tasks.

    from moelab.training import Trainer, preset
    trainer = Trainer(preset("mixtral"), ckpt_dir="runs/train-tiny/mixtral", minutes=30)
    trainer.run()
    trainer.export("moelab/bundled/moelab-tiny-mixtral", overwrite=True)

``moelab.training.quick_eval`` is a greedy checker (arith exact match, pycode pass@1 with
tests run in a subprocess). Heavy imports (torch, transformers) happen in the submodules.
"""

from __future__ import annotations

from moelab.training.config import PRESETS, ModelShape, TrainConfig, preset
from moelab.training.trainer import Trainer

__all__ = ["PRESETS", "ModelShape", "TrainConfig", "Trainer", "preset"]
