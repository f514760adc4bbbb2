"""What one model forward is, computed once and shared by every component.

A top-level forward pre-hook sees the batch's ``input_ids`` (or ``inputs_embeds``), the
attention mask and the KV cache. From them :func:`inspect_forward` tells the batch shape,
which tokens are real, how many tokens the cache already holds, and the phase; the
per-model hook manager (:mod:`moelab.forward.points`) adds the sequence and step ids
and hands the resulting :class:`ForwardContext` to every handler of that forward.

Rules (one place, used by the trace recorder, routing policies, online predictors,
online caches and the hybrid runtime alike):

* **phase** — ``decode`` for one new token per row on a non-empty KV cache, else
  ``prefill`` (a prompt, or a multi-token continuation). The cache is found and measured by
  :func:`moelab.compat.find_cache` (under whatever name the installed transformers passes
  it); a forward that continues earlier tokens with no cache moelab can read is refused,
  never taken for a prompt;
* **sequences and steps** — a forward on an empty cache starts ``batch`` new sequences
  (ids counted from 0 per manager) at step 0; a forward on a non-empty cache with the
  same batch continues them at the next step; a non-empty cache the manager did not see
  start (handlers registered mid-generation, or another batch size) is counted as new
  sequences at step 0 and flagged ``unknown_cache``;
* **valid tokens** — the attention mask's last ``S`` columns; no mask means every token
  is real. Tokens are flattened row-major (``B·S``), the order of the MoE layers' inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from moelab.compat import bound_arguments, find_cache

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
    mask: torch.Tensor | None
    """(B, S) bool on the inputs' device: True for real tokens; None when no attention mask
    was passed (every token is real)."""
    input_ids: torch.Tensor | None
    """(B, S) token ids, or None when the forward was called with ``inputs_embeds``."""

    @property
    def all_real(self) -> bool:
        """True when no attention mask was passed, so every token is real."""
        return self.mask is None

    @property
    def phase(self) -> Phase:
        """``decode`` for one new token per row on a non-empty cache, else ``prefill``."""
        return "decode" if self.past_len > 0 and self.seq_len == 1 else "prefill"


def inspect_forward(args: tuple, kwargs: dict[str, Any], module: Any = None) -> ForwardInputs | None:
    """A :class:`ForwardInputs` from a forward's arguments; None if it has no token inputs.

    ``module`` (the module whose forward is called, or its class) names positional arguments
    after its forward's signature, so a cache passed by position is found too. Raises
    :class:`moelab.compat.UnreadableForwardError` for a continuation whose cache moelab cannot
    read.
    """
    named = bound_arguments(module, args, kwargs)
    input_ids = named.get("input_ids", args[0] if args and module is None else None)
    embeds = named.get("inputs_embeds")
    if isinstance(input_ids, torch.Tensor):
        B, S = input_ids.shape[:2]
    elif isinstance(embeds, torch.Tensor):
        B, S = embeds.shape[:2]
        input_ids = None
    else:
        return None
    mask = named.get("attention_mask")
    cur = mask[:, -S:].detach().bool() if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
    return ForwardInputs(
        batch=int(B),
        seq_len=int(S),
        past_len=find_cache(None, (), named, int(S)).past_len,
        mask=cur,
        input_ids=input_ids,
    )



@dataclass
class ForwardContext:
    """One top-level forward of a model, as every handler sees it (see the module docstring).

    Tensors stay on the inputs' device; the host-side views (``mask_cpu``, ``token_ids``,
    ``positions``) are computed on first use and shared, so a forward makes at most one
    host copy of each however many components read them.
    """

    index: int
    """Ordinal of this forward among the manager's forwards (0, 1, ...)."""
    inputs: ForwardInputs
    phase: Phase
    starts_sequences: bool
    """True when this forward starts new sequences (a prompt), False when it continues them."""
    unknown_cache: bool
    """True for a non-empty KV cache whose sequences the manager did not see start."""
    seq: np.ndarray
    """(B,) int64 sequence id of each batch row."""
    step: int
    """0 for the forward that started the sequences, n for the n-th continuation."""
    row_len_before: np.ndarray
    """(B,) real tokens each row held before this forward."""
    carry: dict[int, torch.Tensor] = field(default_factory=dict)
    """MoE layer ordinal → deferred output waiting to be added to that layer's output."""
    scratch: dict[str, Any] = field(default_factory=dict)
    """Per-forward state of components, keyed by component; dropped with the forward."""
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def batch(self) -> int:
        return self.inputs.batch

    @property
    def seq_len(self) -> int:
        return self.inputs.seq_len

    @property
    def tokens(self) -> int:
        """Tokens in the forward (B·S), padding included: the rows of every MoE layer's input."""
        return self.inputs.batch * self.inputs.seq_len

    @property
    def all_real(self) -> bool:
        """True when every token of the forward is real (no padding)."""
        got = self._cache.get("all_real")
        if got is None:
            m = self.inputs.mask
            got = m is None or bool(m.all())
            self._cache["all_real"] = got
        return got

    def valid(self, device: torch.device | None = None) -> torch.Tensor | None:
        """(B·S,) bool mask of real tokens on ``device`` (default: the inputs'); None if all are real."""
        if self.all_real:
            return None
        key = ("valid", device)  # (torch.device hashes by value)
        got = self._cache.get(key)
        if got is None:
            got = self.inputs.mask.reshape(-1)
            if device is not None:
                got = got.to(device)
            self._cache[key] = got
        return got

    def valid_or_ones(self, n: int, device: torch.device) -> torch.Tensor:
        """The valid mask when it describes ``n`` tokens, else all True (a call on other rows)."""
        v = self.valid(device)
        if v is None or v.numel() != n:
            key = ("ones", n, device)  # one per forward, not one per MoE layer (nobody writes it)
            v = self._cache.get(key)
            if v is None:
                v = self._cache[key] = torch.ones(n, dtype=torch.bool, device=device)
        return v

    @property
    def mask_cpu(self) -> np.ndarray | None:
        """(B, S) bool numpy mask of real tokens, or None when every token is real."""
        if self.all_real:
            return None
        got = self._cache.get("mask_cpu")
        if got is None:
            got = self.inputs.mask.to("cpu").numpy()
            self._cache["mask_cpu"] = got
        return got

    @property
    def token_ids(self) -> np.ndarray:
        """(B, S) int64 token ids on the host (a copy; -1 when called with embeddings)."""
        got = self._cache.get("token_ids")
        if got is None:
            ids = self.inputs.input_ids
            if ids is None:
                got = np.full((self.batch, self.seq_len), -1, dtype=np.int64)
            else:
                got = ids.detach().to("cpu", torch.int64).numpy().copy()  # input_ids may be a reused buffer
            self._cache["token_ids"] = got
        return got

    @property
    def real_token_ids(self) -> np.ndarray:
        """(n,) int64 token ids of the real tokens, row-major (padding left out)."""
        got = self._cache.get("real_token_ids")
        if got is None:
            m = self.mask_cpu
            got = self.token_ids.reshape(-1) if m is None else self.token_ids.reshape(-1)[m.reshape(-1)]
            self._cache["real_token_ids"] = got
        return got

    @property
    def positions(self) -> np.ndarray:
        """(B, S) position of each token among its row's real tokens (padding: the next real one's - 1)."""
        got = self._cache.get("positions")
        if got is None:
            m = self.mask_cpu
            if m is None:
                got = self.row_len_before[:, None] + np.arange(self.seq_len)
            else:
                got = self.row_len_before[:, None] + np.cumsum(m, axis=1) - 1
            self._cache["positions"] = got
        return got
