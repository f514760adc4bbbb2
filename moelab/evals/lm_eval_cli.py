"""lm-eval's own command line, with moelab's model class and tasks available.

::

    python -m moelab.evals.lm_eval_cli --model moelab \\
        --model_args pretrained=tiny-random-mixtral --tasks arith --limit 5

It registers the ``moelab`` model class (:mod:`moelab.evals.lm_model`), adds moelab's
task folder as ``--include_path`` when none is given, then runs
``lm_eval.__main__.cli_evaluate()`` with the remaining arguments unchanged. The offline
GSM8K/HumanEval tasks are ``gsm8k_local`` and ``humaneval_local``; point them at the
data with ``MOELAB_GSM8K_DIR`` / ``MOELAB_HUMANEVAL_DIR`` (or ``--metadata
'{"gsm8k_dir": ..., "humaneval_path": ...}'``). Code tasks (``pycode``,
``humaneval_local``) need ``--confirm_run_unsafe_code``.
"""

from __future__ import annotations

import logging
import sys

from moelab._resources import resource_dir


def main(argv: list[str] | None = None) -> None:
    """Run lm-eval's CLI on ``argv`` (default ``sys.argv[1:]``)."""
    from lm_eval.__main__ import cli_evaluate

    import moelab.evals.lm_model  # noqa: F401  (registers the "moelab" model class)

    args = list(sys.argv[1:] if argv is None else argv)
    if args and not any(a == "--include_path" or a.startswith("--include_path=") for a in args):
        args += ["--include_path", str(resource_dir("evals"))]
    sys.argv = [sys.argv[0] or "lm_eval", *args]
    _show_moelab_warnings()
    from moelab.evals.api import quiet_git_hash

    with quiet_git_hash():
        cli_evaluate()


def _show_moelab_warnings() -> None:
    """moelab's warnings (e.g. a generation cap fitted into a short context) on stderr.

    lm-eval's CLI configures only its own logger; without a handler here, moelab's
    library-style ``NullHandler`` would swallow them.
    """
    log = logging.getLogger("moelab")
    if not any(not isinstance(h, logging.NullHandler) for h in log.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        if log.level == logging.NOTSET:
            log.setLevel(logging.WARNING)


if __name__ == "__main__":
    main()
