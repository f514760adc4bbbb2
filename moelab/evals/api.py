"""Score a live model with lm-eval: ``moelab.evals.evaluate(model, tokenizer, tasks=[...])``.

The model is scored as it is, so a routing policy applied as a context manager
around the call is part of what is measured::

    with some_policy(model):
        result = moelab.evals.evaluate(model, tok, tasks=["arith", "gsm8k"], limit=50)

lm-eval is imported here only (``import moelab`` stays fast).
"""

from __future__ import annotations

import json
import logging
import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import moelab
from moelab._output import OutputReservation, reserve_output
from moelab._resources import resource_dir
from moelab.errors import MoelabError
from moelab.evals.metrics import sandbox_defaults
from moelab.evals.registry import EvalTask, default_num_fewshot, parse_tasks
from moelab.evals.results import EvalConfig, EvalResult, TaskResult
from moelab.evals.sandbox import SandboxConfig, isolation_level

logger = logging.getLogger(__name__)

#: The code-execution opt-in, as the Python API and the CLI spell it.
OPT_IN_HINT = "pass allow_code_execution=True (CLI: --allow-code-execution)"


def _active_policies(model: Any) -> list[dict[str, Any]]:
    """The routing policies active on ``model`` (class name and settings), for the result."""
    import dataclasses

    import torch

    from moelab.policies.runtime import active_policies

    target = getattr(model, "model", model) if _is_lm_eval_lm(model) else model
    out = []
    for p in active_policies(target) if isinstance(target, torch.nn.Module) else []:
        cfg = getattr(p, "config", None)
        settings = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else {}
        out.append({"policy": type(p).__name__, **settings})
    return out


def _active_hybrid(model: Any) -> dict[str, Any] | None:
    """The hybrid configuration applied to ``model`` (as data), or None."""
    import sys

    if "moelab.hybrid.runtime" not in sys.modules:  # never applied in this process
        return None
    import torch

    from moelab.hybrid.runtime import active_hybrid

    target = getattr(model, "model", model) if _is_lm_eval_lm(model) else model
    run = active_hybrid(target) if isinstance(target, torch.nn.Module) else None
    return run.config.to_dict() if run is not None else None


def evaluate(
    model: Any,
    tokenizer: Any = None,
    tasks: str | list[str] = ("arith",),
    *,
    limit: int | None = None,
    num_fewshot: int | None = None,
    allow_code_execution: bool = False,
    log_samples_dir: str | os.PathLike | None = None,
    overwrite: bool = False,
    config: EvalConfig | None = None,
    model_name: str | None = None,
    reservation: OutputReservation | None = None,
    **settings: Any,
) -> EvalResult:
    """Score ``model`` on ``tasks`` with lm-eval and return an :class:`EvalResult`.

    ``model`` is a loaded causal LM (any routing policy already applied) or a name/path
    for :func:`moelab.load`. Other settings (``batch_size``, ``seed``, ``max_gen_toks``,
    ``gsm8k_dir``, ``humaneval_path``, ``code_timeout_s``) are the fields of
    :class:`EvalConfig`; pass ``config=`` to give them all at once. With
    ``log_samples_dir``, per-sample logs and ``results.json`` are written there
    atomically (nothing is left behind if the evaluation fails). ``model_name`` labels
    the result (default: the model's ``name_or_path``). ``reservation`` is a claim of
    ``log_samples_dir`` taken earlier with :func:`moelab._output.reserve_output` (what
    ``moelab eval`` does before loading the model); without it the directory is claimed here.

    Size: keyword settings of a public entry point, each with a default (the CLI's options where it has a
    command), so a call names only what it changes; a settings object would be one more thing to build.
    """
    if config is None:
        config = EvalConfig(
            tasks=list(tasks) if not isinstance(tasks, str) else tasks,
            limit=limit,
            num_fewshot=num_fewshot,
            allow_code_execution=allow_code_execution,
            **settings,
        )
    elif settings:
        config = replace(config, **settings)
    eval_tasks, metadata, out_dir = preflight(config, log_samples_dir, overwrite)
    # claim --out now (parents created, a second writer refused), not after the run
    if reservation is not None and (out_dir is None or reservation.path != out_dir):
        raise MoelabError(f"the reservation of {str(reservation.path)!r} is not for log_samples_dir {out_dir!r}.")
    if reservation is None and out_dir is not None:
        reservation = reserve_output(out_dir, overwrite, what="output")
    try:
        return _evaluate(model, tokenizer, config, eval_tasks, metadata, out_dir, reservation,
                         model_name)
    finally:
        if reservation is not None:
            reservation.abort()  # a no-op after the commit


