"""A quick greedy-decoding checker for the bundled models (no lm-eval needed).

``arith``: strict exact match of the number after ``####`` (GSM8K's strict regex).
``pycode``: pass@1 with the problem's own ``check``; generated code runs in
:mod:`moelab.evals.sandbox` (kernel-confined, at the isolation level the sandbox asks for
by default; the tests run in a sandbox of their own, so the verdict cannot be forged) —
never in this process.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from moelab.errors import MoelabError
from moelab.evals.sandbox import SandboxConfig, isolation_level, run_tests_many
from moelab.tasks import generate, prompt_and_target
from moelab.tasks.arith import final_answer

logger = logging.getLogger(__name__)

#: Stop sequences, as in lm-eval's gsm8k / humaneval tasks.
ARITH_STOP = ("Question:", "\n\n")
PYCODE_STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")


def _cut(text: str, stops: tuple[str, ...]) -> str:
    for s in stops:
        i = text.find(s)
        if i >= 0:
            text = text[:i]
    return text


@torch.no_grad()
def greedy_complete(
    model,
    tokenizer,
    contexts: list[str],
    max_new_tokens: int,
    batch_size: int = 32,
    progress: bool | str = False,
) -> list[str]:
    """Greedy continuations of ``contexts`` (left-padded batches, similar lengths together).

    ``progress``: show a tqdm bar over the prompts (a string is its description).
    """
    from tqdm.auto import tqdm

    was_training = model.training
    model.eval()
    enc = [tokenizer(c, add_special_tokens=False).input_ids for c in contexts]
    order = sorted(range(len(enc)), key=lambda i: len(enc[i]))
    out: list[str] = [""] * len(enc)
    pad = tokenizer.pad_token_id
    desc = progress if isinstance(progress, str) else "generating"
    bar = tqdm(total=len(order), desc=desc, unit="prompt", disable=not progress, leave=False)
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        t = max(len(enc[i]) for i in idx)
        ids = torch.full((len(idx), t), pad, dtype=torch.long)
        mask = torch.zeros((len(idx), t), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, t - len(enc[i]) :] = torch.tensor(enc[i])
            mask[r, t - len(enc[i]) :] = 1
        gen = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id,
        )
        for r, i in enumerate(idx):
            out[i] = tokenizer.decode(gen[r, t:], skip_special_tokens=True)
        bar.update(len(idx))
    bar.close()
    model.train(was_training)
    return out


def eval_arith(
    model, tokenizer, examples: list[dict[str, Any]], max_new_tokens: int = 200, progress: bool = False
) -> dict:
    """Strict exact match on the final ``#### N`` of GSM8K-style answers."""
    ctx = [prompt_and_target("arith", ex)[0] for ex in examples]
    gen = greedy_complete(model, tokenizer, ctx, max_new_tokens, progress=progress and "eval arith")
    comps = [_cut(c, ARITH_STOP) for c in gen]
    correct = 0
    for ex, comp in zip(examples, comps):
        m = STRICT.search(comp)
        got = m.group(1).strip().replace(",", "").rstrip(".") if m else None
        correct += got == final_answer(ex["answer"])
    return {
        "exact_match": correct / max(1, len(examples)),
        "n": len(examples),
        "samples": comps[:3],
    }


def run_check(candidate: str, tests: str | None = None, timeout: float = 5.0) -> bool:
    """True if ``tests`` pass against ``candidate`` in moelab's sandbox within ``timeout``.

    The candidate and the tests run apart (:func:`moelab.evals.sandbox.run_tests`), so the
    verdict is the tests' alone. ``tests`` is required: a whole program's "ran to its end"
    is a verdict the program itself can fake.
    """
    if tests is None:
        raise MoelabError(
            "run_check needs tests: without them the verdict would be 'the candidate ran to its end', "
            "which a hostile candidate can fake. Pass the checks as tests, e.g. "
            "run_check('x = f()', 'assert x == 2'); run a trusted program with "
            "moelab.evals.sandbox.run_program.")
    config = SandboxConfig(timeout_s=timeout)
    return run_tests_many([(candidate, tests)], config, workers=1)[0].passed


def eval_pycode(
    model,
    tokenizer,
    examples: list[dict[str, Any]],
    max_new_tokens: int = 128,
    timeout: float = 5.0,
    progress: bool = False,
) -> dict:
    """pass@1 (greedy): prompt + completion must pass the problem's ``check``."""
    config = SandboxConfig(timeout_s=timeout)
    level = isolation_level(config)  # refuses before generating when the sandbox is too weak
    ctx = [ex["prompt"] for ex in examples]
    gen = greedy_complete(model, tokenizer, ctx, max_new_tokens, progress=progress and "eval pycode")
    comps = [_cut(c, PYCODE_STOP) for c in gen]
    pairs = [
        (ex["prompt"] + comp, f"{ex['test']}\n\ncheck({ex['entry_point']})\n")
        for ex, comp in zip(examples, comps)
    ]
    passed = [r.passed for r in run_tests_many(pairs, config, workers=2)]
    return {
        "pass@1": sum(passed) / max(1, len(examples)),
        "n": len(examples),
        "samples": comps[:3],
        "isolation": level,
    }


def quick_eval(
    model,
    tokenizer,
    split: str = "validation",
    n: dict[str, int] | None = None,
    seed: int = 0,
    progress: bool = False,
) -> dict[str, dict]:
    """Greedy accuracy on ``arith`` and ``pycode`` (``n`` per task; None = the split's default).

    ``progress``: a tqdm bar per task while generating (minutes on the full splits).
    """
    n = n or {}
    res = {
        "arith": eval_arith(
            model, tokenizer, generate("arith", split, n=n.get("arith"), seed=seed), progress=progress
        ),
        "pycode": eval_pycode(
            model, tokenizer, generate("pycode", split, n=n.get("pycode"), seed=seed), progress=progress
        ),
    }
    logger.info(
        "quick eval (%s): arith exact match %.3f, pycode pass@1 %.3f",
        split,
        res["arith"]["exact_match"],
        res["pycode"]["pass@1"],
    )
    return res
