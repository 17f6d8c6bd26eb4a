"""The state API: quantize_state_dict / dequantize_state_dict / save / load."""

from __future__ import annotations

import logging
import math
import os
import pickle
import struct

import pytest
import torch
from _states import assert_same, make_state, perturbed
from hypothesis import given, settings
from hypothesis import strategies as st

import tw_triton
from tw_triton import (
    CheckpointError,
    QuantizationError,
    ReferenceMismatchError,
    dequantize_state_dict,
    load,
    quantize_state_dict,
    save,
)
from tw_triton.codecs import EXACT_DTYPES, Codec, Encoded, codec_names, get_codec, register_codec
from tw_triton.qstate import EncodedEntry, QuantizedState
from tw_triton.state import fingerprints as state_fingerprints


def header_bytes(path):
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


# ---- round trips --------------------------------------------------------------------------


def test_in_memory_and_file_round_trip(tmp_path):
    state = make_state()
    q = quantize_state_dict(state)
    path = tmp_path / "a.tw"
    size = save(q, path)
    assert (
        size
        == os.path.getsize(path)
        == tw_triton.format.read_manifest(path)["stats"]["stored_bytes"] + header_bytes(path)
    )
    # Without the entropy stage, the file is the buffers as they are plus the header.
    raw_path = tmp_path / "raw.tw"
    raw_size = save(q, raw_path, entropy=None)
    assert raw_size == q.nbytes + header_bytes(raw_path) > size
    for out in (dequantize_state_dict(q), load(path)):
        # Exact entries bit for bit, structure and types identical.
        assert_same(state["optimizer"], out["optimizer"])
        assert_same(state["model"]["b"], out["model"]["b"])
        assert out["step"] == 12 and math.isnan(out["loss"])
        # Quantized entries: dtype and shape kept, error within half a step per block.
        for k in ("w1", "w2"):
            x, y = state["model"][k], out["model"][k]
            assert y.dtype == x.dtype and y.shape == x.shape
            err = (x.float() - y.float()).abs().max()
            assert 0 < err <= x.float().abs().max() / 127 * 0.51 + 1e-2 * (x.dtype == torch.bfloat16)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 3000),
    bits=st.sampled_from([8, 4, 2]),
    block=st.sampled_from([32, 64, 128, 4096]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    with_ref=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_state_level_matches_tensor_codec_bit_for_bit(n, bits, block, dtype, with_ref, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g) * 3).to(dtype)
    ref = (x.float() + 0.01 * torch.randn(n, generator=g)).to(dtype) if with_ref else None
    rules = [("t", {"codec": "blockwise", "bits": bits, "block": block})]
    q = quantize_state_dict({"t": x}, rules=rules, reference={"t": ref} if with_ref else None)
    e = q.entries["t"]
    tq = tw_triton.quantize(x, bits=bits, block=block, reference=ref)
    assert torch.equal(e.buffers["codes"], tq.codes) and torch.equal(e.buffers["scales"], tq.scales)
    out = dequantize_state_dict(q, reference={"t": ref} if with_ref else None)["t"]
    assert torch.equal(out, tw_triton.dequantize(tq, reference=ref))


@pytest.mark.parametrize("dtype", EXACT_DTYPES, ids=str)
def test_exact_codec_stores_every_safetensors_dtype(tmp_path, dtype):
    x = (torch.arange(-6, 6) * 3).reshape(3, 4)
    x = x.to(dtype) if dtype != torch.bool else x > 0
    state = {"x": x, "x0": x[0, 0].clone(), "empty": torch.empty(0, 2, dtype=dtype)}
    save(quantize_state_dict(state, rules="exact"), tmp_path / "e.tw")
    assert_same(state, load(tmp_path / "e.tw"))


def test_snapshot_is_consistent_after_sources_change():
    state = make_state()
    before = {k: v.clone() for k, v in state["model"].items()}
    moment = state["optimizer"]["state"][0]["exp_avg"].clone()
    q = quantize_state_dict(state)
    expected = dequantize_state_dict(quantize_state_dict({"model": before}))["model"]
    for v in state["model"].values():
        v.mul_(-2).add_(1)  # training goes on and changes everything in place
    state["optimizer"]["state"][0]["exp_avg"].zero_()
    out = dequantize_state_dict(q)
    for k in before:
        assert torch.equal(out["model"][k], expected[k]), k
    assert torch.equal(out["optimizer"]["state"][0]["exp_avg"], moment)


