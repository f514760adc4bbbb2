"""The :class:`Predictor` base class: the scikit-learn estimator contract for expert predictors.

A predictor guesses, before MoE layer ``l + d`` routes, which experts it will select
(``d`` = ``distance``; 1 = layer-wise, 2 = ProMoE's stride). Contract:

* ``__init__`` only stores hyperparameters (``get_params``/``set_params``/:func:`clone`);
* ``fit(trace)`` checks its inputs, learns, and returns ``self``; learned state lives in
  attributes ending in ``_`` (``model_fingerprint_``, ``trace_id_``, ...);
* they are scikit-learn estimators (:class:`sklearn.base.BaseEstimator`): ``sklearn.base.clone``,
  ``sklearn.utils.validation.check_is_fitted`` (via ``__sklearn_is_fitted__``) and the
  estimator tags work; the input is a routing trace, not an ``X`` array, so the tags say
  so and ``sklearn.utils.estimator_checks`` (which feeds arrays) does not apply;
* **online**: ``predict(layer, hidden=..., token_ids=..., valid=..., m=...)`` with what a
  forward pass has when MoE layer ``layer`` routes (its router input, the token ids, which
  tokens are padding — numpy or torch, on any device) returns the ranked expert ids
  predicted for MoE layer ``layer + distance`` (-1 rows for padding); ``predict_union``
  returns their ordered union (:func:`moelab.predictors.protocol.union_predictions`);
* **offline**: ``predict_trace(trace, layer)`` does the same for every token of a trace.

:mod:`moelab.predictors.protocol` describes the protocol and its three callers.

Subclasses implement ``_fit`` and ``_scores`` (and ``_state``/``_load_state`` for
save/load); the public methods do the checks. Layers are MoE-layer ordinals (0..L-1).

Shape legend: T tokens, E experts, K top-k, H hidden, L MoE layers, m ranked list length.
"""

from __future__ import annotations

import copy
import inspect
import logging
import time
from functools import cached_property
from typing import Any, ClassVar, Literal

import numpy as np
from sklearn.base import BaseEstimator

from moelab.errors import MoelabError, unknown_name
from moelab.predictors.data import TokenIndex
from moelab.predictors.protocol import to_cpu_tensor, to_numpy, union_predictions, valid_mask

log = logging.getLogger(__name__)

Timing = Literal["layer", "iteration", "static"]


class TraceData:
    """A routing trace with the arrays predictors need, read once and cached."""

    def __init__(self, trace) -> None:
        self.trace = trace

    @cached_property
    def index(self) -> TokenIndex:
        return TokenIndex.from_trace(self.trace)

    @cached_property
    def experts(self) -> np.ndarray:
        return self.trace.experts_array().astype(np.int64)

    @cached_property
    def hidden(self):
        return self.trace.hidden_states()

    @cached_property
    def scores(self) -> np.ndarray | None:
        return self.trace.scores_array() if self.trace.has_scores else None


def as_trace_data(trace) -> TraceData:
    """Accept a :class:`TraceData`, a ``RoutingTrace`` or a trace directory."""
    if isinstance(trace, TraceData):
        return trace
    if isinstance(trace, str) or hasattr(trace, "__fspath__"):
        from moelab.trace import open_trace

        trace = open_trace(trace)
    return TraceData(trace)


