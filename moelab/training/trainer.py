"""Train a tiny MoE model on the synthetic tasks, with checkpoint/resume and quick evals."""

from __future__ import annotations

import json
import logging
import math
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerFast

from moelab._output import OutputReservation, reserve_output
from moelab.errors import MoelabError
from moelab.training.checkpoint import load_checkpoint, save_checkpoint
from moelab.training.config import TrainConfig
from moelab.training.data import batch_stream, encode, task_texts
from moelab.training.model import build_config, build_model
from moelab.training.quick_eval import quick_eval
from moelab.training.routing_stats import expert_load, load_summary
from moelab.training.tokenizer import train_tokenizer

logger = logging.getLogger(__name__)

#: Steps timed (after two warm-up steps) to fit ``max_steps`` into a time budget.
_CALIBRATION_STEPS = 20
#: Share of a time budget kept for evaluations and checkpoints.
_BUDGET_OVERHEAD = 0.12


def _model_data_fields(d: dict[str, Any]) -> dict[str, Any]:
    """The settings a resumed run must share with its checkpoint (model, data, optimiser)."""
    volatile = {"threads", "max_steps", "checkpoint_every_s", "eval_every_s", "eval_n"}
    return {k: v for k, v in d.items() if k not in volatile}


def _lr(cfg: TrainConfig, step: int, max_steps: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
    return cfg.lr * (
        cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    )


def _tokenizer(cfg: TrainConfig, ckpt_dir: Path, resume: bool) -> PreTrainedTokenizerFast:
    tok_dir = ckpt_dir / "tokenizer"
    if resume and (tok_dir / "tokenizer.json").is_file():
        tok = PreTrainedTokenizerFast.from_pretrained(tok_dir)
        # checkpoints written before these were set pad on the right with a 1024-token limit
        tok.padding_side = "left"
        tok.model_max_length = cfg.shape.max_position_embeddings
        return tok
    rows = task_texts({name: min(n, 5000) for name, n in cfg.n_train.items()}, "train", cfg.seed)
    tok = train_tokenizer((c + t for _, c, t in rows), cfg.vocab_size, cfg.shape.max_position_embeddings)
    tok.save_pretrained(tok_dir)
    return tok


class Trainer:
    """One training run. ``run()`` trains (resuming if asked), then ``export()`` saves the model.

    Args:
        cfg: the run's configuration.
        ckpt_dir: where the checkpoint and the tokenizer live during training.
        minutes: optional wall-time budget; ``max_steps`` is reduced to fit it (the
            chosen value is stored in the checkpoint and the summary).
        resume: continue from ``ckpt_dir/checkpoint.pt`` if it exists.
        progress: show a tqdm bar.
        max_steps: total optimizer steps, overriding ``cfg.max_steps`` and ``minutes``; on
            resume, a larger value extends a finished run (the cosine schedule is
            stretched to the new length: a warm restart).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        ckpt_dir: str | Path,
        minutes: float | None = None,
        resume: bool = False,
        progress: bool = True,
        max_steps: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.ckpt_dir = Path(ckpt_dir)
        self.minutes = minutes
        self.resume = resume
        self.progress = progress
        self.total_steps = max_steps
        if max_steps is not None:
            cfg.max_steps = max_steps
            self.minutes = None

    def setup(self) -> None:
        """Tokenizer, data, model, optimiser; restores the checkpoint when resuming."""
        cfg = self.cfg
        torch.set_num_threads(cfg.threads)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        ckpt = load_checkpoint(self.ckpt_dir) if self.resume else None
        if ckpt is not None:
            missing = [k for k in ("config", "model", "optimizer", "state", "torch_rng")
                       if not isinstance(ckpt, dict) or k not in ckpt]
            if missing:
                raise MoelabError(
                    f"{str(self.ckpt_dir / 'checkpoint.pt')!r} is not a moelab training checkpoint "
                    f"(missing {', '.join(missing)}); delete it and train again without --resume."
                )
        if ckpt is None and (self.ckpt_dir / "checkpoint.pt").exists():
            raise MoelabError(
                f"checkpoint directory {str(self.ckpt_dir)!r} already holds a checkpoint; "
                "pass --resume to continue it or choose another directory."
            )
        if ckpt is not None and _model_data_fields(ckpt["config"]) != _model_data_fields(
            cfg.to_dict()
        ):
            logger.warning("resuming with the checkpoint's model and data settings")
            saved = TrainConfig.from_dict(ckpt["config"])
            saved.threads, saved.max_steps = cfg.threads, cfg.max_steps
            self.cfg = cfg = saved
            torch.set_num_threads(cfg.threads)
        self.tokenizer = _tokenizer(cfg, self.ckpt_dir, resume=ckpt is not None)
        self.train_data = encode(
            self.tokenizer, task_texts(cfg.n_train, "train", cfg.seed), cfg.max_len
        )
        tok = self.tokenizer
        self.model_config = build_config(
            cfg.shape, len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
        )
        torch.manual_seed(cfg.seed)
        self.model = build_model(self.model_config, cfg.experts_implementation)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98)
        )
        self.state: dict[str, Any] = {
            "step": 0,
            "max_steps": cfg.max_steps,
            "calibrated": self.minutes is None,
            "elapsed_s": 0.0,
            "tokens": 0,
            "history": [],
            "evals": [],
        }
        if ckpt is not None:
            self.model.load_state_dict(ckpt["model"])
            self.optimizer.load_state_dict(ckpt["optimizer"])
            self.state = ckpt["state"]
            self.state["_last_calib"] = 0.0
            torch.set_rng_state(ckpt["torch_rng"])
            if self.total_steps is not None:
                self.state["max_steps"] = self.total_steps
                self.state["calibrated"] = True
            logger.info("resumed at step %d of %d", self.state["step"], self.state["max_steps"])

    def checkpoint(self) -> None:
        save_checkpoint(
            {
                "config": self.cfg.to_dict(),
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "state": self.state,
                "torch_rng": torch.get_rng_state(),
            },
            self.ckpt_dir,
        )

    def run(self, max_steps: int | None = None) -> dict[str, Any]:
        """Train until ``state['max_steps']`` (or ``max_steps`` more steps of this call)."""
        if not hasattr(self, "model"):
            self.setup()
        cfg, st, model = self.cfg, self.state, self.model
        stop_at = (
            st["max_steps"] if max_steps is None else min(st["max_steps"], st["step"] + max_steps)
        )
        model.train()
        stream = batch_stream(self.train_data, cfg.batch_tokens, cfg.seed, start_step=st["step"])
        bar = tqdm(
            total=st["max_steps"], initial=st["step"], disable=not self.progress, desc=cfg.name
        )
        t_start = time.monotonic()
        elapsed0 = st["elapsed_s"]
        last_ckpt = last_eval = time.monotonic()
        calib_t0, calib_s0 = None, 0
        while st["step"] < stop_at:
            batch = next(stream)
            lr = _lr(cfg, st["step"], st["max_steps"])
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            out = model(**batch, output_router_logits=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            st["step"] += 1
            st["tokens"] += int(batch["attention_mask"].sum())
            aux = out.aux_loss.item() if out.aux_loss is not None else 0.0
            lm = out.loss.item() - cfg.shape.router_aux_loss_coef * aux
            st["history"].append((st["step"], round(lm, 4), round(aux, 4)))
            st["elapsed_s"] = elapsed0 + time.monotonic() - t_start
            bar.update(1)
            bar.set_postfix(loss=f"{lm:.3f}", aux=f"{aux:.3f}", lr=f"{lr:.1e}")
            if self.minutes is not None and max_steps is None:
                if calib_t0 is None and st["step"] >= 2:
                    calib_t0, calib_s0 = time.monotonic(), st["step"]
                elif calib_t0 is not None and self._recalibrate(
                    calib_t0, calib_s0, first=not st["calibrated"]
                ):
                    stop_at = st["max_steps"]
                    bar.total = st["max_steps"]
            now = time.monotonic()
            if now - last_eval >= cfg.eval_every_s and st["step"] < st["max_steps"]:
                self._eval("validation", cfg.eval_n)
                last_eval = time.monotonic()
            if now - last_ckpt >= cfg.checkpoint_every_s:
                self.checkpoint()
                last_ckpt = time.monotonic()
        bar.close()
        self.checkpoint()
        return st

    def _recalibrate(self, t0: float, s0: int, first: bool) -> bool:
        """Fit ``max_steps`` to the time budget from the speed measured since ``t0``.

        Done after ``_CALIBRATION_STEPS`` steps, then at most once a minute while less than
        60 % of the run is done (the machine may be shared and its speed may change).
        Returns True when ``max_steps`` was updated.
        """
        st, now = self.state, time.monotonic()
        done = st["step"] - s0
        if first and done < _CALIBRATION_STEPS:
            return False
        if not first and (
            now - st.get("_last_calib", 0.0) < 60 or st["step"] > 0.6 * st["max_steps"]
        ):
            return False
        per_step = (now - t0) / max(1, done)
        budget = self.minutes * 60 * (1 - _BUDGET_OVERHEAD) - st["elapsed_s"]
        st["max_steps"] = max(
            st["step"] + 1, min(self.cfg.max_steps, st["step"] + int(budget / per_step))
        )
        st["calibrated"] = True
        st["_last_calib"] = now
        logger.info("%.3f s/step: training %d steps", per_step, st["max_steps"])
        return True

    def _eval(self, split: str, n: dict[str, int] | None, progress: bool = False) -> dict:
        res = quick_eval(
            self.model, self.tokenizer, split=split, n=n, seed=self.cfg.seed, progress=progress
        )
        row = {
            "step": self.state["step"],
            "split": split,
            "arith_exact_match": res["arith"]["exact_match"],
            "arith_n": res["arith"]["n"],
            "pycode_pass@1": res["pycode"]["pass@1"],
            "pycode_n": res["pycode"]["n"],
            "pycode_isolation": res["pycode"]["isolation"],
        }
        self.state["evals"].append(row)
        logger.info("eval %s", row)
        return row

    def export(
        self,
        out_dir: str | Path,
        final_eval_n: dict[str, int] | None = None,
        *,
        overwrite: bool = False,
        reservation: OutputReservation | None = None,
    ) -> dict[str, Any]:
        """Save the model (save_pretrained + tokenizer), its summary and its model card.

        Written atomically (see :mod:`moelab._output`): an existing ``out_dir`` is refused
        unless ``overwrite``; pass a ``reservation`` of it taken before training to claim
        the path before the work (what ``moelab train-tiny`` does).
        """
        from moelab.training.model_card import write_model_card

        res = reservation or reserve_output(out_dir, overwrite, what="model output")
        with res:
            summary = self._export(res.staging, final_eval_n, write_model_card)
            res.commit()
        self.checkpoint()
        return summary

    def _export(self, out: Path, final_eval_n, write_model_card) -> dict[str, Any]:
        cfg = self.cfg
        logger.info("final validation pass (greedy generation on the validation split)")
        val = self._eval("validation", final_eval_n, progress=self.progress)
        load_rows = task_texts({"arith": 200, "pycode": 100}, "validation", cfg.seed)
        counts = expert_load(
            self.model, encode(self.tokenizer, load_rows, cfg.max_len), cfg.shape.top_k
        )
        self.model.config.output_router_logits = False
        self.model.save_pretrained(out)
        self.tokenizer.save_pretrained(out)
        summary = {
            "name": cfg.name,
            "config": cfg.to_dict(),
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "steps": self.state["step"],
            "tokens": self.state["tokens"],
            "train_wall_s": round(self.state["elapsed_s"], 1),
            "time_budget_min": self.minutes,
            "final_lm_loss": float(np.mean([h[1] for h in self.state["history"][-50:]])),
            "validation": val,
            "evals": self.state["evals"],
            "expert_load": counts,
            "expert_load_summary": load_summary(counts),
            "vocab_size": len(self.tokenizer),
        }
        (out / "training_summary.json").write_text(json.dumps(summary, indent=1))
        write_model_card(out, summary)
        return summary
