"""moelab: expert-routing experiments on Mixture-of-Experts language models.

Public API (imported lazily so that ``import moelab`` stays fast)::

    model, tok = moelab.load("tiny-random-mixtral")      # or a bundled name, a path, a hub id
    layers = moelab.moe_layers(model)                      # per MoE layer: router, experts, E, top-k, ...
    with moelab.record(model, "traces/run1") as rec:       # routing trace, streamed to disk
        model.generate(...)
    trace = moelab.open_trace("traces/run1")
"""

from __future__ import annotations

import logging

from moelab._lazy import lazy_attributes

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())

# name -> module that defines it; resolved on first attribute access (PEP 562).
_LAZY: dict[str, str] = {
    "load": "moelab.loading",
    "MoelabError": "moelab.errors",
    "moe_layers": "moelab.adapters",
    "get_adapter": "moelab.adapters",
    "model_info": "moelab.adapters",
    "register_adapter": "moelab.adapters",
    "MoELayer": "moelab.adapters",
    "record": "moelab.trace",
    "TraceRecorder": "moelab.trace",
    "RoutingTrace": "moelab.trace",
    "open_trace": "moelab.trace",
    "build_tiny": "moelab.models.tiny",
    "FAMILIES": "moelab.models.tiny",
    "ExpertDeferral": "moelab.policies",
    "ExpertSkipping": "moelab.policies",
    "RoutingPolicy": "moelab.policies",
    "resource_dir": "moelab._resources",
    "hybrid": "moelab.hybrid",
    "HybridConfig": "moelab.hybrid",
    "Timeline": "moelab.timeline",
    "attribution": "moelab.attribution",
}


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