def _evaluate(
    model: Any,
    tokenizer: Any,
    config: EvalConfig,
    eval_tasks: list[EvalTask],
    metadata: dict[str, Any],
    out_dir: Path | None,
    reservation: OutputReservation | None,
    model_name: str | None,
) -> EvalResult:
    if isinstance(model, (str, os.PathLike)):
        from moelab import load

        model, tokenizer = load(model)
    if not _is_lm_eval_lm(model):
        _check_generative(model, tokenizer)
    policies = _active_policies(model)
    hybrid = _active_hybrid(model)
    results: dict[str, TaskResult] = {}
    samples: dict[str, list[dict]] = {}
    sandbox = _sandbox_config(config)
    code_isolation = (
        isolation_level(sandbox) if any(t.executes_code for t in eval_tasks) else None
    )
    with sandbox_defaults(sandbox), _quiet_lm_eval():
        from lm_eval.tasks import TaskManager

        # an lm-eval LM object (e.g. a test oracle) is used as is
        lm = model if _is_lm_eval_lm(model) else _wrap(model, tokenizer, config)
        task_manager = TaskManager(
            include_path=str(resource_dir("evals")), include_defaults=False, metadata=metadata
        )
        for task in eval_tasks:
            results[task.name], samples[task.name] = _run_task(lm, task, task_manager, config)

    result = EvalResult(
        model=model_name or _model_name(model),
        tasks=results,
        config=config,
        versions=versions(),
        samples_dir=str(out_dir) if out_dir is not None else None,
        policies=policies,
        hybrid=hybrid,
        code_isolation=code_isolation,
    )
    if reservation is not None:
        _write_atomically(reservation, result, samples)
    return result


def _sandbox_config(config: EvalConfig) -> SandboxConfig:
    if config.sandbox_isolation is None:
        return SandboxConfig(timeout_s=config.code_timeout_s)
    return SandboxConfig(timeout_s=config.code_timeout_s, min_isolation=config.sandbox_isolation)


def _model_name(model: Any) -> str:
    for owner in (model, getattr(model, "config", None)):
        name = getattr(owner, "name_or_path", None)
        if name:
            return str(name)
    return type(model).__name__


