"""Greedy text generation for quick looks at what a routing policy does to a model's output."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moelab.errors import MoelabError


@dataclass
class Generation:
    """One greedy continuation."""

    prompt: str
    """The prompt text."""
    text: str
    """The generated continuation (prompt excluded), decoded with special tokens removed."""
    token_ids: list[int]
    """The generated token ids (prompt excluded)."""


@torch.no_grad()
def generate_text(model: Any, tokenizer: Any, prompt: str, max_new_tokens: int = 32) -> Generation:
    """Greedy-decode ``max_new_tokens`` after ``prompt`` with ``model`` as it is (policies applied)."""
    if tokenizer is None:
        raise MoelabError("generation needs a tokenizer; pass tokenizer= to moelab.load or use a model that has one.")
    if max_new_tokens < 1:
        raise MoelabError(f"max_new_tokens={max_new_tokens}: expected an integer ≥ 1.")
    enc = tokenizer(prompt, return_tensors="pt")
    device = next(model.parameters()).device
    input_ids = enc["input_ids"].to(device)
    if input_ids.shape[1] == 0:
        raise MoelabError(
            f"prompt {prompt!r} encodes to no tokens and the tokenizer adds no BOS token; "
            "give a non-empty prompt (--prompt TEXT)."
        )
    mask = enc.get("attention_mask")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = model.generate(
        input_ids,
        attention_mask=mask.to(device) if mask is not None else None,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad,
    )
    new = out[0, input_ids.shape[1]:].tolist()
    return Generation(prompt=prompt, text=tokenizer.decode(new, skip_special_tokens=True), token_ids=new)
