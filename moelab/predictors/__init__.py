"""Expert predictors: guess before MoE layer l + d routes which experts it will select.

>>> from moelab.predictors import make_predictor, evaluate
>>> p = make_predictor("learned", distance=2).fit(trace)        # trace recorded with hidden_states=True
>>> p.predict(layer, hidden=h, m=4)                              # online: ranked ids for layer + 2
>>> p.predict_union(layer, hidden=h, token_ids=ids, valid=mask)   # the forward's experts, fetch order
>>> report = evaluate(p, test_trace)                             # accuracy, recall@m, GoodPred, latency
>>> p.save("predictors/my-model/learned-d2"); load_predictor("predictors/my-model/learned-d2")

Kinds (``available_predictors()``): ``frequency``, ``oracle``, ``token``, ``skip``,
``learned``; add your own with :func:`register_predictor`.
"""

from moelab.predictors import baselines, learned, skip, token  # noqa: F401  (register the built-in kinds)
from moelab.predictors.base import Predictor, TraceData, clone
from moelab.predictors.baselines import FrequencyPredictor, OraclePredictor
from moelab.predictors.compare import compare, frame
from moelab.predictors.io import load_predictor, read_predictor_meta, save_predictor
from moelab.predictors.learned import LearnedPredictor
from moelab.predictors.metrics import PredictionReport, evaluate
from moelab.predictors.online import attach
from moelab.predictors.prefetch import PredictorPrefetcher, as_prefetcher
from moelab.predictors.protocol import to_numpy, union_predictions
from moelab.predictors.registry import (
    PREDICTORS,
    available_predictors,
    get_predictor_class,
    make_predictor,
    register_predictor,
)
from moelab.predictors.skip import SkipPredictor
from moelab.predictors.token import TokenPredictor

__all__ = [
    "PREDICTORS",
    "FrequencyPredictor",
    "LearnedPredictor",
    "OraclePredictor",
    "PredictionReport",
    "PredictorPrefetcher",
    "Predictor",
    "SkipPredictor",
    "TokenPredictor",
    "TraceData",
    "as_prefetcher",
    "attach",
    "available_predictors",
    "clone",
    "compare",
    "evaluate",
    "frame",
    "get_predictor_class",
    "load_predictor",
    "make_predictor",
    "read_predictor_meta",
    "register_predictor",
    "save_predictor",
    "to_numpy",
    "union_predictions",
]