def versions() -> dict[str, str]:
    """Versions of the packages an evaluation result depends on."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"moelab": moelab.__version__, "python": platform.python_version()}
    for pkg, dist in (("torch", "torch"), ("transformers", "transformers"), ("lm_eval", "lm_eval")):
        try:
            out[pkg] = version(dist)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def preflight(
    config: EvalConfig, log_samples_dir: str | os.PathLike | None = None, overwrite: bool = False
) -> tuple[list[EvalTask], dict[str, Any], Path | None]:
    """Everything that can be refused before loading or running a model: unknown tasks,
    the missing code-execution opt-in, missing data, an existing output directory.

    Returns the tasks, the lm-eval metadata (data paths) and the output directory.
    """
    eval_tasks = parse_tasks(config.tasks)
    config.tasks = [t.name for t in eval_tasks]
    metadata = _check_tasks(eval_tasks, config)
    return eval_tasks, metadata, _check_out_dir(log_samples_dir, overwrite)


def _check_tasks(tasks: list[EvalTask], config: EvalConfig) -> dict[str, Any]:
    """Refuse what cannot run before any work; return the lm-eval metadata (data paths)."""
    from moelab.evals.data import resolve_gsm8k_dir, resolve_humaneval_file

    metadata: dict[str, Any] = {}
    for task in tasks:
        if task.executes_code and not config.allow_code_execution:
            raise MoelabError(
                f"task {task.name!r} runs model-generated code to score it; {OPT_IN_HINT} to run "
                "that code in moelab's sandbox (kernel namespaces: read-only files, no network, "
                "time/memory/process limits — see docs/reference/lm-eval.md)."
            )
        if task.executes_code:
            isolation_level(_sandbox_config(config))  # refuses a sandbox weaker than asked for
        if config.num_fewshot and not task.fewshot:
            raise MoelabError(
                f"task {task.name!r} is 0-shot only; got num_fewshot={config.num_fewshot}. "
                "Leave num_fewshot unset (or 0) for it, or score it in a separate run."
            )
        if task.data == "gsm8k":
            metadata["gsm8k_dir"] = str(resolve_gsm8k_dir(config.gsm8k_dir))
        elif task.data == "humaneval":
            metadata["humaneval_path"] = str(resolve_humaneval_file(config.humaneval_path))
    return metadata


def _check_out_dir(path: str | os.PathLike | None, overwrite: bool) -> Path | None:
    if path is None:
        return None
    out = Path(path).expanduser()
    if os.path.lexists(out) and not overwrite:
        raise MoelabError(
            f"output {str(out)!r} already exists; pass overwrite=True (CLI: --overwrite) or choose another path."
        )
    # missing parents are created when the output is reserved (like `moelab trace --out`)
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise MoelabError(f"cannot write {str(out)!r}: {str(parent)!r} is a file, not a directory.")
            break
    return out


def _is_lm_eval_lm(obj: Any) -> bool:
    return callable(getattr(obj, "generate_until", None)) and callable(
        getattr(obj, "loglikelihood", None)
    )


@contextmanager
def _quiet_lm_eval() -> Iterator[None]:
    """lm-eval's warnings are noise for moelab users (we pass a live model on purpose),
    so they are shown only when moelab logs at INFO or more verbosely. So are its progress
    bars: building the requests gets none, generating gets one transient bar (a widget in
    Jupyter) instead of a line per update in the notebook's output. lm-eval's ``git describe``
    (the results' ``git_hash``) runs without printing ``fatal: not a git repository``."""
    import lm_eval.api.task as lm_task
    import lm_eval.models.huggingface as lm_hf

    lm_logger = logging.getLogger("lm_eval")
    previous = lm_logger.level
    saved = (lm_task.tqdm, lm_hf.tqdm)
    if logging.getLogger("moelab").getEffectiveLevel() > logging.INFO:
        lm_logger.setLevel(logging.ERROR)
        lm_task.tqdm = _no_bar
        lm_hf.tqdm = _transient_bar
    try:
        with quiet_git_hash():
            yield
    finally:
        lm_logger.setLevel(previous)
        lm_task.tqdm, lm_hf.tqdm = saved


def _no_bar(iterable: Any = None, *args: Any, **kwargs: Any) -> Any:
    from tqdm.auto import tqdm

    return tqdm(iterable, *args, **{**kwargs, "disable": True})


def _transient_bar(iterable: Any = None, *args: Any, **kwargs: Any) -> Any:
    from tqdm.auto import tqdm

    return tqdm(iterable, *args, **{**kwargs, "leave": False})


@contextmanager
def quiet_git_hash() -> Iterator[None]:
    """Run lm-eval's ``git describe`` (for the results' ``git_hash``) with stderr silenced."""
    import lm_eval.evaluator as lm_evaluator

    saved = lm_evaluator.get_git_commit_hash
    lm_evaluator.get_git_commit_hash = _git_commit_hash
    try:
        yield
    finally:
        lm_evaluator.get_git_commit_hash = saved


def _git_commit_hash() -> str | None:
    """lm-eval's ``get_git_commit_hash`` without the ``fatal:`` line outside a repository."""
    import subprocess

    from lm_eval.loggers.utils import get_commit_from_path

    try:
        out = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        out = None
    if out is not None and out.returncode == 0 and out.stdout.strip():
        return out.stdout.strip()
    return get_commit_from_path(os.getcwd())


def _check_generative(model: Any, tokenizer: Any) -> None:
    can = getattr(model, "can_generate", None)
    if not callable(getattr(model, "generate", None)) or (callable(can) and not can()):
        raise MoelabError(
            f"model of type {type(model).__name__} cannot generate text; lm-eval's generative tasks "
            "need a causal LM (e.g. AutoModelForCausalLM / moelab.load(...))."
        )
    if tokenizer is None:
        raise MoelabError(
            "no tokenizer given; pass the tokenizer that moelab.load returned "
            "(evaluate(model, tokenizer, ...)) or a model name instead of a model object."
        )


def _wrap(model: Any, tokenizer: Any, config: EvalConfig):
    """lm-eval's HFLM around the live model (not copied, not moved)."""
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=model, tokenizer=tokenizer, batch_size=config.batch_size)