def test_one_host_sync_for_the_whole_state(monkeypatch):
    """All NaN flags and fingerprints are read with one transfer; nothing else syncs."""
    calls = []
    real = state_fingerprints.read_device_scalars
    monkeypatch.setattr(
        state_fingerprints, "read_device_scalars", lambda s, *b: calls.append(len(s)) or real(s, *b)
    )

    # The tensor codec is checked on its own (its CPU path may read scalars: no device to
    # sync with); here the state-level glue around it must not read any device value.
    inside_codec = []
    real_quantize = tw_triton.codecs.blockwise.quantize

    def quantize(*a, **k):
        inside_codec.append(True)
        try:
            return real_quantize(*a, **k)
        finally:
            inside_codec.pop()

    real_item, real_bool = torch.Tensor.item, torch.Tensor.__bool__

    def guarded(real):
        def f(self, *a, **k):
            if not inside_codec:
                raise AssertionError("implicit host sync")
            return real(self, *a, **k)

        return f

    state = make_state()
    ref = perturbed(state)
    monkeypatch.setattr(tw_triton.codecs.blockwise, "quantize", quantize)
    monkeypatch.setattr(torch.Tensor, "item", guarded(real_item))
    monkeypatch.setattr(torch.Tensor, "__bool__", guarded(real_bool))
    q = quantize_state_dict(state, reference=ref)
    monkeypatch.undo()
    # Two quantized tensors: two NaN flags and two reference fingerprints, read at once.
    assert calls == [4]
    assert sum(e.codec == "blockwise" for e in q.entries.values()) == 2


def test_nonfinite_tensor_is_stored_exact_and_logged(caplog, tmp_path):
    state = make_state()
    state["model"]["w1"][3, 5] = float("nan")
    state["model"]["w2"][0, 0] = float("-inf")
    ref = make_state(seed=2)
    ref["model"]["w1"] = state["model"]["w1"].clone().nan_to_num()
    ref["model"]["extra"] = None
    state["model"]["w3"] = torch.randn(64, 64)
    ref["model"]["w3"] = state["model"]["w3"].clone()
    ref["model"]["w3"][1, 1] = float("inf")  # only the reference is not finite
    with caplog.at_level(logging.WARNING, logger="tw_triton.state"):
        q = quantize_state_dict(state, reference=ref)
    for p in ("model/w1", "model/w2", "model/w3"):
        assert q.entries[p].codec == "exact"
        assert any(p in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records), p
    save(q, tmp_path / "n.tw")
    out = load(tmp_path / "n.tw")  # no delta entry left: no reference needed
    assert q.reference_id is None
    for k in ("w1", "w2", "w3"):
        assert_same(state["model"][k], out["model"][k])


