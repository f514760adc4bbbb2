"""The access stream every cache policy replays: which experts each (forward, MoE layer) needs.

Simulation semantics (shared by every policy, online and offline):

* ``replay="forward"`` (default): the stream visits the trace **per forward pass**, **per MoE
  layer in order**; one (forward, moe_layer) is a *group*, and it holds the whole batch's
  tokens, exactly what a cache driven by the running model sees (one access per forward per
  layer; :func:`moelab.caches.online.access_forward`). ``replay="sequence"``: per sequence,
  per step, per MoE layer, as if the batch's sequences ran one after another (moelab's
  earlier order). With one sequence per forward (batch 1) both orders are the same stream.
* The experts a group accesses are the union of the top-k of its tokens, in order of
  descending router weight (an expert chosen by several tokens ranks by its largest weight;
  equal weights by lower expert id): :func:`ordered_union`, the one place this rule lives.
* Decode groups only by default; ``include_prefill=True`` adds the prompt (step 0) groups.
* Experts are named by a global *key*: ``key = key_offset[moe_layer] + expert``. Shared
  experts are not in the stream (always resident, not counted).

Which rows form one forward: a ``forward`` column when the trace has one; otherwise derived
from the trace's row order (:func:`forward_ids`): the recorder writes each forward's rows
together, layer-major, so a forward ends where ``step`` changes or ``moe_layer`` goes back.

Shape legend: N trace rows, K top-k, E experts, L MoE layers, G groups, n accesses.
The stream holds only integer columns (no per-access Python objects).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from moelab.errors import MoelabError, unknown_name

Replay = Literal["forward", "sequence"]
REPLAYS: tuple[str, ...] = ("forward", "sequence")


@dataclass(frozen=True)
class AccessStream:
    """The expert accesses of a trace, grouped per (forward, moe_layer) or per (seq, step,
    moe_layer) (``replay``), as CSR arrays."""

    num_experts: np.ndarray
    """(L,) routed experts per MoE layer."""
    top_k: np.ndarray
    """(L,) experts each token selects per MoE layer."""
    keys: np.ndarray
    """(n,) int32 accessed keys, group after group."""
    group_ptr: np.ndarray
    """(G+1,) int64: accesses of group g are ``keys[group_ptr[g]:group_ptr[g+1]]``."""
    group_layer: np.ndarray
    """(G,) int32 MoE-layer ordinal of each group."""
    group_seq: np.ndarray
    """(G,) int64 sequence id of each group (per-forward groups: the forward's first sequence)."""
    group_step: np.ndarray
    """(G,) int32 step of each group (0 = prefill)."""
    group_pass: np.ndarray
    """(G,) int64 ordinal of the group's pass (a forward, or one sequence's step), 0..P-1 in
    stream order."""
    score_rows: np.ndarray | None = None
    """(R,) int64 trace rows (= rows of ``scores``) of the tokens of each group, in group order;
    set for every stream built from a trace, with or without scores."""
    row_ptr: np.ndarray | None = None
    """(G+1,) int64: the token rows of group g are ``score_rows[row_ptr[g]:row_ptr[g+1]]``."""
    scores: np.ndarray | None = None
    """(N, E_max) float32 router score vectors (the trace's column), or None if not recorded."""
    model_name: str | None = None
    """Name of the model the trace comes from (checked against predictors)."""
    expert_bytes: int | None = None
    """Bytes of one routed expert (from the trace's meta.json), the default unit of ``bytes_moved``."""
    replay: str = "forward"
    """How groups were formed: ``forward`` or ``sequence``."""
    key_offset: np.ndarray = field(init=False)
    """(L+1,) first key of each MoE layer; ``key_offset[-1]`` is the number of keys."""

    def __post_init__(self) -> None:
        off = np.zeros(len(self.num_experts) + 1, dtype=np.int64)
        np.cumsum(self.num_experts, out=off[1:])
        object.__setattr__(self, "key_offset", off)

    @property
    def num_layers(self) -> int:
        return len(self.num_experts)

    @property
    def num_keys(self) -> int:
        return int(self.key_offset[-1])

    @property
    def num_groups(self) -> int:
        return len(self.group_layer)

    @property
    def num_accesses(self) -> int:
        return len(self.keys)

    @property
    def has_scores(self) -> bool:
        return self.scores is not None

    def key_layer(self) -> np.ndarray:
        """(num_keys,) MoE layer of every key."""
        return np.repeat(np.arange(self.num_layers, dtype=np.int32), self.num_experts)

    def group_experts(self, g: int) -> np.ndarray:
        """Expert ids (within the layer) accessed by group ``g``, in access order."""
        a, b = self.group_ptr[g], self.group_ptr[g + 1]
        return self.keys[a:b] - self.key_offset[self.group_layer[g]]

    def group_scores(self, g: int) -> np.ndarray | None:
        """(tokens, E) router scores of group ``g``'s tokens, or None if not recorded."""
        if self.scores is None:
            return None
        rows = self.score_rows[self.row_ptr[g] : self.row_ptr[g + 1]]
        return self.scores[rows, : self.num_experts[self.group_layer[g]]]


def forward_ids(step: np.ndarray, moe_layer: np.ndarray) -> np.ndarray:
    """(N,) int64 forward-pass ordinal of each trace row, from the rows' recorded order.

    The recorder writes a forward's rows together, layer-major (all tokens of MoE layer 0,
    then layer 1, ...), so a new forward starts where ``step`` changes or ``moe_layer`` goes
    back. One case is ambiguous: two prompt forwards in a row of a model with a single MoE
    layer (both step 0, layer 0) read as one; a ``forward`` column resolves it.
    """
    step = np.asarray(step)
    moe_layer = np.asarray(moe_layer)
    new = np.ones(len(step), dtype=bool)
    new[1:] = (step[1:] != step[:-1]) | (moe_layer[1:] < moe_layer[:-1])
    return np.cumsum(new) - 1


def ordered_union(
    row_group: np.ndarray, experts: np.ndarray, weights: np.ndarray | None, num_groups: int
) -> tuple[np.ndarray, np.ndarray]:
    """The experts each group accesses: the union of its rows' top-k, by descending weight.

    ``row_group`` (R,) is each row's group (rows of a group in token order), ``experts``
    (R, K) its expert ids (``-1`` = no expert), ``weights`` (R, K) its router weights (may be
    None when every group has one row: a row's experts are already in router order). An
    expert chosen by several rows ranks by its largest weight; equal weights by lower id.
    Returns ``(counts (G,), experts (n,))``: group g's experts are the next ``counts[g]``.
    The offline stream and the online driver (:func:`moelab.caches.online.access_forward`)
    both call this, so they order a batch's experts identically.
    """
    row_group = np.asarray(row_group, dtype=np.int64)
    experts = np.asarray(experts)
    ok = experts >= 0
    if len(row_group) == num_groups and (num_groups == 0 or np.all(np.diff(row_group) == 1)):
        return ok.sum(axis=1).astype(np.int64), experts[ok].astype(np.int64)
    if weights is None:
        raise MoelabError("weights are needed to order the union of several tokens' experts.")
    w = np.asarray(weights, dtype=np.float64)
    K = experts.shape[1]
    flat = ok.ravel()
    pg = np.repeat(row_group, K)[flat]
    pe = experts.ravel()[flat].astype(np.int64)
    pw = w.ravel()[flat]
    srt = np.lexsort((pe, -pw, pg))  # by group, then descending weight, then expert id
    pg, pe = pg[srt], pe[srt]
    width = int(pe.max()) + 1 if len(pe) else 1
    _, first = np.unique(pg * width + pe, return_index=True)
    first.sort()  # first occurrence of each (group, expert) = its largest weight
    pg, pe = pg[first], pe[first]
    return np.bincount(pg, minlength=num_groups).astype(np.int64), pe


def build_stream(
    seq: np.ndarray,
    step: np.ndarray,
    moe_layer: np.ndarray,
    experts: np.ndarray,
    weights: np.ndarray | None,
    num_experts: Sequence[int],
    top_k: Sequence[int],
    scores: np.ndarray | None = None,
    include_prefill: bool = False,
    model_name: str | None = None,
    replay: Replay = "forward",
    forward: np.ndarray | None = None,
) -> AccessStream:
    """Build the access stream from a trace's routing columns (one entry per row, in the
    trace's row order).

    ``experts`` is (N, K) int, sorted by descending weight per row, ``-1`` padding where a
    layer selects fewer than K; ``weights`` (N, K) is needed only to order unions of several
    tokens (prefill, or a batch's rows with ``replay="forward"``); ``scores`` (N, E) is
    optional (needed by ``mrs``). ``replay``: ``forward`` groups a forward's rows per MoE layer
    (``forward`` gives each row's forward ordinal, else :func:`forward_ids` derives it);
    ``sequence`` groups per (seq, step, moe_layer).

    Size: keyword settings of a public entry point, each with a default (the CLI's options where it has a
    command), so a call names only what it changes; a settings object would be one more thing to build.
    """
    if replay not in REPLAYS:
        raise unknown_name("replay order", replay, REPLAYS)
    seq = np.asarray(seq, dtype=np.int64)
    step = np.asarray(step, dtype=np.int32)
    moe_layer = np.asarray(moe_layer, dtype=np.int32)
    experts = np.asarray(experts)
    if experts.ndim != 2:
        raise MoelabError(f"experts must be an (N, K) array, got shape {experts.shape}.")
    num_experts = np.asarray(num_experts, dtype=np.int64)
    top_k = np.asarray(top_k, dtype=np.int64)
    L = len(num_experts)
    if len(moe_layer) and (moe_layer.min() < 0 or moe_layer.max() >= L):
        raise MoelabError(f"moe_layer values must lie in 0..{L - 1}, got {moe_layer.min()}..{moe_layer.max()}.")
    if np.any(experts >= num_experts[moe_layer][:, None]):
        raise MoelabError("expert ids must be < the layer's number of experts (num_experts).")

    rows = np.arange(len(seq))
    if not include_prefill:
        rows = rows[step != 0]
    if replay == "forward":
        fwd = forward_ids(step, moe_layer) if forward is None else np.asarray(forward, dtype=np.int64)
        if len(fwd) != len(seq):
            raise MoelabError(f"forward must have one entry per trace row ({len(seq)}), got {len(fwd)}.")
        # Stable sort by (forward, moe_layer): a group's rows stay in token order.
        order = rows[np.lexsort((moe_layer[rows], fwd[rows]))]
        major = fwd[order]
    else:
        # Stable sort of the rows by (seq, step, moe_layer): row order within a group is kept.
        order = rows[np.lexsort((moe_layer[rows], step[rows], seq[rows]))]
        major = seq[order] * (int(step.max(initial=0)) + 1) + step[order]
    s, t, ly = seq[order], step[order], moe_layer[order]
    new_group = np.ones(len(order), dtype=bool)
    new_group[1:] = (major[1:] != major[:-1]) | (ly[1:] != ly[:-1])
    row_group = np.cumsum(new_group) - 1  # group of each ordered row
    starts = np.flatnonzero(new_group)
    G = len(starts)
    row_ptr = np.append(starts, len(order)).astype(np.int64)
    new_pass = np.ones(G, dtype=bool)
    gm = major[starts]
    new_pass[1:] = gm[1:] != gm[:-1]
    group_pass = np.cumsum(new_pass) - 1
    # per forward: the forward's first sequence
    gs = np.minimum.reduceat(s, starts) if replay == "forward" and G else s[starts]
    gt = t[starts]

    offsets = np.concatenate([[0], np.cumsum(num_experts)])
    counts, ex = ordered_union(
        row_group, experts[order], None if weights is None else np.asarray(weights)[order], G
    )
    keys = ex + np.repeat(offsets[ly[starts]], counts)
    group_ptr = np.zeros(G + 1, dtype=np.int64)
    np.cumsum(counts, out=group_ptr[1:])

    if scores is not None:
        scores = np.asarray(scores, dtype=np.float32)
        if scores.shape[0] != len(seq) or scores.shape[1] < num_experts.max():
            raise MoelabError(f"scores must be (N, E_max) = ({len(seq)}, {num_experts.max()}), got {scores.shape}.")
    return AccessStream(
        num_experts=num_experts,
        top_k=top_k,
        keys=keys.astype(np.int32),
        group_ptr=group_ptr,
        group_layer=ly[starts].astype(np.int32),
        group_seq=gs.astype(np.int64),
        group_step=gt.astype(np.int32),
        group_pass=group_pass.astype(np.int64),
        score_rows=order.astype(np.int64),  # also without scores: prefetchers map groups to trace rows
        row_ptr=row_ptr,
        scores=scores,
        model_name=model_name,
        replay=replay,
    )


def stream_from_groups(
    groups: Sequence[tuple[int, Sequence[int]]],
    num_experts: Sequence[int],
    top_k: Sequence[int] | None = None,
    scores: Sequence[np.ndarray] | None = None,
) -> AccessStream:
    """A stream written by hand: ``groups`` is ``[(moe_layer, [experts in access order]), ...]``.

    Each group is its own decode step of one sequence unless consecutive groups climb the
    layers (a new pass starts whenever the layer does not increase). ``scores`` gives one
    score vector per group (for ``mrs``). Handy for tests and worked examples.
    """
    num_experts = np.asarray(num_experts, dtype=np.int64)
    L = len(num_experts)
    offsets = np.concatenate([[0], np.cumsum(num_experts)])
    keys, ptr, layers, passes = [], [0], [], []
    p = -1
    prev = L
    for layer, exps in groups:
        if len(set(exps)) != len(exps):
            raise MoelabError(f"a group accesses each expert once, got {list(exps)}.")
        if layer <= prev:
            p += 1
        prev = layer
        keys.extend(int(offsets[layer]) + int(e) for e in exps)
        ptr.append(len(keys))
        layers.append(layer)
        passes.append(p)
    G = len(layers)
    sc = None
    if scores is not None:
        sc = np.zeros((G, int(num_experts.max())), dtype=np.float32)
        for g, v in enumerate(scores):
            sc[g, : len(v)] = v
    return AccessStream(
        num_experts=num_experts,
        top_k=np.asarray(top_k if top_k is not None else [1] * L, dtype=np.int64),
        keys=np.asarray(keys, dtype=np.int32),
        group_ptr=np.asarray(ptr, dtype=np.int64),
        group_layer=np.asarray(layers, dtype=np.int32),
        group_seq=np.zeros(G, dtype=np.int64),
        group_step=np.asarray(passes, dtype=np.int32) + 1,
        group_pass=np.asarray(passes, dtype=np.int64),
        score_rows=np.arange(G, dtype=np.int64) if sc is not None else None,
        row_ptr=np.arange(G + 1, dtype=np.int64) if sc is not None else None,
        scores=sc,
    )


def next_use(stream: AccessStream) -> np.ndarray:
    """(n,) int64: for each access, the index of the next access of the same key (n if none).

    O(n log n) (one stable sort). Belady's policy and the oracle prefetcher read it.
    """
    keys = stream.keys
    n = len(keys)
    order = np.argsort(keys, kind="stable")
    nxt = np.full(n, n, dtype=np.int64)
    same = keys[order[1:]] == keys[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def belady_future(stream: AccessStream, unit: Literal["access", "group"] = "access",
                  scope: Literal["stream", "sequence"] = "stream") -> tuple[np.ndarray, np.ndarray, int]:
    """Belady's view of the future: ``(next use of each access (n,), first use of each key, never)``.

    ``unit="access"``: positions in the access stream, ``never = n``; ``unit="group"``: the
    group of the next use (time advances once per (forward, layer), as in ProMoE's oracle),
    ``never = G``. Values ``>= never`` mean "not used again". ``scope="sequence"``: the oracle
    sees only the current sequence's future (ProMoE's MIN oracle is per sequence): a next use in
    another sequence counts as never. O(n log n).
    """
    if scope not in ("stream", "sequence"):
        raise unknown_name("belady oracle scope", scope, ("stream", "sequence"))
    n = stream.num_accesses
    first = np.full(stream.num_keys, n, dtype=np.int64)
    np.minimum.at(first, stream.keys, np.arange(n))
    nxt = next_use(stream)
    if scope == "sequence":
        seq_of = np.repeat(stream.group_seq, np.diff(stream.group_ptr))
        later = nxt < n
        other = np.zeros(n, dtype=bool)
        other[later] = seq_of[nxt[later]] != seq_of[later]
        nxt = np.where(other, n, nxt)
    if unit == "access":
        return nxt, first, n
    if unit != "group":
        raise unknown_name("belady time unit", unit, ("access", "group"))
    G = stream.num_groups
    group_of = np.append(np.repeat(np.arange(G, dtype=np.int64), np.diff(stream.group_ptr)), G)
    return group_of[nxt], group_of[first], G


def ordered_by_id(stream: AccessStream) -> AccessStream:
    """The same stream with each group's accesses in ascending expert id instead of descending
    router weight (mixtral-offloading serves a step's misses in ascending id; with fewer slots
    than top-k the order decides which of them stay)."""
    import dataclasses

    keys = stream.keys.copy()
    for g in range(stream.num_groups):
        a, b = stream.group_ptr[g], stream.group_ptr[g + 1]
        keys[a:b] = np.sort(keys[a:b])
    return dataclasses.replace(stream, keys=keys)
