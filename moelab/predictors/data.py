"""Align a routing trace by token: the rows of one token across MoE layers.

Traces are written per forward, layer-major; a token is identified by
``(seq, step, pos)``. :class:`TokenIndex` maps every token to its row at every MoE
layer (``-1`` where a layer did not record it), so layer ``l`` and ``l + d`` of the same
token line up. Splits for training are **by sequence**, never by token, so no sequence
contributes to both training and validation.

Shape legend: N trace rows, T tokens, L MoE layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moelab.errors import MoelabError


@dataclass(frozen=True)
class TokenIndex:
    """Tokens of a trace and their row at each MoE layer."""

    rows: np.ndarray
    """(T, L) int64 row of token t at MoE layer l, -1 if absent."""
    seq: np.ndarray
    """(T,) int64 sequence id."""
    step: np.ndarray
    """(T,) int32 step (0 = prompt)."""
    pos: np.ndarray
    """(T,) int32 position in the sequence."""
    token_id: np.ndarray
    """(T,) int64 input token id."""
    phase: np.ndarray
    """(T,) object ``prefill``/``decode``."""

    @property
    def num_tokens(self) -> int:
        return len(self.seq)

    @classmethod
    def from_trace(cls, trace) -> TokenIndex:
        """Index ``trace`` (a :class:`moelab.trace.RoutingTrace`) by ``(seq, step, pos)``."""
        seq = trace.column("seq").astype(np.int64)
        step = trace.column("step").astype(np.int64)
        pos = trace.column("pos").astype(np.int64)
        layer = trace.column("moe_layer").astype(np.int64)
        L = trace.num_moe_layers
        if len(seq) == 0:
            empty = np.zeros(0, dtype=np.int64)
            return cls(np.zeros((0, L), np.int64), empty, empty.astype(np.int32), empty.astype(np.int32),
                       empty, np.zeros(0, dtype=object))
        keys = np.stack([seq, step, pos], axis=1)
        uniq, inverse = np.unique(keys, axis=0, return_inverse=True)
        inverse = inverse.reshape(-1)
        rows = np.full((len(uniq), L), -1, dtype=np.int64)
        rows[inverse, layer] = np.arange(len(seq), dtype=np.int64)
        first = rows.max(axis=1)  # any recorded row of the token, for its scalar columns
        return cls(
            rows=rows,
            seq=uniq[:, 0],
            step=uniq[:, 1].astype(np.int32),
            pos=uniq[:, 2].astype(np.int32),
            token_id=trace.column("token_id").astype(np.int64)[first],
            phase=trace.column("phase")[first],
        )

    def pairs(self, source: int, target: int, tokens: np.ndarray | None = None) -> np.ndarray:
        """Token indices (into this index) recorded at both MoE layers ``source`` and ``target``."""
        ok = (self.rows[:, source] >= 0) & (self.rows[:, target] >= 0)
        if tokens is not None:
            mask = np.zeros(self.num_tokens, dtype=bool)
            mask[tokens] = True
            ok &= mask
        return np.flatnonzero(ok)

    def tokens_of(self, sequences: np.ndarray | None = None, phase: str | None = None) -> np.ndarray:
        """Token indices whose sequence is in ``sequences`` (all if None) and phase matches."""
        ok = np.ones(self.num_tokens, dtype=bool)
        if sequences is not None:
            ok &= np.isin(self.seq, sequences)
        if phase is not None:
            ok &= self.phase == phase
        return np.flatnonzero(ok)


def split_sequences(sequences: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split sequence ids into (train, validation), seeded; validation gets ≥ 1 and ≤ n-1.

    The default ``val_fraction=0.1`` is ProMoE's 9:1 train/eval split, taken over
    *sequences* so that tokens of one prompt never sit on both sides.
    """
    sequences = np.unique(np.asarray(sequences, dtype=np.int64))
    n = len(sequences)
    if n < 2:
        raise MoelabError(
            f"fitting needs a trace with at least 2 sequences (train and validation are split by "
            f"sequence), got {n}; record more prompts."
        )
    if not 0.0 < val_fraction < 1.0:
        raise MoelabError(f"val_fraction must be in (0, 1), got {val_fraction!r}.")
    n_val = min(max(1, round(val_fraction * n)), n - 1)
    perm = np.random.default_rng(seed).permutation(n)
    val = np.sort(sequences[perm[:n_val]])
    train = np.sort(sequences[perm[n_val:]])
    return train, val


def multi_hot(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """(n, E) float32 multi-hot of (n, K) expert ids (-1 ignored)."""
    out = np.zeros((len(experts), num_experts), dtype=np.float32)
    r, c = np.nonzero(experts >= 0)
    out[r, experts[r, c]] = 1.0
    return out