def test_tied_tensors_stored_once_and_still_tied(tmp_path):
    emb = torch.nn.Embedding(128, 64)
    head = torch.nn.Linear(64, 128, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    sd = model.state_dict()
    assert sd["emb.weight"].data_ptr() == sd["head.weight"].data_ptr()
    for rules in (None, "exact"):
        q = quantize_state_dict(sd, rules=rules)
        assert q.aliases == {"head.weight": "emb.weight"}
        assert list(q.entries) == ["emb.weight"]
        save(q, tmp_path / "t.tw")
        out = load(tmp_path / "t.tw")
        assert out["head.weight"] is out["emb.weight"]
        untied = dict(sd, **{"head.weight": sd["head.weight"].clone()})
        assert save(quantize_state_dict(untied, rules=rules), tmp_path / "u.tw") > os.path.getsize(
            tmp_path / "t.tw"
        )
    fresh = torch.nn.ModuleDict(
        {"emb": torch.nn.Embedding(128, 64), "head": torch.nn.Linear(64, 128, bias=False)}
    )
    fresh["head"].weight = fresh["emb"].weight
    fresh.load_state_dict(load(tmp_path / "t.tw"))
    assert fresh["head"].weight is fresh["emb"].weight
    assert torch.equal(fresh["emb"].weight, sd["emb.weight"])


def test_views_of_different_regions_are_stored_separately():
    base = torch.randn(2, 4096)
    state = {"a": base[0], "b": base[1], "t": base.t(), "same": base[0]}
    q = quantize_state_dict(state, rules="exact")
    assert q.aliases == {"same": "a"}
    assert set(q.entries) == {"a", "b", "t"}
    out = dequantize_state_dict(q)
    for k in state:
        assert torch.equal(out[k], state[k])
    assert out["a"].data_ptr() != out["b"].data_ptr()


# ---- references -----------------------------------------------------------------------------


def test_delta_against_in_memory_reference(tmp_path):
    state = make_state()
    ref = perturbed(state)
    q = quantize_state_dict(state, reference=ref)
    plain = quantize_state_dict(state)
    assert q.entries["model/w1"].params["delta"] is True
    assert "ref_fp" in q.entries["model/w1"].params
    assert q.reference_id.startswith("fp-")
    # Deterministic: the same reference gives the same id.
    assert quantize_state_dict(state, reference=ref).reference_id == q.reference_id
    save(q, tmp_path / "d.tw")
    out = load(tmp_path / "d.tw", reference=ref)
    base = dequantize_state_dict(plain)
    for k in ("w1", "w2"):
        x = state["model"][k].float()
        assert (out["model"][k].float() - x).abs().max() < (base["model"][k].float() - x).abs().max() / 10
    assert_same(state["optimizer"], out["optimizer"])


def test_reference_given_as_path_records_its_id(tmp_path):
    state = make_state()
    key = quantize_state_dict(perturbed(state), checkpoint_id="keyframe-0")
    save(key, tmp_path / "key.tw")
    q = quantize_state_dict(state, reference=tmp_path / "key.tw")
    assert q.reference_id == "keyframe-0"
    save(q, tmp_path / "d.tw")
    a = load(tmp_path / "d.tw", reference=tmp_path / "key.tw")
    b = load(tmp_path / "d.tw", reference=load(tmp_path / "key.tw"))
    assert_same(a, b)
    # An explicit id wins over the file's.
    assert (
        quantize_state_dict(state, reference=load(tmp_path / "key.tw"), reference_id="k0").reference_id
        == "k0"
    )


def test_a_delta_as_reference_decodes_through_the_file_it_names(tmp_path):
    state = make_state()
    save(quantize_state_dict(perturbed(state), checkpoint_id="kf"), tmp_path / "k.tw")
    save(quantize_state_dict(state, reference=tmp_path / "k.tw", checkpoint_id="d1"), tmp_path / "d.tw")
    # A chain (closed loop): d.tw is a delta from "kf", found by id beside it.
    q = quantize_state_dict(perturbed(state, seed=2), reference=tmp_path / "d.tw")
    assert q.reference_id == "d1"
    save(q, tmp_path / "d2.tw")
    want = load(tmp_path / "d2.tw", reference=load(tmp_path / "d.tw", reference=tmp_path / "k.tw"))
    assert_same(load(tmp_path / "d2.tw", reference=tmp_path / "d.tw"), want)
    (tmp_path / "k.tw").unlink()
    with pytest.raises(ReferenceMismatchError, match=r"d\.tw' is itself a delta from checkpoint 'kf'"):
        quantize_state_dict(state, reference=tmp_path / "d.tw")


def test_no_delta_entries_no_reference_id():
    state = make_state()
    assert quantize_state_dict(state, reference=state, rules="exact").reference_id is None
    assert quantize_state_dict(state, reference=state, reference_id="x", rules="exact").reference_id is None


def test_missing_reference_is_a_clear_error(tmp_path):
    state = make_state()
    save(quantize_state_dict(state, reference=perturbed(state), reference_id="kf-7"), tmp_path / "d.tw")
    with pytest.raises(ReferenceMismatchError, match=r"d\.tw.*entry 'model/w1'.*'kf-7'.*no reference"):
        load(tmp_path / "d.tw")


def test_wrong_reference_file_is_a_clear_error(tmp_path):
    state = make_state()
    save(quantize_state_dict(perturbed(state), checkpoint_id="kf-1"), tmp_path / "k1.tw")
    save(quantize_state_dict(perturbed(state, seed=5), checkpoint_id="kf-2"), tmp_path / "k2.tw")
    save(quantize_state_dict(state, reference=tmp_path / "k1.tw"), tmp_path / "d.tw")
    with pytest.raises(ReferenceMismatchError, match=r"d\.tw: entry 'model/w1'.*'kf-1'.*k2\.tw.*'kf-2'"):
        load(tmp_path / "d.tw", reference=tmp_path / "k2.tw")


def test_wrong_in_memory_reference_is_caught_by_fingerprint(tmp_path):
    state = make_state()
    save(quantize_state_dict(state, reference=perturbed(state), reference_id="kf"), tmp_path / "d.tw")
    other = perturbed(state, seed=9)
    with pytest.raises(ReferenceMismatchError, match=r"d\.tw: entry 'model/w[12]'.*fingerprint"):
        load(tmp_path / "d.tw", reference=other)
    # Only one tensor differs: the error names that entry.
    almost = perturbed(state)
    almost["model"]["w2"] = almost["model"]["w2"].clone()
    almost["model"]["w2"][7, 7] += 1
    almost["model"]["w2"][0, 0] += 1
    with pytest.raises(ReferenceMismatchError, match=r"entry 'model/w2'"):
        load(tmp_path / "d.tw", reference=almost)


def test_reference_with_missing_path_or_other_shape(tmp_path):
    state = make_state()
    ref = perturbed(state)
    save(quantize_state_dict(state, reference=ref), tmp_path / "d.tw")
    missing = {**ref, "model": {k: v for k, v in ref["model"].items() if k != "w2"}}
    with pytest.raises(ReferenceMismatchError, match=r"d\.tw: entry 'model/w2' has no tensor"):
        load(tmp_path / "d.tw", reference=missing)
    reshaped = {**ref, "model": {**ref["model"], "w1": ref["model"]["w1"].reshape(128, 64)}}
    with pytest.raises(ReferenceMismatchError, match=r"entry 'model/w1' has shape \(64, 128\).*\(128, 64\)"):
        load(tmp_path / "d.tw", reference=reshaped)
    # The same checks when quantizing.
    with pytest.raises(ReferenceMismatchError, match=r"entry 'model/w2' has no tensor"):
        quantize_state_dict(state, reference=missing)
    with pytest.raises(ReferenceMismatchError, match=r"'model/w1'.*shape"):
        quantize_state_dict(state, reference=reshaped)


# ---- codecs and errors ------------------------------------------------------------------------


class HalfCodec(Codec):
    """A toy codec: float32 stored as float16 (registered by the test, format untouched)."""

    def resolve_params(self, params, *, bits, block):
        return {"scale": float(params.get("scale", 1.0))}

    def accepts(self, tensor):
        return tensor.dtype == torch.float32

    def encode(self, x, params, reference):
        data = (x * params["scale"]).half()
        return Encoded(EncodedEntry("half", dict(params), tuple(x.shape), x.dtype, {"half": data}))

    def decode(self, entry, reference, device, context):
        return entry.buffers["half"].float().div(entry.params["scale"]).to(device or "cpu")


def test_registered_codec_round_trips_through_the_file(tmp_path):
    if get_codec("test-half") is None:
        register_codec("test-half", HalfCodec())
    assert "test-half" in codec_names()
    with pytest.raises(QuantizationError, match="already registered"):
        register_codec("test-half", HalfCodec())
    state = make_state()
    q = quantize_state_dict(state, rules=[("model/b", {"codec": "test-half", "scale": 2.0})])
    save(q, tmp_path / "h.tw")
    manifest = tw_triton.format.read_manifest(tmp_path / "h.tw")
    assert manifest["entries"]["model/b"]["codec"] == "test-half"
    assert manifest["entries"]["model/b"]["params"] == {"scale": 2.0}
    out = load(tmp_path / "h.tw")
    assert torch.equal(out["model"]["b"], state["model"]["b"].half().float())


def test_unknown_codec_on_load_names_file_and_entry(tmp_path):
    q = QuantizedState(
        entries={
            "model/x": EncodedEntry(
                "zstd-from-the-future", {"level": 3}, (4,), torch.float32, {"data": torch.zeros(4)}
            )
        },
        skeleton={"dict": [["model", {"dict": [["x", {"tensor": "model/x"}]]}]]},
        checkpoint_id="c",
    )
    save(q, tmp_path / "f.tw")
    with pytest.raises(
        CheckpointError, match=r"f\.tw: entry 'model/x': unknown codec 'zstd-from-the-future'"
    ):
        load(tmp_path / "f.tw")


def test_entry_not_matching_its_codec_is_a_checkpoint_error(tmp_path):
    q = quantize_state_dict(make_state())
    e = q.entries["model/w1"]
    e.buffers["scales"] = e.buffers["scales"][:-1].clone()
    save(q, tmp_path / "bad.tw")
    with pytest.raises(CheckpointError, match=r"bad\.tw: entry 'model/w1' \(codec 'blockwise'\): scales"):
        load(tmp_path / "bad.tw")
    q = quantize_state_dict(make_state())
    q.entries["model/w1"].params["bits"] = 5
    save(q, tmp_path / "bad2.tw")
    with pytest.raises(CheckpointError, match=r"bad2\.tw: entry 'model/w1'.*bits"):
        load(tmp_path / "bad2.tw")


def test_unsupported_leaf_is_rejected_with_path():
    with pytest.raises(QuantizationError, match=r"'scheduler/fn'"):
        quantize_state_dict({"scheduler": {"fn": lambda e: e}})
    with pytest.raises(QuantizationError, match=r"'x'.*complex64"):
        quantize_state_dict({"x": torch.zeros(2, dtype=torch.complex64)})


def test_load_never_unpickles(tmp_path, monkeypatch):
    state = make_state()
    save(quantize_state_dict(state, reference=perturbed(state)), tmp_path / "d.tw")
    save(quantize_state_dict(perturbed(state)), tmp_path / "k.tw")

    def boom(*a, **k):
        raise AssertionError("pickle used")

    monkeypatch.setattr(pickle, "loads", boom)
    monkeypatch.setattr(pickle, "load", boom)
    monkeypatch.setattr(pickle, "Unpickler", boom)
    monkeypatch.setattr(torch, "load", boom)
    load(tmp_path / "k.tw")
    load(tmp_path / "d.tw", reference=perturbed(state))


def test_cpu_load_does_not_copy_exact_tensors(tmp_path, monkeypatch):
    from tw_triton import format as fmt

    read = []
    real = fmt.read_file

    def spy(*a, **k):
        q = real(*a, **k)
        # Where each buffer was read to (load drops the buffers from q once decoded).
        read.append({p: {n: b.data_ptr() for n, b in e.buffers.items()} for p, e in q.entries.items()})
        read.append(q)
        return q

    monkeypatch.setattr(fmt, "read_file", spy)
    save(quantize_state_dict(make_state()), tmp_path / "a.tw")
    out = load(tmp_path / "a.tw")
    assert out["optimizer"]["state"][0]["exp_avg"].data_ptr() == read[0]["optimizer/state/0/exp_avg"]["data"]
    # The state load read is its own: every entry's buffers are let go once decoded.
    assert all(not e.buffers for e in read[1].entries.values())


def test_bad_arguments():
    with pytest.raises(QuantizationError, match="bits"):
        quantize_state_dict(make_state(), bits=5)
    with pytest.raises(QuantizationError, match="block"):
        quantize_state_dict(make_state(), block=48)


def test_metadata_and_ids_are_recorded(tmp_path):
    q = quantize_state_dict(make_state(), checkpoint_id="ck-1", metadata={"step": 12, "note": "x"})
    save(q, tmp_path / "m.tw")
    m = tw_triton.format.read_manifest(tmp_path / "m.tw")
    assert (m["checkpoint_id"], m["metadata"]) == ("ck-1", {"step": 12, "note": "x"})
    assert quantize_state_dict({}).checkpoint_id != quantize_state_dict({}).checkpoint_id


@pytest.mark.cuda
def test_cuda_round_trip_matches_cpu(tmp_path):
    state = make_state()
    ref = perturbed(state)
    to_cuda = lambda s: {**s, "model": {k: v.cuda() for k, v in s["model"].items()}}  # noqa: E731
    qc = quantize_state_dict(to_cuda(state), reference=to_cuda(ref), reference_id="r")
    qh = quantize_state_dict(state, reference=ref, reference_id="r")
    for p, e in qh.entries.items():
        for name, b in e.buffers.items():
            assert torch.equal(qc.entries[p].buffers[name].cpu(), b), (p, name)
    save(qc, tmp_path / "c.tw")
    out = load(tmp_path / "c.tw", device="cuda", reference=to_cuda(ref))
    assert out["model"]["w1"].is_cuda
    expect = dequantize_state_dict(qh, reference=ref)
    for k in state["model"]:
        assert torch.equal(out["model"][k].cpu(), expect["model"][k])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_load_to_cuda_without_cuda_is_a_clear_error(tmp_path):
    save(quantize_state_dict(make_state()), tmp_path / "a.tw")
    with pytest.raises(tw_triton.TwTritonError, match=r"a\.tw to device 'cuda'.*not available"):
        load(tmp_path / "a.tw", device="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_load_to_cuda_without_cuda_does_not_blame_the_file(tmp_path):
    """Callers take a CheckpointError for a bad file (and pass over it): a machine without
    CUDA is not one."""
    save(quantize_state_dict(make_state()), tmp_path / "a.tw")
    with pytest.raises(tw_triton.TwTritonError, match="CUDA is not available") as err:
        load(tmp_path / "a.tw", device="cuda")
    assert not isinstance(err.value, CheckpointError)


def test_a_bad_device_or_a_non_state_is_a_checkpoint_error_naming_it(tmp_path):
    """A device torch cannot parse was a raw RuntimeError/TypeError, CUDA without CUDA in
    dequantize_state_dict an AssertionError inside the first codec, a dict given to it an
    AttributeError."""
    save(quantize_state_dict(make_state()), tmp_path / "a.tw")
    q = quantize_state_dict(make_state())
    for bad in ("nope", "cuda:x", 3.5):
        with pytest.raises(CheckpointError, match=rf"a\.tw.*device {bad!r}"):
            load(tmp_path / "a.tw", device=bad)
        with pytest.raises(CheckpointError, match=rf"in-memory state.*device {bad!r}"):
            dequantize_state_dict(q, device=bad)
    if not torch.cuda.is_available():
        with pytest.raises(CheckpointError, match="to device 'cuda': CUDA is not available"):
            dequantize_state_dict(q, device="cuda")
    with pytest.raises(CheckpointError, match="expected a QuantizedState, got dict"):
        dequantize_state_dict(make_state())


json_values = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(-300, 5000), st.floats(allow_nan=False), st.text(max_size=4)
    ),
    lambda kids: st.one_of(
        st.lists(kids, max_size=3), st.dictionaries(st.text(max_size=8), kids, max_size=3)
    ),
    max_leaves=6,
)


