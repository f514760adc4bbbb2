"""Outputs are claimed before the work and written atomically; checkpoints load without
running code (issue 18, "Other defects"; issue 17: permissions and parents)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

import moelab
from moelab.cli import main
from moelab.errors import MoelabError
from moelab.trace import TraceRecorder

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model():
    return moelab.load("tiny-random-mixtral")[0]


@pytest.fixture()
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


def _record(model, out: Path, **kw) -> None:
    with TraceRecorder(model, out, **kw):
        model(input_ids=torch.tensor([[5, 6, 7], [8, 9, 10]]))  # two sequences


class _Planted:
    """Unpickling this creates ``marker``: stands for any code a planted pickle would run."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_planted_checkpoint_is_refused_without_running_code(tmp_path):
    from moelab.training.checkpoint import load_checkpoint

    marker = tmp_path / "code-ran"
    torch.save({"model": {}, "payload": _Planted(str(marker))}, tmp_path / "checkpoint.pt")
    with pytest.raises(MoelabError, match="cannot be loaded safely") as info:
        load_checkpoint(tmp_path)
    assert not marker.exists() and "\n" not in str(info.value)


def test_second_trace_writer_is_refused_at_start(model, tmp_path):
    out = tmp_path / "trace"
    first = TraceRecorder(model, out)
    first.start()
    try:
        with pytest.raises(MoelabError, match="being written by another process"):
            TraceRecorder(model, out).start()
    finally:
        first.abort()
    assert list(tmp_path.iterdir()) == []


