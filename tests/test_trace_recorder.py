"""The recorder: hooks always removed, atomic output, bounded buffering, batching, hidden states."""

import json

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

import moelab
from moelab.adapters import moe_layers
from moelab.compat import cache_kwargs, output_cache
from moelab.forward import forward_hooks
from moelab.models.tokenizer import byte_tokenizer
from moelab.trace import RecordConfig, TraceRecorder, open_trace


@pytest.fixture(scope="module")
def model():
    return moelab.build_tiny("qwen2_moe")


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _gen(model, tok, prompts, n=3):
    enc = tok(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        return model.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)


def test_hooks_removed_after_exit_and_after_exception(model, tok, tmp_path):
    before = _hook_count(model)
    with moelab.record(model, tmp_path / "ok"):
        assert _hook_count(model) > before
        _gen(model, tok, ["abc"])
    assert _hook_count(model) == before
    with pytest.raises(RuntimeError, match="boom"), moelab.record(model, tmp_path / "bad"):
        _gen(model, tok, ["abc"])
        raise RuntimeError("boom")
    assert _hook_count(model) == before
    # an exception leaves nothing behind: no trace, no partial directory
    assert not (tmp_path / "bad").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["ok"]


def test_exception_inside_model_forward_resets_state(model, tok, tmp_path):
    with moelab.record(model, tmp_path / "t") as rec:
        with pytest.raises(Exception):  # noqa: B017 - any error from a bad input
            model(torch.tensor([[10**6]]))
        _gen(model, tok, ["hello"])
        mgr = forward_hooks(model, create=False)
        assert mgr.depth == 0 and mgr.ctx is None
    assert rec.trace.num_rows > 0
    assert forward_hooks(model, create=False) is None  # the last handler took the manager with it


def test_interrupted_recording_never_looks_complete(model, tok, tmp_path):
    rec = TraceRecorder(model, tmp_path / "trace", flush_rows=1)
    rec.start()
    _gen(model, tok, ["some tokens"])  # flushes row groups into the partial directory
    rec._remove_hooks()  # simulate a crash: close() never runs
    partial = [p for p in tmp_path.iterdir()]
    assert len(partial) == 1 and partial[0].name.startswith(".trace.partial-")
    assert not (tmp_path / "trace").exists()
    with pytest.raises(moelab.MoelabError, match="not a complete moelab trace"):
        open_trace(partial[0])
    rec.abort()
    assert list(tmp_path.iterdir()) == []