class Predictor(BaseEstimator):
    """Base class of expert predictors (see the module docstring for the contract)."""

    kind: ClassVar[str] = ""
    """Registry name (set by :func:`moelab.predictors.register_predictor`)."""
    needs_hidden: ClassVar[bool] = False
    """Whether fit/predict use router-input hidden states (trace recorded with hidden_states=True)."""
    needs_model: ClassVar[bool] = False
    """Whether fit needs the model itself (its routers), not only the trace."""
    online: ClassVar[bool] = True
    """False for predictors that need the future (oracle): offline only."""
    reads_routing: ClassVar[str | None] = None
    """For kinds that read the recorded routing itself instead of predicting from inputs
    (``oracle``: ``"same"``, ``repeat``: ``"previous"``): as a prefetch source they propose,
    unfitted, what MoE layer ``l + d`` needs in the same forward, or needed at the previous step
    of the same sequence, in access order. None for every kind that predicts."""
    timing: ClassVar[Timing] = "layer"
    """When a prediction can be issued in a forward pass: ``layer`` (once MoE layer l's
    router input exists), ``iteration`` (from the token id, before layer 0) or ``static``
    (known before the forward). Drives the lead time in GoodPred."""

    def __init__(self, distance: int = 1) -> None:
        self.distance = distance

    # ------------------------------------------------------------------ params (sklearn)
    @classmethod
    def _get_param_names(cls) -> list[str]:
        sig = inspect.signature(cls.__init__)
        return sorted(
            p.name for p in sig.parameters.values()
            if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        )

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """Hyperparameters, as passed to ``__init__``."""
        return {name: getattr(self, name) for name in self._get_param_names()}

    def set_params(self, **params: Any) -> Predictor:
        """Set hyperparameters; returns self. Unknown names get a did-you-mean error."""
        names = self._get_param_names()
        for key, value in params.items():
            if key not in names:
                raise unknown_name(f"parameter of {type(self).__name__}", key, names)
            setattr(self, key, value)
        return self

    def __sklearn_is_fitted__(self) -> bool:
        """For ``sklearn.utils.validation.check_is_fitted``."""
        return self.is_fitted

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.requires_fit = True
        tags.non_deterministic = False
        # fit(trace) and predict(layer, hidden=..., token_ids=...) take no (X, y) arrays
        tags.input_tags.two_d_array = False
        tags.target_tags.required = False
        return tags

    def __repr__(self) -> str:
        defaults = {
            p.name: p.default for p in inspect.signature(type(self).__init__).parameters.values()
        }
        changed = [f"{k}={v!r}" for k, v in self.get_params().items() if defaults.get(k, inspect._empty) != v]
        return f"{type(self).__name__}({', '.join(changed)})"

    def _validate_params(self) -> None:
        d = self.distance
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1:
            raise MoelabError(f"{type(self).__name__}: distance must be an integer ≥ 1, got {d!r}.")

    # ------------------------------------------------------------------ fit
    def fit(self, trace, *, model: Any = None) -> Predictor:
        """Learn from a routing trace (``RoutingTrace``, :class:`TraceData` or path); returns self.

        ``model`` is needed only by predictors with ``needs_model`` (skip); if omitted they
        load the trace's model by name (bundled and tiny models) and check its fingerprint.
        """
        self._validate_params()
        data = as_trace_data(trace)
        tr = data.trace
        if tr.num_rows == 0:
            raise MoelabError(f"cannot fit {self.kind or type(self).__name__} on an empty trace ({tr.path}): record some tokens first.")
        n_seq = len(np.unique(tr.column("seq")))
        if n_seq < 2:
            raise MoelabError(
                f"cannot fit on trace {str(tr.path)!r}: it holds {n_seq} sequence; fitting needs ≥ 2 "
                "(train/validation are split by sequence). Record more prompts."
            )
        self._check_distance(tr.num_moe_layers)
        if self.needs_hidden and not tr.has_hidden_states:
            raise MoelabError(
                f"the {self.kind!r} predictor needs router-input hidden states, but trace {str(tr.path)!r} has none; "
                "record with moelab.record(model, out, hidden_states=True) (CLI: moelab trace ... --hidden-states)."
            )
        meta = tr.meta["model"]
        self.model_name_ = str(meta.get("name"))
        self.model_fingerprint_ = str(meta["fingerprint"])
        self.model_type_ = str(meta.get("model_type"))
        self.num_moe_layers_ = int(tr.num_moe_layers)
        self.num_experts_ = [int(e) for e in tr.num_experts_per_layer]
        self.top_k_ = [int(k) for k in tr.top_k_per_layer]
        self.hidden_size_ = int(meta.get("hidden_size") or 0)
        self.trace_id_ = tr.trace_id
        # One sequence split for every kind: with the default val_fraction/seed all predictors
        # hold out the same sequences of a trace, so their held-out scores compare like for like.
        from moelab.predictors.data import split_sequences

        self.train_sequences_, self.val_sequences_ = split_sequences(
            tr.column("seq"), getattr(self, "val_fraction", 0.1), getattr(self, "seed", 0)
        )
        t0 = time.perf_counter()
        self._fit(data, model)
        self.fit_seconds_ = time.perf_counter() - t0
        log.info("fitted %r on %s in %.1f s", self, tr.path, self.fit_seconds_)
        return self

    def _fit(self, data: TraceData, model: Any) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    # ------------------------------------------------------------------ predict
    @property
    def is_fitted(self) -> bool:
        return hasattr(self, "model_fingerprint_")

    def _check_fitted(self) -> None:
        if not self.is_fitted:
            raise MoelabError(f"{type(self).__name__} is not fitted yet; call .fit(trace) or load a saved predictor first.")

    def _check_distance(self, num_layers: int) -> None:
        if self.distance > num_layers - 1:
            raise MoelabError(
                f"distance d={self.distance} reaches beyond the last MoE layer: the model has {num_layers} MoE "
                f"layers (0..{num_layers - 1}), so d must be ≤ {num_layers - 1}."
            )

    def source_layers(self) -> list[int]:
        """MoE layers l that have a target l + distance."""
        self._check_fitted()
        return list(range(self.num_moe_layers_ - self.distance))

    def _check_layer(self, layer: int) -> int:
        self._check_fitted()
        L = self.num_moe_layers_
        if not isinstance(layer, (int, np.integer)) or not 0 <= layer < L:
            raise MoelabError(f"layer must be an MoE-layer ordinal in 0..{L - 1}, got {layer!r}.")
        if layer + self.distance >= L:
            raise MoelabError(
                f"source layer {layer} + distance {self.distance} = {layer + self.distance} is beyond the last MoE "
                f"layer ({L - 1}); valid source layers are 0..{L - 1 - self.distance}."
            )
        return int(layer)

    def check_model(self, fingerprint: str, name: str | None = None) -> None:
        """Refuse inputs from another model than the one this predictor was fitted on."""
        self._check_fitted()
        if fingerprint != self.model_fingerprint_:
            raise MoelabError(
                f"this {self.kind!r} predictor was fitted on model {self.model_name_!r} (fingerprint "
                f"{self.model_fingerprint_}), but the input comes from model {name!r} (fingerprint {fingerprint}); "
                "fit a predictor on a trace of that model."
            )

    def predict_scores(
        self, layer: int, *, hidden: Any = None, token_ids: Any = None, valid: Any = None
    ) -> np.ndarray:
        """(T, E) float32 ranking scores for MoE layer ``layer + distance`` (higher = likelier).

        ``hidden`` is the router input of MoE layer ``layer`` ((T, H) or (H,)); ``token_ids``
        the input token ids ((T,) or an int); ``valid`` (T,) bool, False for padding tokens
        (their rows are ``-inf`` and not computed). Each may be numpy or torch on any device.
        Pass what the predictor needs (``needs_hidden``); extra inputs are ignored.
        """
        layer = self._check_layer(layer)
        if not self.online:
            raise MoelabError(
                f"the {self.kind!r} predictor needs the future routing and works only offline; "
                "use predict_trace(trace, layer) or moelab.predictors.evaluate()."
            )
        hidden, token_ids, n = self._coerce_inputs(hidden, token_ids)
        mask = valid_mask(valid, n)
        if mask is None or mask.all():
            return np.asarray(self._scores(layer, hidden, token_ids, n), dtype=np.float32)
        out = np.full((n, max(self.num_experts_)), -np.inf, dtype=np.float32)
        k = int(mask.sum())
        if k:
            h = hidden[to_cpu_tensor(mask)] if hidden is not None else None
            ids = token_ids[mask] if token_ids is not None else None
            out[mask] = np.asarray(self._scores(layer, h, ids, k), dtype=np.float32)
        return out

    def _coerce_inputs(self, hidden: Any, token_ids: Any) -> tuple[Any, np.ndarray | None, int]:
        """``hidden`` as a (T, H) CPU torch tensor, ``token_ids`` as (T,) int64 numpy, and T."""
        n = None
        if hidden is not None:
            hidden = to_cpu_tensor(hidden)
            if hidden.dim() == 1:
                hidden = hidden[None]
            hidden = hidden.reshape(-1, hidden.shape[-1])
            if self.hidden_size_ and hidden.shape[-1] != self.hidden_size_:
                raise MoelabError(
                    f"hidden has size {hidden.shape[-1]} per token, but the model's hidden size is {self.hidden_size_}."
                )
            n = hidden.shape[0]
        elif self.needs_hidden:
            raise MoelabError(f"the {self.kind!r} predictor needs hidden= (the router input of the source layer).")
        if token_ids is not None:
            token_ids = np.atleast_1d(to_numpy(token_ids, np.int64)).reshape(-1)
            if n is not None and len(token_ids) != n:
                raise MoelabError(f"hidden has {n} tokens but token_ids has {len(token_ids)}.")
            n = len(token_ids)
        if n is None:
            if self.timing == "static":
                n = 1
            else:
                raise MoelabError(f"the {self.kind!r} predictor needs token_ids= (and/or hidden=) to predict.")
        return hidden, token_ids, n

    def _scores(self, layer: int, hidden: Any, token_ids: np.ndarray | None, n: int) -> np.ndarray:  # pragma: no cover
        raise NotImplementedError

    def predict(
        self, layer: int, *, hidden: Any = None, token_ids: Any = None, m: int | None = None, valid: Any = None
    ) -> np.ndarray:
        """(T, m) int64 expert ids predicted for MoE layer ``layer + distance``, best first.

        ``m`` defaults to the target layer's top-k (as many experts as the model activates).
        Rows of padding tokens (``valid`` False) are ``-1``. Inputs: see :meth:`predict_scores`.
        """
        scores = self.predict_scores(layer, hidden=hidden, token_ids=token_ids, valid=valid)
        ranked = self._rank(scores, layer + self.distance, m)
        mask = valid_mask(valid, len(scores))
        if mask is not None:
            ranked[~mask] = -1
        return ranked

    def predict_union(
        self, layer: int, *, hidden: Any = None, token_ids: Any = None, m: int | None = None,
        valid: Any = None, limit: int | None = None,
    ) -> np.ndarray:
        """(n,) int64: the experts of MoE layer ``layer + distance`` predicted for any valid
        token of this forward, in fetch order (:func:`~moelab.predictors.protocol.union_predictions`)."""
        pred = self.predict(layer, hidden=hidden, token_ids=token_ids, m=m, valid=valid)
        return union_predictions(pred, limit=limit)

    def _rank(self, scores: np.ndarray, target: int, m: int | None) -> np.ndarray:
        E = self.num_experts_[target]
        k = self.top_k_[target] if m is None else m
        if not isinstance(k, (int, np.integer)) or not 1 <= k <= E:
            raise MoelabError(f"m must be an integer in 1..{E} (experts of MoE layer {target}), got {m!r}.")
        scores = scores[:, :E]
        if k == 1:
            return np.argmax(scores, axis=1)[:, None].astype(np.int64)
        # stable sort of -scores: ties go to the lower expert id, deterministic
        return np.argsort(-scores, axis=1, kind="stable")[:, :k].astype(np.int64)

    # ------------------------------------------------------------------ offline
    def predict_trace(
        self, trace, layer: int, *, tokens: np.ndarray | None = None, m: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Predict over a trace: ``(tokens, predicted)`` for source MoE layer ``layer``.

        ``tokens`` are indices into ``TraceData.index`` (all tokens recorded at both layers
        by default); ``predicted`` is (len(tokens), m) int64, best first.
        """
        data = as_trace_data(trace)
        self.check_model(data.trace.model_fingerprint, data.trace.meta["model"].get("name"))
        layer = self._check_layer(layer)
        target = layer + self.distance
        tokens = data.index.pairs(layer, target, tokens)
        scores = self._scores_offline(data, layer, tokens)
        return tokens, self._rank(scores, target, m)

    def _scores_offline(self, data: TraceData, layer: int, tokens: np.ndarray) -> np.ndarray:
        rows = data.index.rows[tokens, layer]
        hidden = None
        if self.needs_hidden:
            if not data.trace.has_hidden_states:
                raise MoelabError(
                    f"the {self.kind!r} predictor needs hidden states, but trace {str(data.trace.path)!r} has none; "
                    "record with hidden_states=True (CLI: --hidden-states)."
                )
            hidden = data.hidden[rows]
        token_ids = data.index.token_id[tokens]
        if len(tokens) == 0:
            return np.zeros((0, max(self.num_experts_)), dtype=np.float32)
        hidden, token_ids, n = self._coerce_inputs(hidden, token_ids)
        return np.asarray(self._scores(layer, hidden, token_ids, n), dtype=np.float32)

    # ------------------------------------------------------------------ persistence hooks
    def _state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """(tensors for safetensors, JSON-able extras) of the learned state beyond identity."""
        return {}, {}

    def _load_state(self, tensors: dict[str, np.ndarray], extra: dict[str, Any], model: Any) -> None:
        """Restore what :meth:`_state` returned."""

    def save(self, path, *, metrics: dict | None = None, overwrite: bool = False, reservation=None):
        """Save as ``predictor.json`` + ``state.safetensors`` in directory ``path`` (atomic)."""
        from moelab.predictors.io import save_predictor

        return save_predictor(self, path, metrics=metrics, overwrite=overwrite, reservation=reservation)


def clone(predictor: Predictor) -> Predictor:
    """A new, unfitted predictor with the same hyperparameters (sklearn's ``clone``)."""
    params = {k: copy.deepcopy(v) for k, v in predictor.get_params().items()}
    return type(predictor)(**params)
