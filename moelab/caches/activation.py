"""Activation-aware prefetch (MoE-Infinity): match the sequence's expert activations so far
against those of earlier sequences and prefetch what the best match used next.

MoE-Infinity (Xue et al., "MoE-Infinity: Efficient MoE Inference on Personal Machines with
Sparsity-Aware Expert Cache", §4) traces each request's **Expert Activation Matrix** (EAM): for
every MoE layer ``l`` and expert ``e``, how many of the sequence's tokens were routed to ``e`` at
``l``. Served requests' EAMs form a collection. While a request runs, its EAM so far (every
earlier forward and the current forward's layers up to ``l``) is compared with each EAM of the
collection by cosine similarity over layers ``0..l``; the most similar one predicts the layers
ahead, and experts are prefetched by their share of that EAM's row (its activation ratio).

:class:`ActivationAware` is that rule as a prefetch source of moelab's protocol
(:class:`moelab.predictors.protocol.Prefetcher`, named ``activation`` in configurations, the
what-if grid's ``prefetch`` axis and the cache simulator): asked after MoE layer ``l`` about
``l + d``, it proposes the ``m`` experts of layer ``l + d`` with the largest positive counts in the
best-matching EAM, the most used first (ties: lower id); ``m`` defaults to the number of experts
layer ``l`` used in this forward (what the target layer will likely need: top-k in decode at batch
1), since a proposal of every expert ever used would make a prefetch batch that protects the whole
cache from its own evictions. The collection holds the EAMs of the sequences that
ended before (a new sequence starts at a prefill, step 0), at most ``collection`` of them, the
most recent kept; while it is empty, the sequence's own EAM (its earlier steps) predicts. Counts
come from the forward's routing where the planner has it (every token's top-k), else from the
experts the layer used (the cache simulator's access stream: one count per expert and step).

Where it differs from the paper (stated, not hidden): one target layer per proposal (moelab's
prefetch protocol asks about ``l + d``; MoE-Infinity orders all later layers by activation ratio
and proximity), no clustering of the collection (the paper reduces it with k-means), and a
running model cannot drive it (the live runtime asks fitted predictors; it plans offline, in
what-if grids, sweeps and the cache simulator). A ``cache.warm: trace`` pass of the planner warms
on a copy of it, so the planned pass does not start with the sequences it is about to plan; the
what-if grid's synthetic routing is one stream of decode steps, matched only against its own past.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from moelab.errors import MoelabError

#: The name of the activation-aware prefetch source in configurations and grids.
NAME = "activation"


class ActivationAware:
    """MoE-Infinity's activation-aware prefetch source (see the module docstring).

    ``num_experts``: experts per MoE layer (a list, or one count for every layer; None: read from
    the cache simulator's stream or grown as expert ids arrive). ``m``: experts proposed per call
    (None: as many as layer ``l`` used in this forward). ``collection``: EAMs of earlier sequences
    kept (the most recent)."""

    name = NAME

    def __init__(self, num_experts: Sequence[int] | int | None = None, *, m: int | None = None,
                 collection: int = 256) -> None:
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1):
            raise MoelabError(f"activation-aware prefetch: m={m!r}, expected an integer ≥ 1 (experts per proposal) "
                              "or None.")
        self.m = m
        if isinstance(collection, bool) or not isinstance(collection, (int, np.integer)) or collection < 1:
            raise MoelabError(f"activation-aware prefetch: collection={collection!r}, expected an integer ≥ 1 (EAMs "
                              "of earlier sequences kept).")
        self.num_experts = num_experts
        self.eams: deque[np.ndarray] = deque(maxlen=int(collection))
        """EAMs (MoE layers × experts) of the sequences that ended, oldest first."""
        self.current: np.ndarray | None = None
        """The running sequence's EAM so far."""
        self._forward: tuple[int, int] | None = None  # (seq, step) of the forward being counted
        self._pending: tuple[Any, int] | None = None  # its routing (or stream) and the last layer (group) counted
        self._step = -1
        self._stack: np.ndarray | None = None  # the collection as one (n, L, E) array, built when it changed
        self._norms: np.ndarray | None = None  # (n, L): each EAM's norm over layers 0..l

    # ------------------------------------------------------------------ counting
    def _shape(self, context: Any) -> tuple[int, int]:
        stream = context.stream
        if stream is not None:
            ne = np.asarray(stream.num_experts).reshape(-1)
            return len(ne), int(ne.max())
        L = len(context.routing.ids) if context.routing is not None else context.target_layer + 1
        ne = self.num_experts
        E = (max(int(x) for x in ne) if isinstance(ne, Sequence) else int(ne)) if ne is not None else 1
        return L, E

    def _fit(self, L: int, E: int) -> None:
        """Grow the matrices to at least ``L`` layers × ``E`` experts (zeros; all share one shape)."""
        if self.current is None:
            self.current = np.zeros((L, E), dtype=np.float64)
        if self.current.shape[0] >= L and self.current.shape[1] >= E:
            return
        shape = (max(L, self.current.shape[0]), max(E, self.current.shape[1]))

        def grow(m: np.ndarray) -> np.ndarray:
            out = np.zeros(shape, dtype=np.float64)
            out[: m.shape[0], : m.shape[1]] = m
            return out

        self.current = grow(self.current)
        for i in range(len(self.eams)):
            self.eams[i] = grow(self.eams[i])
        self._stack = None

    def _count(self, layer: int, ids: np.ndarray) -> None:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        ids = ids[ids >= 0]
        if len(ids):
            self._fit(layer + 1, int(ids.max()) + 1)
            np.add.at(self.current[layer], ids, 1.0)

    def _flush(self, group: int) -> None:
        """Count the layers of the pending forward that were not asked about (its last ``d``): from
        its routing, or from the stream's groups between the last one counted and ``group``."""
        if self._pending is None:
            return
        source, done = self._pending
        if hasattr(source, "ids"):
            for ly in range(done + 1, len(source.ids)):
                self._count(ly, source.ids[ly])
        else:
            for g in range(done + 1, group):
                if (int(source.group_seq[g]), int(source.group_step[g])) == self._forward:  # stream mode
                    self._count(int(source.group_layer[g]), source.group_experts(g))
        self._pending = None

    def observe(self, context: Any) -> None:
        """Count layer ``context.layer`` of the current forward (once), starting a new sequence at a
        prefill (step 0), at a step not after the last one, or at another sequence id."""
        L, E = self._shape(context)
        stream = context.stream
        seq, step = int(context.seq), int(context.step)
        routing = context.routing
        # a forward: the planner's own index where it has one (its seq is -1), else (seq, step)
        fwd = (seq, int(routing.forward) if routing is not None else step)
        if fwd != self._forward:
            self._flush(int(context.group))
            new_seq = step == 0 or step <= self._step or (self._forward is not None and seq != self._forward[0])
            if new_seq and self.current is not None and self.current.any():
                self.eams.append(self.current)
                self.current = np.zeros_like(self.current)
                self._stack = None
            self._forward, self._step = fwd, step
        self._fit(L, E)
        if routing is not None:
            self._count(context.layer, routing.ids[context.layer])
            self._pending = (routing, context.layer)
        elif stream is not None:
            self._count(context.layer, stream.group_experts(context.group))
            self._pending = (stream, int(context.group))
        else:
            self._count(context.layer, context.experts)

    # ------------------------------------------------------------------ proposing
    def best_match(self, layer: int) -> np.ndarray | None:
        """The collection's EAM most similar (cosine over layers ``0..layer``) to the current
        sequence's, or None while the collection is empty (the earliest of equals)."""
        if not self.eams or self.current is None:
            return None
        if self._stack is None:  # the collection changed: stack it once, with its prefix norms
            self._stack = np.stack(list(self.eams))
            self._norms = np.sqrt(np.cumsum((self._stack ** 2).sum(axis=2), axis=1))
        seen = self.current[: layer + 1]
        dots = np.einsum("nle,le->n", self._stack[:, : layer + 1], seen)
        norms = self._norms[:, layer] * (np.linalg.norm(seen) or 1.0)
        sims = np.divide(dots, norms, out=np.zeros(len(dots)), where=norms > 0)
        return self.eams[int(np.argmax(sims))]

    def propose(self, context: Any) -> list[int]:
        """The experts of ``context.target_layer``, the best match's most used first (module docstring)."""
        self.observe(context)
        t = int(context.target_layer)
        match = self.best_match(int(context.layer))
        source = match if match is not None else self.current
        if source is None or t >= source.shape[0]:
            return []
        row = source[t]
        order = np.argsort(-row, kind="stable")
        m = self.m if self.m is not None else max(1, len(np.unique(np.asarray(context.experts).reshape(-1))))
        return order[row[order] > 0][:m].tolist()


def is_activation(source: Any) -> bool:
    """Whether ``source`` names the activation-aware prefetch source."""
    return isinstance(source, str) and source == NAME


__all__ = ["NAME", "ActivationAware", "is_activation"]