def test_existing_output_refused_unless_overwrite(model, tok, tmp_path):
    with moelab.record(model, tmp_path / "t"):
        _gen(model, tok, ["a"])
    with pytest.raises(moelab.MoelabError, match="already exists.*overwrite"):
        moelab.record(model, tmp_path / "t").start()
    with moelab.record(model, tmp_path / "t", overwrite=True) as rec:
        _gen(model, tok, ["bb", "ccc"])
    assert rec.trace.meta["num_sequences"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["t"]


def test_small_flushes_give_same_trace_as_one_flush(model, tok, tmp_path):
    with moelab.record(model, tmp_path / "one") as a:
        _gen(model, tok, ["hello world", "x"], n=4)
    with moelab.record(model, tmp_path / "many", flush_rows=5) as b:
        _gen(model, tok, ["hello world", "x"], n=4)
    assert pq.ParquetFile(tmp_path / "many" / "routes.parquet").num_row_groups > 1
    pd.testing.assert_frame_equal(a.trace.to_pandas(), b.trace.to_pandas())


def test_batched_left_padding_is_excluded_and_positions_count_real_tokens(model, tok, tmp_path):
    prompts = ["a", "a much longer prompt"]
    with moelab.record(model, tmp_path / "t") as rec:
        _gen(model, tok, prompts, n=3)
    t = rec.trace
    layers = t.num_moe_layers
    seq, pos, step = t.column("seq"), t.column("pos"), t.column("step")
    for s, prompt in enumerate(prompts):
        n = len(tok(prompt).input_ids)
        pre = (seq == s) & (step == 0)
        assert pre.sum() == n * layers  # no padding rows
        assert sorted(set(pos[pre])) == list(range(n))
        for k in (1, 2):  # decode step k is at position n + k - 1
            assert set(pos[(seq == s) & (step == k)]) == {n + k - 1}


def test_a_loop_without_attention_mask_records_every_token(model, tmp_path):
    """The unmasked fast path (no attention mask: every token real) keeps seq, pos and ids,
    also when the decode loop reuses one input buffer in place (as static-cache loops do)."""
    from transformers import DynamicCache

    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    fed = [ids]
    buf = torch.zeros(2, 1, dtype=torch.long)
    with torch.no_grad(), moelab.record(model, tmp_path / "t") as rec:
        out = model(input_ids=ids, **cache_kwargs(DynamicCache(config=model.config)), use_cache=True)
        for _ in range(3):
            buf.copy_(out.logits[:, -1:].argmax(-1))
            fed.append(buf.clone())
            out = model(input_ids=buf, **cache_kwargs(output_cache(out)), use_cache=True)
    t = rec.trace
    L = t.num_moe_layers
    seq, pos, step, tid = t.column("seq"), t.column("pos"), t.column("step"), t.column("token_id")
    assert len(seq) == (2 * 3 + 2 * 3) * L
    for s in (0, 1):
        for k, x in enumerate(fed):
            rows = (seq == s) & (step == k)
            want_pos = [0, 1, 2] if k == 0 else [2 + k]
            assert sorted(set(pos[rows])) == want_pos and rows.sum() == len(want_pos) * L
            assert sorted(set(tid[rows])) == sorted(set(x[s].tolist()))


def test_token_ids_recorded(model, tok, tmp_path):
    with moelab.record(model, tmp_path / "t") as rec:
        _gen(model, tok, ["hi!"], n=1)
    t = rec.trace
    rows = (t.column("moe_layer") == 0) & (t.column("step") == 0)
    assert t.column("token_id")[rows].tolist() == tok("hi!").input_ids


def test_hidden_states_are_the_router_inputs(model, tok, tmp_path):
    with moelab.record(model, tmp_path / "t", hidden_states=True, hidden_dtype="float32", flush_rows=7) as rec:
        _gen(model, tok, ["route me", "and me too"], n=3)
    t = rec.trace
    hidden = t.hidden_states()
    assert hidden.shape == (t.num_rows, model.config.hidden_size) and hidden.dtype == torch.float32
    layers = moe_layers(model)
    ml = t.column("moe_layer")
    for i, layer in enumerate(layers):
        rows = np.flatnonzero(ml == i)
        r = layer.route(hidden[rows])
        assert np.array_equal(r.experts.numpy(), t.experts_array()[rows])
        np.testing.assert_allclose(r.scores.numpy(), t.scores_array()[rows], rtol=1e-6, atol=1e-7)


def test_scores_can_be_turned_off(model, tok, tmp_path):
    with moelab.record(model, tmp_path / "t", scores=False) as rec:
        _gen(model, tok, ["abc"])
    assert "scores" not in pq.read_schema(tmp_path / "t" / "routes.parquet").names
    with pytest.raises(moelab.MoelabError, match="without router scores"):
        rec.trace.scores_array()


def test_readable_with_plain_pyarrow_and_pandas(model, tok, tmp_path):
    with moelab.record(model, tmp_path / "t"):
        _gen(model, tok, ["open format"])
    df = pd.read_parquet(tmp_path / "t" / "routes.parquet")
    meta = json.loads((tmp_path / "t" / "meta.json").read_text())
    assert list(df.columns) == ["seq", "step", "pos", "phase", "token_id", "layer", "moe_layer",
                                "experts", "weights", "scores"]
    assert len(df) == meta["num_rows"] and meta["schema_version"] == 1
    assert meta["model"]["num_experts"] == [8, 8, 8] and meta["model"]["top_k"] == [4, 4, 4]
    assert {"torch", "transformers", "moelab"} <= set(meta["versions"])
    assert all(len(e) == 4 for e in df["experts"]) and all(len(s) == 8 for s in df["scores"])


def test_reader_rejects_missing_truncated_and_newer_traces(model, tok, tmp_path):
    with pytest.raises(moelab.MoelabError, match="does not exist"):
        open_trace(tmp_path / "nope")
    with moelab.record(model, tmp_path / "t"):
        _gen(model, tok, ["abc"])
    meta_path = tmp_path / "t" / "meta.json"
    meta = json.loads(meta_path.read_text())

    meta_path.write_text(json.dumps({**meta, "schema_version": 99}))
    with pytest.raises(moelab.MoelabError, match="schema version 99.*upgrade moelab"):
        open_trace(tmp_path / "t")
    meta_path.write_text(json.dumps({**meta, "num_rows": meta["num_rows"] + 1}))
    with pytest.raises(moelab.MoelabError, match="truncated"):
        open_trace(tmp_path / "t")
    meta_path.write_text(json.dumps(meta))
    routes = tmp_path / "t" / "routes.parquet"
    routes.write_bytes(routes.read_bytes()[: routes.stat().st_size // 2])
    with pytest.raises(moelab.MoelabError, match="truncated or corrupt"):
        open_trace(tmp_path / "t")


def test_expert_load_counts_every_selection(model, tok, tmp_path):
    with moelab.record(model, tmp_path / "t") as rec:
        _gen(model, tok, ["count me in"], n=2)
    t = rec.trace
    load = t.expert_load()
    assert load.shape == (3, 8)
    assert load.sum() == t.num_rows * t.top_k
    assert load[1].sum() == (t.column("moe_layer") == 1).sum() * 4


def test_record_config_validates(model):
    with pytest.raises(moelab.MoelabError, match="hidden_dtype 'int8'"):
        RecordConfig(hidden_dtype="int8")


@pytest.mark.slow
def test_recording_inside_lm_eval_loglikelihood(model, tok, tmp_path):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=2)
    reqs = [Instance("loglikelihood", {}, ("2 + 2 =", " 4"), i) for i in range(3)]
    with moelab.record(lm.model, tmp_path / "t") as rec:
        lm.loglikelihood(reqs)
    t = rec.trace
    assert t.num_rows > 0 and set(t.column("phase")) == {"prefill"}


def test_rows_held_in_memory_stay_below_flush_rows(model, tok, tmp_path, monkeypatch):
    """Between forwards the recorder holds < flush_rows rows (buffered plus pending), whatever the rows."""
    import moelab.trace.recorder as recorder_mod

    monkeypatch.setattr(recorder_mod, "_PENDING_FORWARDS", 3)  # conversions that do not fill a flush
    flush = 40
    held = []
    with moelab.record(model, tmp_path / "t", hidden_states=True, flush_rows=flush) as rec:
        hook = model.register_forward_hook(lambda *a: held.append(rec._buf_rows + rec._pending_rows))
        try:
            for _ in range(3):
                _gen(model, tok, ["hello there", "a longer prompt here"], n=12)
        finally:
            hook.remove()
    assert rec.trace.num_rows > 5 * flush  # several flushes happened
    assert held and max(held) < flush
