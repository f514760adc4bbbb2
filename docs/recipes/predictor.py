"""Recipe: add an expert predictor (nearest centroid of the router input) and score it."""

import numpy as np
import torch

import moelab
from moelab.predictors import Predictor, evaluate, make_predictor, register_predictor
from moelab.predictors.data import multi_hot


@register_predictor("centroid")
class CentroidPredictor(Predictor):
    """Expert e of layer l + d scores by how close layer l's router input is to e's centroid."""

    needs_hidden = True  # reads router inputs: record the trace with hidden_states=True

    def __init__(self, distance: int = 1) -> None:  # hyperparameters only (scikit-learn contract)
        self.distance = distance

    def _fit(self, data, model):  # learned state ends in "_"; train_sequences_ is set by fit()
        idx, d, self.centroids_ = data.index, self.distance, {}
        for src in range(self.num_moe_layers_ - d):
            both = idx.pairs(src, src + d, idx.tokens_of(self.train_sequences_))
            h = data.hidden[torch.from_numpy(idx.rows[both, src])].float().numpy()
            chosen = multi_hot(data.experts[idx.rows[both, src + d]], self.num_experts_[src + d])
            c = chosen.T @ h / np.maximum(chosen.sum(0), 1)[:, None]  # (E, H): e's mean router input
            self.centroids_[src] = c / np.maximum(np.linalg.norm(c, axis=1, keepdims=True), 1e-9)

    def _scores(self, layer, hidden, token_ids, n):  # (T, E), higher = likelier
        return hidden.float().numpy() @ self.centroids_[layer].T


model, tok = moelab.load("tiny-random-mixtral")
prompts = torch.randint(3, 250, (8, 6), generator=torch.Generator().manual_seed(0))
with moelab.record(model, hidden_states=True) as rec:  # into a new temporary directory
    model.generate(prompts, max_new_tokens=12, do_sample=False, pad_token_id=0)
accuracy = {k: evaluate(make_predictor(k).fit(rec.trace), rec.trace, latency_us=10.0).accuracy()
            for k in ("frequency", "centroid")}  # decode accuracy on the held-out sequences
print(accuracy)  # a random tiny model: the centroid predictor well above the popularity baseline