def _gen_kwargs(lm, task_obj, config: EvalConfig) -> tuple[dict[str, Any] | None, int]:
    """``max_gen_toks`` override (the user's cap, lowered to leave room for a prompt in short
    contexts) and the cap in effect. Without an override the cap is the task's ``max_gen_toks``."""
    wanted = (task_obj.config.generation_kwargs or {}).get(
        "max_gen_toks", getattr(lm, "max_gen_toks", 256)
    )
    cap = config.max_gen_toks or wanted
    max_length = getattr(lm, "max_length", None)
    room = max(1, max_length // 2) if isinstance(max_length, int) else cap
    if cap > room:
        logger.warning(
            "%s: the model's context is %d tokens; generating at most %d tokens instead of %d",
            task_obj.config.task,
            max_length,
            room,
            cap,
        )
        cap = room
    return ({"max_gen_toks": cap} if cap != wanted else None), cap


class _CapCounter:
    """Counts generated rows that stopped only because they reached the token cap (no stop
    sequence, no EOS), by wrapping an HFLM's ``_model_generate`` for the duration of a run."""

    def __init__(self, lm) -> None:
        self.lm, self.rows, self.capped = lm, 0, 0

    def __enter__(self) -> _CapCounter:
        inner = getattr(self.lm, "_model_generate", None)
        tok = getattr(self.lm, "tokenizer", None)
        if inner is None or tok is None:
            return self  # an lm-eval LM of another kind: nothing to count

        def counted(context, max_length, stop, **kwargs):
            out = inner(context=context, max_length=max_length, stop=stop, **kwargs)
            n_prompt, room = context.shape[1], max_length - context.shape[1]
            eos = getattr(tok, "eos_token_id", None)
            for row in out[:, n_prompt:].tolist():
                self.rows += 1
                if len(row) < room or (eos is not None and eos in row):
                    continue
                text = tok.decode(row, skip_special_tokens=False)
                self.capped += not any(s and s in text for s in (stop or []))
            return out

        self.lm._model_generate = counted
        return self

    def __exit__(self, *exc) -> None:
        self.lm.__dict__.pop("_model_generate", None)


def _truncated_prompts(lm, samples: list[dict], cap: int) -> tuple[int, list[int], int] | None:
    """(prompts longer than the room lm-eval leaves them, all prompt lengths, that room), or None
    when it cannot be told (no tokenizer or no known context)."""
    tok, max_length = getattr(lm, "tokenizer", None), getattr(lm, "max_length", None)
    if tok is None or not isinstance(max_length, int) or not samples:
        return None
    room = max_length - cap
    lengths, seen = [], set()
    for sample in samples:
        if sample.get("doc_id") in seen:  # one sample record per filter (gsm8k has two)
            continue
        seen.add(sample.get("doc_id"))
        args = sample.get("arguments")
        context = args[0][0] if args and isinstance(args[0], (list, tuple)) and args[0] else None
        if isinstance(context, str):
            lengths.append(len(tok(context)["input_ids"]))
    return sum(n > room for n in lengths), lengths, room


def _check_run(lm, task: EvalTask, samples: list[dict], cap: int, counter: _CapCounter) -> list[str]:
    """Warnings (also returned, for the result's notes) about what silently changes scores:
    prompts cut to fit the context, and answers cut by the generation cap."""
    notes = []
    trunc = _truncated_prompts(lm, samples, cap)
    if trunc is not None and trunc[0]:
        n, lengths, room = trunc
        lengths.sort()
        notes.append(
            f"{n} of {len(lengths)} prompts were left-truncated to {room} tokens (the model's "
            f"{lm.max_length}-token context minus {cap} generated tokens); prompt lengths "
            f"{lengths[0]}-{lengths[-1]} tokens (median {lengths[len(lengths) // 2]}). The scores measure "
            "truncated prompts: use fewer few-shot examples (num_fewshot) or a model with a longer context."
        )
    if counter.rows and counter.capped * 2 > counter.rows:
        notes.append(
            f"{counter.capped} of {counter.rows} answers were cut off at the {cap}-token "
            "generation cap before a stop sequence; their scores count unfinished answers. Raise "
            "max_gen_toks (the task's own cap is the default) or check the model's outputs."
        )
    for note in notes:
        logger.warning("%s: %s", task.name, note)
    return notes


def _run_task(
    lm, task: EvalTask, task_manager, config: EvalConfig
) -> tuple[TaskResult, list[dict]]:
    import lm_eval

    task_obj = task_manager.load([task.lm_eval_task])["tasks"][task.lm_eval_task]
    docs = task_obj.eval_docs
    n_available = len(docs)
    notes: list[str] = []
    if config.limit is not None and config.limit > n_available:
        note = f"limit {config.limit} is larger than the {n_available} documents of {task.name!r}; scored all {n_available}"
        logger.warning(note)
        notes.append(note)
    logger.info("scoring %s (%s)", task.name, task.lm_eval_task)
    gen_kwargs, cap = _gen_kwargs(lm, task_obj, config)
    # the user's count, else the installed lm-eval task's (gsm8k), else the count in evals/*.yaml
    num_fewshot = config.num_fewshot if config.num_fewshot is not None else default_num_fewshot(task)
    with _CapCounter(lm) as counter:
        raw = lm_eval.simple_evaluate(
            model=lm,
            tasks=[task_obj],
            num_fewshot=num_fewshot,
            limit=config.limit,
            gen_kwargs=gen_kwargs,
            task_manager=task_manager,
            log_samples=True,
            bootstrap_iters=1000,
            random_seed=config.seed,
            numpy_random_seed=config.seed,
            torch_random_seed=config.seed,
            fewshot_random_seed=config.seed,
            confirm_run_unsafe_code=config.allow_code_execution,
        )
    if raw is None:  # pragma: no cover - only on non-zero ranks of a distributed run
        raise MoelabError("lm-eval returned no results (not rank 0 of a distributed run?)")
    name = task.lm_eval_task
    if task_obj.config.output_type == "generate_until":
        notes += _check_run(lm, task, raw.get("samples", {}).get(name, []), cap, counter)
    values = raw["results"][name]
    metrics, stderr = {}, {}
    for key, value in values.items():
        if "," not in key or not isinstance(value, (int, float)):
            continue  # "alias", "sample_len", and "N/A" stderrs
        metric, _, filt = key.partition(",")
        if metric.endswith("_stderr"):
            stderr[f"{metric[: -len('_stderr')]},{filt}"] = float(value)
        else:
            metrics[key] = float(value)
    n = raw.get("n-samples", {}).get(name, {})
    result = TaskResult(
        task=task.name,
        lm_eval_task=name,
        metrics=metrics,
        stderr=stderr,
        primary_metric=task.primary_metric,
        n_docs=int(n.get("effective", n_available)),
        n_available=int(n.get("original", n_available)),
        num_fewshot=int(raw.get("n-shot", {}).get(name, num_fewshot or 0)),
        notes=notes,
    )
    return result, raw.get("samples", {}).get(name, [])


def _write_atomically(reservation, result: EvalResult, samples: dict[str, list[dict]]) -> None:
    """``results.json`` + ``samples_<task>.jsonl`` into the reserved staging directory, then
    moved into place (see :mod:`moelab._output`)."""
    from lm_eval.utils import handle_non_serializable

    tmp = reservation.staging
    for task, rows in samples.items():
        with open(tmp / f"samples_{task}.jsonl", "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, default=handle_non_serializable, ensure_ascii=False) + "\n")
    with open(tmp / "results.json", "w", encoding="utf-8") as f:
        json.dump(result.to_dict(), f, indent=2, default=str)
    reservation.commit()