@settings(max_examples=60, deadline=None)
@given(
    field=st.sampled_from(["bits", "block", "packing", "delta", "ref_fp", "skeleton", "codec", "alias"]),
    value=json_values,
)
def test_crafted_manifest_values_raise_checkpoint_errors_only(tmp_path_factory, field, value):
    """Whatever a (checksum-valid) file says in params or skeleton: a result or a CheckpointError."""
    state = make_state()
    ref = perturbed(state)
    q = quantize_state_dict(state, reference=ref)
    e = q.entries["model/w1"]
    if field == "skeleton":
        q.skeleton = value
    elif field == "codec":
        e.codec = value if isinstance(value, str) and value else "exact"
    elif field == "alias":
        q.aliases = {"model/w9": "model/w1"}
        q.skeleton = {"dict": [["w9", {"tensor": "model/w9"}], ["x", value]]}
    else:
        e.params = {**e.params, field: value}
    path = tmp_path_factory.mktemp("crafted") / "c.tw"
    save(q, path)
    try:
        load(path, reference=ref)
    except CheckpointError:
        pass


def test_a_reference_file_is_read_only_where_the_delta_needs_it(tmp_path, monkeypatch):
    from _read_spy import spy_on_reads

    state = make_state()
    save(quantize_state_dict(perturbed(state), checkpoint_id="kf"), tmp_path / "k.tw")
    save(quantize_state_dict(state, reference=tmp_path / "k.tw"), tmp_path / "d.tw")
    want = load(tmp_path / "d.tw", reference=load(tmp_path / "k.tw"))
    asked = spy_on_reads(monkeypatch)
    got = load(tmp_path / "d.tw", reference=tmp_path / "k.tw")
    assert_same(got, want)
    # The delta whole; of the keyframe only the tensors the delta is a delta of (the large
    # model weights), not its exact optimizer state. The two files are read at once, so
    # which read starts first is a race: compare without order.
    assert sorted(asked, key=lambda r: r[0]) == [("d.tw", None), ("k.tw", ["model/w1", "model/w2"])]


