"""lm-eval model class ``moelab``: any model :func:`moelab.load` can load, scored by HFLM.

Importing this module registers it (lm-eval's ``@register_model``), so::

    lm_eval.simple_evaluate(model="moelab", model_args="pretrained=tiny-random-mixtral", ...)

works in Python; on lm-eval's command line use the wrapper
``python -m moelab.evals.lm_eval_cli --model moelab --model_args pretrained=<name> ...``.
"""

from __future__ import annotations

from typing import Any

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM


@register_model("moelab")
class MoelabLM(HFLM):
    """HFLM over ``moelab.load(pretrained, dtype=..., trust_remote_code=...)``.

    ``pretrained`` is a bundled name, ``tiny-random-<family>``, a local directory or a hub
    id. ``sandbox_isolation`` is the least isolation level of the code sandbox that code
    tasks accept (default ``namespaces``; ``rlimits`` accepts the weaker level explicitly).
    Other keyword arguments (``batch_size``, ``max_length``, ...) go to HFLM.
    """

    def __init__(
        self,
        pretrained: str,
        dtype: str | None = None,
        trust_remote_code: bool = False,
        device_map: str | None = None,
        sandbox_isolation: str | None = None,
        **kwargs: Any,
    ) -> None:
        from moelab.loading import load

        if sandbox_isolation is not None:
            from moelab.evals.metrics import set_min_isolation

            set_min_isolation(str(sandbox_isolation))

        model, tokenizer = load(
            pretrained,
            dtype=dtype,
            device_map=device_map,
            trust_remote_code=bool(trust_remote_code),
        )
        model.name_or_path = str(pretrained)
        kwargs.pop("tokenizer", None)
        if kwargs.pop("device", None) not in (None, "cpu"):
            # A live model is not moved by HFLM; use device_map= to place it.
            import logging

            logging.getLogger(__name__).warning(
                "moelab model: 'device' is ignored for a loaded model; pass device_map=... instead"
            )
        super().__init__(pretrained=model, tokenizer=tokenizer, **kwargs)
