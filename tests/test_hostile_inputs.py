"""Corrupt or hostile files get one clear MoelabError (the CLI prints one line, exit 2), never a
traceback, a hang, a huge allocation or a silent acceptance (issue 18, "Other defects")."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import moelab
from moelab.cli import main
from moelab.errors import MoelabError
from moelab.predictors import load_predictor, make_predictor

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    """A small trace with hidden states and a learned predictor fitted on it."""
    from tests.test_predictors_conformance import record_trace

    root = tmp_path_factory.mktemp("hostile")
    trace = record_trace(root / "trace", n_seq=4, new_tokens=3)
    pred = make_predictor("learned", progress=False, max_epochs=2, width=16).fit(trace)
    pred.save(root / "pred")
    return {"trace": trace.path, "pred": root / "pred"}


@pytest.fixture()
def trace_dir(originals, tmp_path) -> Path:
    d = tmp_path / "trace"
    shutil.copytree(originals["trace"], d)
    return d


@pytest.fixture()
def pred_dir(originals, tmp_path) -> Path:
    d = tmp_path / "pred"
    shutil.copytree(originals["pred"], d)
    return d


def _edit_json(path: Path, fn) -> None:
    obj = json.loads(path.read_text())
    obj = fn(obj)
    path.write_text(json.dumps(obj))


def _set(keys: str, value):
    def fn(obj):
        *head, last = keys.split(".")
        o = obj
        for k in head:
            o = o[int(k)] if isinstance(o, list) else o[k]
        if isinstance(o, list):
            o[int(last)] = value
        else:
            o[last] = value
        return obj

    return fn


def _use_trace(path: Path) -> None:
    """What the commands do with a trace: open, summarise, read every column and hidden state."""
    tr = moelab.open_trace(path)
    tr.summary()
    tr.experts_array()
    tr.weights_array()
    if tr.has_scores:
        tr.scores_array()
    if tr.has_hidden_states:
        tr.hidden_states()


def _safetensors_bytes(tensors: dict) -> bytes:
    from safetensors.torch import save

    return save(tensors)


def _shard(d: Path) -> Path:
    return d / "hidden-00000.safetensors"


def _shard_tensor(d: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(_shard(d)))["hidden"]


def _garble_parquet(d: Path) -> None:
    """Overwrite the data pages with junk, keep the magic bytes and the footer intact."""
    p = d / "routes.parquet"
    data = bytearray(p.read_bytes())
    footer_len = int.from_bytes(data[-8:-4], "little")
    end = len(data) - 8 - footer_len
    rng = np.random.default_rng(0)
    data[4:end] = rng.integers(0, 256, end - 4, dtype=np.uint8).tobytes()
    p.write_bytes(bytes(data))


# (id, how to break the trace directory, the words the message must contain)
TRACE_CASES = [
    ("meta-is-a-list", lambda d: (d / "meta.json").write_text("[1, 2]"), "expected an object"),
    ("meta-without-model", lambda d: _edit_json(d / "meta.json", lambda m: {k: v for k, v in m.items() if k != "model"}), "model is None"),
    ("recording-null", lambda d: _edit_json(d / "meta.json", _set("recording", None)), "recording is None"),
    ("num-rows-a-string", lambda d: _edit_json(d / "meta.json", _set("num_rows", "100")), "num_rows is '100'"),
    ("num-experts-strings", lambda d: _edit_json(d / "meta.json", lambda m: _set("model.num_experts", [str(e) for e in m["model"]["num_experts"]])(m)), "model.num_experts[0]"),
    ("moe-layers-empty", lambda d: _edit_json(d / "meta.json", lambda m: _set("model.moe_layers", [])(_set("model.num_experts", [])(_set("model.top_k", [])(m)))), "model.moe_layers"),
    ("num-experts-1e9", lambda d: _edit_json(d / "meta.json", lambda m: _set("model.num_experts", [10**9] * len(m["model"]["num_experts"]))(m)), "1000000000"),
    ("top-k-above-experts", lambda d: _edit_json(d / "meta.json", lambda m: _set("model.top_k", [99] * len(m["model"]["top_k"]))(m)), "model.top_k[0]"),
    ("expert-ids-beyond-E", lambda d: _edit_json(d / "meta.json", lambda m: _set("model.num_experts", [2] * len(m["model"]["num_experts"]))(_set("model.top_k", [2] * len(m["model"]["top_k"]))(m))), "expert id"),
    ("garbled-parquet", _garble_parquet, "corrupt"),
    ("hidden-half-rows", lambda d: _shard(d).write_bytes(_safetensors_bytes({"hidden": _shard_tensor(d)[: len(_shard_tensor(d)) // 2].clone()})), "has shape"),
    ("hidden-other-name", lambda d: _shard(d).write_bytes(_safetensors_bytes({"states": _shard_tensor(d)})), "expected one named 'hidden'"),
    ("hidden-random-bytes", lambda d: _shard(d).write_bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes()), "not a readable safetensors"),
    ("hidden-nan", lambda d: _shard(d).write_bytes(_safetensors_bytes({"hidden": _shard_tensor(d).fill_(float("nan"))})), "NaN"),
    ("hidden-path-escape", lambda d: _edit_json(d / "meta.json", _set("recording.hidden_states.shards.0.file", "../../etc/passwd")), "inside the trace directory"),
    ("hidden-absolute-path", lambda d: _edit_json(d / "meta.json", _set("recording.hidden_states.shards.0.file", "/etc/passwd")), "inside the trace directory"),
]


@pytest.mark.parametrize("case,breaker,words", TRACE_CASES, ids=[c[0] for c in TRACE_CASES])
def test_corrupt_trace_gives_one_clear_error(trace_dir, case, breaker, words):
    breaker(trace_dir)
    with pytest.raises(MoelabError) as info:
        _use_trace(trace_dir)
    msg = str(info.value)
    assert words in msg and "\n" not in msg


@pytest.mark.parametrize("case", ["moe-layers-empty", "garbled-parquet", "expert-ids-beyond-E"])
def test_cache_simulate_refuses_a_corrupt_trace_in_one_line(trace_dir, case, capsys):
    dict((c[0], c[1]) for c in TRACE_CASES)[case](trace_dir)
    code = main(["cache", "simulate", "--trace", str(trace_dir), "--policy", "lru", "--capacity", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and err.strip().count("\n") == 0, err


def _with_state(d: Path, fn) -> None:
    from safetensors.numpy import load_file, save_file

    t = load_file(str(d / "state.safetensors"))
    save_file(fn(t), str(d / "state.safetensors"))


def _weight_name(d: Path) -> str:
    meta = json.loads((d / "predictor.json").read_text())
    return f"mlp.{meta['state']['layers'][0]}.0.weight"


def _transpose(d: Path) -> None:
    name = _weight_name(d)
    _with_state(d, lambda t: {**t, name: np.ascontiguousarray(t[name].T)})


def _nan_weight(d: Path) -> None:
    name = _weight_name(d)

    def fn(t):
        w = t[name].copy()
        w[0, 0] = np.nan
        return {**t, name: w}

    _with_state(d, fn)


PRED_CASES = [
    ("json-is-a-list", lambda d: (d / "predictor.json").write_text("[]"), "expected an object"),
    ("version-not-a-number", lambda d: _edit_json(d / "predictor.json", _set("format_version", "one")), "format_version is 'one'"),
    ("unknown-param", lambda d: _edit_json(d / "predictor.json", _set("params.bogus", 3)), "bogus"),
    ("layer-99", lambda d: _edit_json(d / "predictor.json", _set("state.layers", [99])), "99"),
    ("pickle-as-state", lambda d: (d / "state.safetensors").write_bytes(pickle.dumps({"x": 1})), "not a readable safetensors"),
    ("transposed-weight", _transpose, "has shape"),
    ("nan-weights", _nan_weight, "NaN"),
    ("num-experts-strings", lambda d: _edit_json(d / "predictor.json", lambda m: _set("model.num_experts", [str(e) for e in m["model"]["num_experts"]])(m)), "model.num_experts[0]"),
]


@pytest.mark.parametrize("case,breaker,words", PRED_CASES, ids=[c[0] for c in PRED_CASES])
def test_corrupt_predictor_gives_one_clear_error(pred_dir, case, breaker, words):
    breaker(pred_dir)
    with pytest.raises(MoelabError) as info:
        load_predictor(pred_dir)
    msg = str(info.value)
    assert words in msg and "\n" not in msg


def test_prompts_file_not_utf8(tmp_path):
    from moelab.prompts import read_prompts

    p = tmp_path / "prompts.txt"
    p.write_bytes(b"caf\xe9 au lait\n")
    with pytest.raises(MoelabError, match="not UTF-8"):
        read_prompts(p)


def test_model_config_too_large_is_refused_before_building(tiny_model_dir, tmp_path, monkeypatch):
    import transformers

    d = tmp_path / "huge"
    shutil.copytree(tiny_model_dir("mixtral"), d)
    _edit_json(d / "config.json", _set("num_hidden_layers", 10**6))

    def no_build(*a, **k):  # without the check, building it takes tens of GiB and minutes
        raise AssertionError("the model was built before its size was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_build)
    with pytest.raises(MoelabError, match="num_hidden_layers=1000000") as info:
        moelab.load(str(d))
    assert "\n" not in str(info.value)


def test_model_config_with_a_string_size_is_refused(tiny_model_dir, tmp_path):
    d = tmp_path / "bad"
    shutil.copytree(tiny_model_dir("mixtral"), d)
    _edit_json(d / "config.json", _set("num_local_experts", "eight"))
    with pytest.raises(MoelabError, match="num_local_experts.*eight") as info:
        moelab.load(str(d))
    assert "\n" not in str(info.value)


def test_dangling_symlink_out_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    out.symlink_to(tmp_path / "nowhere")
    import moelab.loading

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(moelab.loading, "load", no_load)
    code = main(["trace", "--model", "tiny-random-mixtral", "--task", "demo", "--limit", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "already exists" in err and "Traceback" not in err