def _model_state(seed: int) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 8))
    return model, {"model": model.state_dict(), "note": "x"}


def test_load_into_fills_the_objects_tensors_keyframe_and_delta(tmp_path):
    model, state = _model_state(0)
    key = tw_triton.quantize_state_dict(state, rules="exact", checkpoint_id="kf")
    tw_triton.save(key, tmp_path / "kf.tw")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    delta = tw_triton.quantize_state_dict(
        {"model": model.state_dict(), "note": "x"}, reference=str(tmp_path / "kf.tw")
    )
    tw_triton.save(delta, tmp_path / "d.tw")
    for name, reference in (("kf.tw", None), ("d.tw", str(tmp_path / "kf.tw"))):
        want = tw_triton.load(tmp_path / name, reference=reference)
        fresh, _ = _model_state(1)
        got = tw_triton.load(tmp_path / name, reference=reference, into={"model": fresh})
        for k, t in fresh.state_dict().items():
            assert torch.equal(t, want["model"][k]), (name, k)
            # The delta's weights were decoded over the keyframe's, read into the model.
            assert got["model"][k].data_ptr() == t.data_ptr(), (name, k)
        assert got["note"] == "x"


def test_decode_targets_take_objects_state_dicts_and_leave_shared_memory_out():
    model, _ = _model_state(0)
    tied = torch.nn.Linear(4, 4, bias=False)
    other = torch.nn.Linear(4, 4, bias=False)
    other.weight = tied.weight
    targets = tw_triton.decode_targets({"model": model, "a": tied, "b": other, "plain": {"t": torch.ones(3)}})
    assert sorted(targets) == ["model/0.bias", "model/0.weight", "model/1.bias", "model/1.weight", "plain/t"]
    assert targets["model/0.weight"].data_ptr() == model[0].weight.data_ptr()
    # A module alone stands for its state dict at the top.
    assert sorted(tw_triton.decode_targets(model)) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert tw_triton.decode_targets({"x": {1, 2}}) == {}  # nothing the format could hold

    class Wrapped(torch.Tensor):
        pass

    # A tensor subclass may not own the memory it shows: left to load_state_dict.
    assert tw_triton.decode_targets({"w": torch.ones(3).as_subclass(Wrapped), "v": torch.ones(3)}).keys() == {
        "v"
    }


def test_a_state_whose_buffers_were_released_is_not_saved(tmp_path):
    """save() of what dequantize_state_dict(release_buffers=True) emptied wrote a file that
    no load could read; it is refused before the disk is touched."""
    q = quantize_state_dict(make_state())
    dequantize_state_dict(q, release_buffers=True)
    with pytest.raises(CheckpointError, match=r"holds no buffers.*release_buffers"):
        save(q, tmp_path / "r.tw")
    assert os.listdir(tmp_path) == []
