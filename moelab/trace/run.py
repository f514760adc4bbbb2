"""Record a trace of a model generating on a list of prompts (what ``moelab trace`` runs)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from moelab.errors import MoelabError
from moelab.trace.reader import RoutingTrace
from moelab.trace.recorder import TraceRecorder

log = logging.getLogger(__name__)


@torch.no_grad()
def trace_prompts(
    model,
    tokenizer,
    prompts: list[str],
    out: str | Path | None,
    *,
    max_new_tokens: int = 32,
    batch_size: int = 1,
    overwrite: bool = False,
    progress: bool = True,
    **record_kwargs: Any,
) -> RoutingTrace:
    """Greedy-generate ``max_new_tokens`` for every prompt while recording its routing.

    Size: keyword settings of a public entry point, each with a default (the CLI's options where it has a
    command), so a call names only what it changes; a settings object would be one more thing to build.
    """
    from tqdm.auto import tqdm

    if tokenizer is None:
        raise MoelabError("tracing prompts needs a tokenizer; pass tokenizer= to moelab.load or trace_prompts.")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    metadata = {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "batch_size": batch_size}
    metadata.update(record_kwargs.pop("metadata", {}) or {})
    with TraceRecorder(model, out, overwrite=overwrite, metadata=metadata, **record_kwargs) as rec:
        device = next(model.parameters()).device
        for i in tqdm(range(0, len(prompts), batch_size), desc="tracing", unit="batch", disable=not progress):
            batch = prompts[i : i + batch_size]
            # decoder-only: pad on the left, whatever the tokenizer's default (right padding
            # would continue the shorter rows from pad tokens)
            enc = tokenizer(batch, return_tensors="pt", padding=True, padding_side="left").to(device)
            model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
            )
    return rec.trace
