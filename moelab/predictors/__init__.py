"""Expert predictors: guess before MoE layer l + d routes which experts it will select.

>>> from moelab.predictors import make_predictor, evaluate
>>> p = make_predictor("learned", distance=2).fit(trace)        # trace recorded with hidden_states=True
>>> p.predict(layer, hidden=h, m=4)                              # online: ranked ids for layer + 2
>>> p.predict_union(layer, hidden=h, token_ids=ids, valid=mask)   # the forward's experts, fetch order
>>> report = evaluate(p, test_trace)                             # accuracy, recall@m, GoodPred, latency
>>> p.save("predictors/my-model/learned-d2"); load_predictor("predictors/my-model/learned-d2")

Kinds (``available_predictors()``): ``frequency``, ``oracle``, ``repeat``, ``token``, ``skip``,
``learned``; add your own with :func:`register_predictor`.
"""

from __future__ import annotations

from moelab._lazy import lazy_attributes

#: Names of the package, imported on first use (``import moelab.predictors.protocol`` stays cheap:
#: the built-in kinds, sklearn and torch load when a kind or a predictor is first asked for).
_LAZY: dict[str, str] = {
    "PREDICTORS": "moelab.predictors.registry",
    "available_predictors": "moelab.predictors.registry",
    "get_predictor_class": "moelab.predictors.registry",
    "make_predictor": "moelab.predictors.registry",
    "register_predictor": "moelab.predictors.registry",
    "Predictor": "moelab.predictors.base",
    "TraceData": "moelab.predictors.base",
    "clone": "moelab.predictors.base",
    "FrequencyPredictor": "moelab.predictors.baselines",
    "OraclePredictor": "moelab.predictors.baselines",
    "RepeatPredictor": "moelab.predictors.baselines",
    "compare": "moelab.predictors.comparison",
    "frame": "moelab.predictors.comparison",
    "load_predictor": "moelab.predictors.io",
    "read_predictor_meta": "moelab.predictors.io",
    "save_predictor": "moelab.predictors.io",
    "LearnedPredictor": "moelab.predictors.learned",
    "PredictionReport": "moelab.predictors.metrics",
    "evaluate": "moelab.predictors.metrics",
    "attach": "moelab.predictors.online",
    "PredictorPrefetcher": "moelab.predictors.prefetch",
    "as_prefetcher": "moelab.predictors.prefetch",
    "to_numpy": "moelab.predictors.protocol",
    "union_predictions": "moelab.predictors.protocol",
    "SkipPredictor": "moelab.predictors.skip",
    "TokenPredictor": "moelab.predictors.token",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
