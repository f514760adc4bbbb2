"""lm-eval model class ``moelab``: any model :func:`moelab.load` can load, scored by HFLM.

Importing this module registers it (lm-eval's ``@register_model``), so::

    lm_eval.simple_evaluate(model="moelab", model_args="pretrained=tiny-random-mixtral", ...)

works in Python; on lm-eval's command line use the wrapper
``python -m moelab.evals.lm_eval_cli --model moelab --model_args pretrained=<name> ...``.
"""

from __future__ import annotations

import logging
from typing import Any

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import normalize_gen_kwargs

logger = logging.getLogger(__name__)

_GEN_TOKS_ALIASES = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")


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
            logger.warning(
                "moelab model: 'device' is ignored for a loaded model; pass device_map=... instead"
            )
        super().__init__(pretrained=model, tokenizer=tokenizer, **kwargs)

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """HFLM's ``generate_until``, with each request's generation cap fitted into the context.

        lm-eval refuses (with an assertion) a ``max_gen_toks`` that leaves no room for the prompt,
        which is the case of the tasks' 256 tokens on a model with a 256-token context. As in
        :func:`moelab.evals.evaluate`, generation is capped at half of the context and a warning
        says so.
        """
        room = max(1, int(self.max_length) // 2)
        capped: dict[int, int] = {}
        for req in requests:
            context, gen_kwargs = req.arguments
            if not isinstance(gen_kwargs, dict):
                continue
            wanted = int(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)["max_gen_toks"])
            if wanted > room:
                capped[wanted] = capped.get(wanted, 0) + 1
                fitted = {k: v for k, v in gen_kwargs.items() if k not in _GEN_TOKS_ALIASES}
                req.arguments = (context, {**fitted, "max_gen_toks": room})
        for wanted, n in sorted(capped.items()):
            logger.warning(
                "the model's context is %d tokens: generating at most %d tokens instead of %d "
                "(max_gen_toks) for %d request(s), so that the prompt keeps %d tokens",
                self.max_length, room, wanted, n, int(self.max_length) - room,
            )
        return super().generate_until(requests, disable_tqdm=disable_tqdm)
