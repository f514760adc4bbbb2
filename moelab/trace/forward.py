"""What a top-level forward pre-hook can tell about the forward in flight.

Shared by the trace recorder and the routing policies: the batch shape, which tokens
are real (attention mask), how many tokens the KV cache already holds, and whether the
forward is a *decode* step (a non-empty cache and one new token per row) or a
*prefill* (an empty cache, or several new tokens per row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

Phase = Literal["prefill", "decode"]


@dataclass
class ForwardInputs:
    """The inputs of one model forward, as seen by a forward pre-hook (``with_kwargs=True``)."""

    batch: int
    """Rows in the batch (B)."""
    seq_len: int
    """New tokens per row in this forward (S)."""
    past_len: int
    """Tokens the KV cache held before this forward (0 for a prompt)."""
    mask: torch.Tensor
    """(B, S) bool, on the inputs' device: True for real tokens, False for padding."""
    input_ids: torch.Tensor | None
    """(B, S) token ids, or None when the forward was called with ``inputs_embeds``."""
    all_real: bool = False
    """True when no attention mask was passed, so every token is real (``mask`` is all True)."""

    @property
    def phase(self) -> Phase:
        """``decode`` for one new token per row on a non-empty cache, else ``prefill``."""
        return "decode" if self.past_len > 0 and self.seq_len == 1 else "prefill"


def inspect_forward(args: tuple, kwargs: dict[str, Any]) -> ForwardInputs | None:
    """A :class:`ForwardInputs` from a forward's arguments; None if it has no token inputs."""
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    embeds = kwargs.get("inputs_embeds")
    if isinstance(input_ids, torch.Tensor):
        B, S = input_ids.shape[:2]
        device = input_ids.device
    elif isinstance(embeds, torch.Tensor):
        B, S = embeds.shape[:2]
        device = embeds.device
        input_ids = None
    else:
        return None
    mask = kwargs.get("attention_mask")
    given = isinstance(mask, torch.Tensor) and mask.dim() == 2
    if given:
        cur = mask[:, -S:].detach().bool()
    else:
        cur = torch.ones(B, S, dtype=torch.bool, device=device)
    return ForwardInputs(
        batch=int(B),
        seq_len=int(S),
        past_len=past_length(kwargs.get("past_key_values")),
        mask=cur,
        input_ids=input_ids,
        all_real=not given,
    )


def past_length(past: Any) -> int:
    """Tokens held by a KV cache (``Cache`` object or legacy tuple); 0 for None or empty."""
    if past is None:
        return 0
    get = getattr(past, "get_seq_length", None)
    if get is not None:
        try:
            return int(get())
        except Exception:  # noqa: BLE001 - caches without layers yet report nothing
            return 0
    try:  # legacy tuple of (k, v) per layer
        return int(past[0][0].shape[-2])
    except Exception:  # noqa: BLE001
        return 0
