"""Learned prediction (ProMoE §4): one small MLP per (source layer, distance).

Input: the router input (hidden state) of MoE layer l; target: the experts MoE layer
l + d chose, as a multi-hot vector over E. Trained offline on a trace recorded with
``hidden_states=True``; sequences are split 9:1 (``val_fraction``) into train and
validation — by sequence, never by token — and training stops early when top-k accuracy
on the validation sequences stops improving (the best epoch's weights are kept).

ProMoE's setting is ``LearnedPredictor(width=1024, depth=2, loss="l1")`` (L1 on
frequency targets). The default here is multi-label BCE with a narrower MLP, which
trains faster on small models; both are one keyword away.

Inference runs in numpy on the stored float32 weights (input standardisation folded
into the first layer), so a batch-1 prediction is a couple of small GEMVs.

Shape legend: T tokens, H hidden, W width, E experts, K top-k.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import numpy as np

from moelab.errors import MoelabError, unknown_name
from moelab.predictors.base import Predictor, TraceData
from moelab.predictors.data import multi_hot
from moelab.predictors.protocol import to_numpy
from moelab.predictors.registry import register_predictor

log = logging.getLogger(__name__)

Loss = Literal["bce", "l1", "ce"]
_LOSSES = ("bce", "l1", "ce")


@register_predictor("learned")
class LearnedPredictor(Predictor):
    """Per-layer MLPs on router-input hidden states.

    Parameters
    ----------
    distance: predict MoE layer l + distance from layer l.
    width: hidden units of each MLP (ProMoE: 1024).
    depth: number of linear layers (1 = a linear probe; ProMoE: 2).
    dropout: dropout after each hidden layer during training.
    loss: ``bce`` multi-label binary cross-entropy (default); ``l1`` L1 between
        sigmoid outputs and the multi-hot (frequency) target, as ProMoE; ``ce`` softmax
        cross-entropy against the normalised multi-hot.
    lr, weight_decay: AdamW settings.
    batch_size: tokens per step.
    max_epochs, patience: early stopping on validation top-k accuracy.
    val_fraction: share of *sequences* held out for validation (default 9:1).
    max_train_tokens: subsample the training tokens per layer (None = all).
    seed: seeds the split, initialisation and batch order (deterministic for a thread count).
    num_threads: torch threads while training (restored afterwards). Small MLPs gain nothing
        from more, and several threads on shared or oversubscribed cores slow each step
        down by up to 100×; None leaves torch's setting.
    progress: show a tqdm progress bar.

    Learned state: ``weights_`` {source layer: [(W, b), ...]} float32, ``history_``
    {source layer: {best_epoch, epochs, val_accuracy}}, ``val_sequences_``.
    """

    needs_hidden = True

    def __init__(
        self,
        distance: int = 1,
        width: int = 256,
        depth: int = 2,
        dropout: float = 0.1,
        loss: Loss = "bce",
        lr: float = 2e-3,
        weight_decay: float = 1e-4,
        batch_size: int = 256,
        max_epochs: int = 30,
        patience: int = 3,
        val_fraction: float = 0.1,
        max_train_tokens: int | None = None,
        seed: int = 0,
        num_threads: int | None = 1,
        progress: bool = True,
    ) -> None:
        """Size: scikit-learn style hyperparameters: one constructor argument with a default each
        (get_params/set_params read them from this signature).
        """
        self.distance = distance
        self.width = width
        self.depth = depth
        self.dropout = dropout
        self.loss = loss
        self.lr = lr
        self.weight_decay = weight_decay
        self.batch_size = batch_size
        self.max_epochs = max_epochs
        self.patience = patience
        self.val_fraction = val_fraction
        self.max_train_tokens = max_train_tokens
        self.seed = seed
        self.num_threads = num_threads
        self.progress = progress

    def _validate_params(self) -> None:
        super()._validate_params()
        name = type(self).__name__
        for p in ("width", "depth", "batch_size", "max_epochs", "patience"):
            v = getattr(self, p)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise MoelabError(f"{name}: {p} must be an integer ≥ 1, got {v!r}.")
        if self.loss not in _LOSSES:
            raise unknown_name(f"{name} loss", self.loss, _LOSSES)
        if not 0.0 <= self.dropout < 1.0:
            raise MoelabError(f"{name}: dropout must be in [0, 1), got {self.dropout!r}.")
        if not self.lr > 0:
            raise MoelabError(f"{name}: lr must be > 0, got {self.lr!r}.")
        if self.max_train_tokens is not None and self.max_train_tokens < 1:
            raise MoelabError(f"{name}: max_train_tokens must be ≥ 1 or None, got {self.max_train_tokens!r}.")

    # ------------------------------------------------------------------ training
    def _fit(self, data: TraceData, model: Any) -> None:
        import torch
        from tqdm.auto import tqdm

        idx = data.index
        train_tokens = idx.tokens_of(self.train_sequences_)
        val_tokens = idx.tokens_of(self.val_sequences_)
        hidden = data.hidden
        sources = list(range(self.num_moe_layers_ - self.distance))
        self.weights_: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        self.history_: dict[int, dict[str, Any]] = {}
        bar = tqdm(total=len(sources) * self.max_epochs, disable=not self.progress,
                   desc=f"learned d={self.distance}", unit="epoch", leave=False)
        threads = torch.get_num_threads()
        if self.num_threads is not None:
            torch.set_num_threads(int(self.num_threads))
        try:
            with torch.random.fork_rng(devices=[]):
                for layer in sources:
                    target = layer + self.distance
                    tr_tok = idx.pairs(layer, target, train_tokens)
                    va_tok = idx.pairs(layer, target, val_tokens)
                    if len(tr_tok) == 0 or len(va_tok) == 0:
                        raise MoelabError(
                            f"MoE layers {layer}→{target} have {len(tr_tok)} training and {len(va_tok)} validation "
                            "tokens; record more sequences."
                        )
                    if self.max_train_tokens is not None and len(tr_tok) > self.max_train_tokens:
                        rng = np.random.default_rng(self.seed + 7919 * layer)
                        tr_tok = np.sort(rng.choice(tr_tok, self.max_train_tokens, replace=False))
                    E = self.num_experts_[target]
                    xs = [hidden[idx.rows[t, layer]].float() for t in (tr_tok, va_tok)]
                    ys = [torch.from_numpy(multi_hot(data.experts[idx.rows[t, target]], E)) for t in (tr_tok, va_tok)]
                    self.weights_[layer], self.history_[layer] = self._train_one(
                        layer, xs[0], ys[0], xs[1], ys[1], self.top_k_[target], bar
                    )
        finally:
            torch.set_num_threads(threads)
            bar.close()

    def _train_one(self, layer, x, y, xv, yv, k, bar):
        import torch
        from torch import nn

        torch.manual_seed(self.seed * 1000 + layer)
        gen = torch.Generator().manual_seed(self.seed * 1000 + layer)
        mean = x.mean(0)
        std = x.std(0).clamp_min(1e-5)
        x = (x - mean) / std
        xv = (xv - mean) / std
        H, E = x.shape[1], y.shape[1]
        layers: list[nn.Module] = []
        dim = H
        for _ in range(self.depth - 1):
            layers += [nn.Linear(dim, self.width), nn.ReLU(), nn.Dropout(self.dropout)]
            dim = self.width
        layers.append(nn.Linear(dim, E))
        net = nn.Sequential(*layers)
        opt = torch.optim.AdamW(net.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        target_ce = y / y.sum(1, keepdim=True).clamp_min(1.0)

        def loss_fn(z, yb, cb):
            if self.loss == "bce":
                return nn.functional.binary_cross_entropy_with_logits(z, yb)
            if self.loss == "l1":
                return (torch.sigmoid(z) - yb).abs().mean()
            return -(cb * torch.log_softmax(z, dim=1)).sum(1).mean()

        def val_accuracy() -> float:
            net.eval()
            with torch.no_grad():
                top = net(xv).topk(k, dim=1).indices
                hits = yv.gather(1, top).sum()
            net.train()
            return float(hits / yv.sum().clamp_min(1.0))

        best, best_state, best_epoch, stale, epochs = -1.0, None, 0, 0, 0
        n = len(x)
        net.train()
        for epoch in range(self.max_epochs):
            perm = torch.randperm(n, generator=gen)
            for i in range(0, n, self.batch_size):
                b = perm[i : i + self.batch_size]
                opt.zero_grad(set_to_none=True)
                loss_fn(net(x[b]), y[b], target_ce[b]).backward()
                opt.step()
            epochs = epoch + 1
            acc = val_accuracy()
            bar.update(1)
            bar.set_postfix(layer=layer, val_acc=f"{acc:.3f}")
            if acc > best + 1e-6:
                best, best_epoch, stale = acc, epochs, 0
                best_state = {kk: v.clone() for kk, v in net.state_dict().items()}
            else:
                stale += 1
                if stale >= self.patience:
                    break
        bar.update(self.max_epochs - epochs)
        net.load_state_dict(best_state)
        linears = [m for m in net if isinstance(m, nn.Linear)]
        weights = []
        for i, lin in enumerate(linears):
            w = lin.weight.detach().clone()
            b = lin.bias.detach().clone()
            if i == 0:  # fold the standardisation into the first layer: W((x-μ)/σ)+b
                b = b - (w * (mean / std)[None, :]).sum(1)
                w = w / std[None, :]
            weights.append((w.numpy().astype(np.float32), b.numpy().astype(np.float32)))
        log.info("learned d=%d layer %d: val accuracy %.3f at epoch %d", self.distance, layer, best, best_epoch)
        return weights, {"best_epoch": best_epoch, "epochs": epochs, "val_accuracy": best,
                         "train_tokens": int(n), "val_tokens": int(len(xv))}

    # ------------------------------------------------------------------ inference
    def _scores(self, layer, hidden, token_ids, n):
        x = to_numpy(hidden, np.float32)
        weights = self.weights_[layer]
        for i, (w, b) in enumerate(weights):
            x = x @ w.T + b
            if i < len(weights) - 1:
                np.maximum(x, 0.0, out=x)
        return x

    # ------------------------------------------------------------------ persistence
    def _state(self):
        tensors: dict[str, np.ndarray] = {}
        for layer, ws in self.weights_.items():
            for i, (w, b) in enumerate(ws):
                tensors[f"mlp.{layer}.{i}.weight"] = w
                tensors[f"mlp.{layer}.{i}.bias"] = b
        history = {str(k): v for k, v in self.history_.items()}
        return tensors, {"history": history, "layers": sorted(self.weights_)}

    def _load_state(self, tensors, extra, model):
        self.history_ = {int(k): v for k, v in extra.get("history", {}).items()}
        self.weights_ = {}
        L, H = self.num_moe_layers_, self.hidden_size_
        for layer in extra["layers"]:
            if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < L - self.distance:
                raise MoelabError(
                    f"state.layers holds {layer!r}, expected source layers 0..{L - self.distance - 1} "
                    f"({L} MoE layers, distance {self.distance})."
                )
            ws, i = [], 0
            while f"mlp.{layer}.{i}.weight" in tensors:
                ws.append((tensors[f"mlp.{layer}.{i}.weight"], tensors[f"mlp.{layer}.{i}.bias"]))
                i += 1
            if not ws:
                raise MoelabError(f"no weights for layer {layer} (expected 'mlp.{layer}.0.weight').")
            dim = H or ws[0][0].shape[-1]
            for i, (w, b) in enumerate(ws):  # x @ w.T + b: w is (out, in), b is (out,)
                out = self.num_experts_[layer + self.distance] if i == len(ws) - 1 else w.shape[0]
                if w.ndim != 2 or w.shape[1] != dim or w.shape[0] != out or b.shape != (out,):
                    raise MoelabError(
                        f"'mlp.{layer}.{i}.weight' has shape {tuple(w.shape)} (bias {tuple(b.shape)}), "
                        f"expected ({out}, {dim}) and ({out},)."
                    )
                dim = out
            self.weights_[int(layer)] = ws