def test_cli_trace_claims_out_before_loading_the_model(tmp_path, capsys, monkeypatch):
    from moelab._output import reserve_output

    out = tmp_path / "trace"
    import moelab.loading

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before --out was claimed")

    monkeypatch.setattr(moelab.loading, "load", no_load)
    with reserve_output(out, what="trace directory"):  # another writer holds it
        code = main(["trace", "--model", "tiny-random-mixtral", "--task", "demo", "--limit", "1",
                     "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "being written by another process" in err and "Traceback" not in err


def test_cli_predict_fit_claims_out_before_fitting(model, tmp_path, capsys, monkeypatch):
    import moelab.predictors
    from moelab._output import reserve_output

    _record(model, tmp_path / "trace")

    def no_fit(*a, **k):
        raise AssertionError("the predictor was made before --out was claimed")

    monkeypatch.setattr(moelab.predictors, "make_predictor", no_fit)
    out = tmp_path / "pred"
    with reserve_output(out, what="predictor output"):  # another `predict fit` is writing it
        code = main(["predict", "fit", "--trace", str(tmp_path / "trace"), "--kind", "frequency",
                     "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "being written by another process" in err and "Traceback" not in err


def test_leftovers_of_interrupted_writes_are_cleaned(model, tmp_path):
    (tmp_path / ".trace.partial-abcd1234").mkdir()
    (tmp_path / ".trace.old-abcd1234").mkdir()
    (tmp_path / ".other.partial-abcd1234").mkdir()  # another output's: left alone
    _record(model, tmp_path / "trace")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.partial-abcd1234", "trace"]


def test_outputs_respect_the_umask(model, tmp_path, umask_027):
    out = tmp_path / "trace"
    _record(model, out)
    assert stat.S_IMODE(out.stat().st_mode) == 0o750
    assert stat.S_IMODE((out / "meta.json").stat().st_mode) & 0o007 == 0


def test_predictor_files_respect_the_umask(model, tmp_path, umask_027):
    from moelab.predictors import make_predictor

    _record(model, tmp_path / "trace")
    make_predictor("frequency").fit(moelab.open_trace(tmp_path / "trace")).save(tmp_path / "pred")
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "pred").iterdir()}
    assert modes == {"predictor.json": 0o640, "state.safetensors": 0o640}


def _exchange_supported(tmp_path: Path) -> bool:
    from moelab._output import _RENAME_EXCHANGE, _renameat2

    a, b = tmp_path / "xa", tmp_path / "xb"
    a.mkdir()
    b.mkdir()
    try:
        return _renameat2(a, b, _RENAME_EXCHANGE)
    finally:
        a.rmdir()
        b.rmdir()


def test_overwrite_never_leaves_the_path_empty(model, tmp_path, monkeypatch):
    if not _exchange_supported(tmp_path):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not supported here: two renames (documented window)")
    out = tmp_path / "trace"
    _record(model, out)
    first_id = moelab.open_trace(out).meta["trace_id"]
    real_replace = os.replace

    def checked_replace(src, dst):
        real_replace(src, dst)
        assert os.path.lexists(out), f"nothing at {out} after os.replace({src}, {dst})"

    monkeypatch.setattr(os, "replace", checked_replace)
    _record(model, out, overwrite=True)
    assert moelab.open_trace(out).meta["trace_id"] != first_id
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace"]


def _echo_lm(on_generate=None):
    pytest.importorskip("lm_eval", reason="lm-eval is not installed")
    from lm_eval.api.model import LM

    class Echo(LM):
        def generate_until(self, requests):
            if on_generate is not None:
                on_generate()
            return [" #### 0" for _ in requests]

        def loglikelihood(self, requests):  # pragma: no cover
            raise NotImplementedError

        def loglikelihood_rolling(self, requests):  # pragma: no cover
            raise NotImplementedError

    return Echo()


def test_eval_creates_parents_with_normal_permissions(tmp_path, umask_027):
    from moelab.evals import evaluate

    out = tmp_path / "runs" / "deep" / "acc1"
    evaluate(_echo_lm(), tasks=["arith"], limit=2, log_samples_dir=out)
    assert (out / "results.json").is_file()
    assert stat.S_IMODE(out.stat().st_mode) == 0o750


def test_second_eval_to_one_out_is_refused_before_its_run(tmp_path):
    from moelab.evals import evaluate

    out = tmp_path / "run"
    second_ran = []

    def start_second():  # while the first run is working, a second one targets the same --out
        with pytest.raises(MoelabError, match="being written by another process"):
            evaluate(_echo_lm(lambda: second_ran.append(1)), tasks=["arith"], limit=2, log_samples_dir=out)

    evaluate(_echo_lm(start_second), tasks=["arith"], limit=2, log_samples_dir=out)
    assert not second_ran and (out / "results.json").is_file()


def _tiny_trainer(tmp_path, monkeypatch):
    from moelab.training import Trainer
    from tests.test_training import _tiny_config

    trainer = Trainer(_tiny_config(), tmp_path / "ckpt", progress=False)
    trainer.run(max_steps=1)
    # the exported files are what is tested here, not the model's scores
    monkeypatch.setattr(trainer, "_eval", lambda split, n, **kw: {"step": 1, "split": split})
    return trainer


def test_train_tiny_export_is_atomic_and_refuses_an_existing_out(tmp_path, monkeypatch):
    import moelab.training.model_card as card

    trainer = _tiny_trainer(tmp_path, monkeypatch)
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    with pytest.raises(MoelabError, match="already exists"):
        trainer.export(existing)
    assert sorted(p.name for p in existing.iterdir()) == ["keep.txt"]

    def crash(*a, **k):
        raise RuntimeError("interrupted while writing the model card")

    monkeypatch.setattr(card, "write_model_card", crash)
    with pytest.raises(RuntimeError, match="interrupted"):
        trainer.export(tmp_path / "model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "existing"]


def test_cli_train_tiny_refuses_an_existing_out_before_training(tmp_path, capsys, monkeypatch):
    import moelab.training

    def no_training(*a, **k):
        raise AssertionError("training started before --out was checked")

    monkeypatch.setattr(moelab.training, "Trainer", no_training)
    out = tmp_path / "model"
    out.mkdir()
    code = main(["train-tiny", "--model", "mixtral", "--out", str(out), "--checkpoint-dir", str(tmp_path / "c")])
    err = capsys.readouterr().err
    assert code == 2 and "already exists" in err and "Traceback" not in err


def test_cli_eval_claims_out_before_loading_the_model(tmp_path, capsys, monkeypatch):
    pytest.importorskip("lm_eval", reason="lm-eval is not installed")
    import moelab.loading
    from moelab._output import reserve_output

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before --out was claimed")

    monkeypatch.setattr(moelab.loading, "load", no_load)
    out = tmp_path / "run"
    with reserve_output(out, what="output"):  # another `moelab eval` is writing it
        code = main(["eval", "--model", "tiny-random-mixtral", "--tasks", "arith", "--limit", "1",
                     "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "being written by another process" in err and "Traceback" not in err
