"""Flattening nested states to paths + a JSON skeleton, and rebuilding them with their types."""

from __future__ import annotations

import json
import random
from collections import Counter, OrderedDict, namedtuple

import numpy as np
import pytest
import torch
from _states import assert_same
from hypothesis import given, settings
from hypothesis import strategies as st

from tw_triton.errors import CheckpointError, QuantizationError
from tw_triton.tree import flatten, skeleton_tensor_paths, unflatten


def roundtrip(state):
    tensors, skeleton = flatten(state)
    # The skeleton goes through JSON in the file manifest.
    skeleton = json.loads(json.dumps(skeleton))
    return unflatten(skeleton, tensors), tensors


# ---- property test: arbitrary nestings come back identical -----------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=6),
)
small_tensors = st.builds(
    lambda n, dt, seed: (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 10).to(dt),
    st.integers(0, 6),
    st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool]),
    st.integers(0, 100),
)
arrays = st.builds(
    lambda n, dt: np.arange(n).astype(dt),
    st.integers(0, 5),
    st.sampled_from(["<u4", ">u4", "<f8", "|b1", "<i2"]),
)
keys = st.one_of(st.text(max_size=6), st.integers(-5, 50))
leaves = st.one_of(scalars, small_tensors, arrays)


def _unique_keys(d):
    # Keys that collide after str() (1 and "1") are rejected by design; tested separately.
    seen, out = set(), {}
    for k, v in d.items():
        if str(k) not in seen:
            seen.add(str(k))
            out[k] = v
    return out


trees = st.recursive(
    leaves,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.lists(kids, max_size=4).map(tuple),
        st.dictionaries(keys, kids, max_size=4).map(_unique_keys),
        st.dictionaries(st.text(max_size=5), kids, max_size=3).map(lambda d: OrderedDict(_unique_keys(d))),
        # MultiStepLR keeps its milestones as a Counter
        st.dictionaries(keys, kids, max_size=3).map(lambda d: Counter(_unique_keys(d))),
    ),
    max_leaves=20,
)


@settings(max_examples=120, deadline=None)
@given(trees)
def test_any_nesting_round_trips_with_types(state):
    out, _ = roundtrip(state)
    assert_same(state, out)


# ---- examples ------------------------------------------------------------------------------


def test_paths_of_a_training_state():
    w = torch.zeros(2, 2)
    state = {
        "model": OrderedDict([("enc.0.weight", w)]),
        "optimizer": {
            "state": {0: {"exp_avg": torch.ones(2)}},
            "param_groups": [{"params": [0], "lr": 1e-3}],
        },
        "rng": {"numpy": np.random.get_state(), "python": random.getstate()},
        "step": 7,
    }
    tensors, skeleton = flatten(state)
    assert list(tensors) == ["model/enc.0.weight", "optimizer/state/0/exp_avg", "rng/numpy/1"]
    assert tensors["model/enc.0.weight"] is not None
    assert skeleton_tensor_paths(skeleton) == list(tensors)
    out, _ = roundtrip(state)
    assert_same(state, out)
    assert list(out["optimizer"]["state"]) == [0]  # int key stays int
    assert isinstance(out["rng"]["python"][1], tuple)
    np.random.set_state(out["rng"]["numpy"])  # accepted by numpy as is
    random.setstate(out["rng"]["python"])


def test_module_state_dict_metadata_is_kept():
    sd = torch.nn.BatchNorm1d(4).state_dict()
    out, _ = roundtrip(sd)
    assert type(out) is OrderedDict
    assert out._metadata == sd._metadata
    torch.nn.BatchNorm1d(4).load_state_dict(out)


def test_slash_and_percent_in_keys_stay_distinct():
    state = {"a/b": torch.ones(1), "a%2Fb": torch.zeros(1), "a": {"b": torch.full((1,), 2.0)}}
    tensors, _ = flatten(state)
    assert set(tensors) == {"a%2Fb", "a%252Fb", "a/b"}
    out, _ = roundtrip(state)
    assert_same(state, out)


def test_colliding_keys_are_rejected_with_path():
    with pytest.raises(QuantizationError, match=r"'opt'.*same path component '1'"):
        flatten({"opt": {1: torch.ones(1), "1": torch.ones(1)}})


@pytest.mark.parametrize(
    "leaf, what",
    [
        ({1, 2}, "set"),
        (object(), "object"),
        (1 + 2j, "complex"),
        (namedtuple("P", "x y")(1, 2), "namedtuple"),
        (np.array(["a"]), "dtype"),
        (torch.zeros(3).to_sparse(), "layout"),
        (torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]), "nested"),
    ],
)
def test_unsupported_leaves_name_their_path(leaf, what):
    with pytest.raises(QuantizationError, match=r"'sched/extra/0'") as info:
        flatten({"sched": {"extra": [leaf]}})
    assert "pickle" in str(info.value) or what in str(info.value) or "layout" in str(info.value)


def test_numpy_leaves_keep_dtype_and_byte_order():
    state = [np.arange(4, dtype=">u4"), np.float32(1.5), np.int64(-3), np.array(2.5)]
    out, tensors = roundtrip(state)
    assert_same(state, out)
    assert out[0].dtype.str == ">u4"
    assert tensors["0"].dtype == torch.uint32


def test_deep_nesting_is_an_error_not_a_crash():
    deep = []
    node = deep
    for _ in range(5000):
        node.append([])
        node = node[0]
    with pytest.raises(QuantizationError, match="nested too deeply"):
        flatten(deep)
    loop = {}
    loop["self"] = loop
    with pytest.raises(QuantizationError, match="nested too deeply"):
        flatten(loop)
    skeleton = {"list": []}
    inner = skeleton["list"]
    for _ in range(5000):
        inner.append({"list": []})
        inner = inner[0]["list"]
    with pytest.raises(CheckpointError, match="malformed skeleton"):
        unflatten(skeleton, {})


def test_tensor_objects_are_shared_between_paths():
    t = torch.ones(3)
    tensors, skeleton = flatten({"a": t, "b": t})
    tensors["b"] = tensors["a"]
    out = unflatten(skeleton, tensors)
    assert out["a"] is out["b"]


@pytest.mark.parametrize(
    "skeleton",
    [
        {"tensor": "missing"},
        {"list": 3},
        {"dict": [[1]]},
        [1, 2],
        {"unknown-node": 1},
        {"npscalar": "O", "value": 1},
        {"npscalar": "not a dtype", "value": 1},
        {"bytes": "zz"},
        {"float": "spam"},
        {"dict": [[[1, 2], 3]]},
        {"list": [{"tuple": [{"list": [{"float": [1]}]}]}]},
        {"odict": [], "meta": {"tensor": 5}},
    ],
)
def test_malformed_skeleton_raises_checkpoint_error(skeleton):
    with pytest.raises(CheckpointError):
        unflatten(skeleton, {})


def test_leaf_tensors_are_flattens_tensors_in_order():
    from tw_triton.tree import flatten, leaf_tensors

    a, b, c, d = (torch.full((2,), float(i)) for i in range(4))
    state = {
        "model": OrderedDict(w=a, nested={"b": b}),
        "opt": [{"state": (c, 3, "x")}, np.zeros(2)],  # the array is not a tensor leaf
        "step": 7,
        "last": d,
    }
    got = list(leaf_tensors(state))
    flat, _ = flatten(state)
    want = [t for p, t in flat.items() if p != "opt/1"]
    assert len(got) == 4 and all(x is y or x.data_ptr() == y.data_ptr() for x, y in zip(got, want))
    assert [float(t[0]) for t in got] == [0.0, 1.0, 2.0, 3.0]
    assert list(leaf_tensors(torch.ones(1)))[0].shape == (1,)
    assert list(leaf_tensors({"x": 1, "y": []})) == []


def test_flattened_top_level_names_the_kind_of_each_value():
    from tw_triton.tree import Flattened

    state = {
        "model": OrderedDict(w=torch.ones(2)),
        "opt": {"state": {}},
        "hist": [1, 2],
        "pair": (torch.ones(1), 2),
        "step": 3,
        "t": torch.zeros(1),
        7: "seven",
    }
    top = Flattened.of(state).top_level()
    assert top == {
        "model": "dict",
        "opt": "dict",
        "hist": "container",
        "pair": "container",
        "step": "leaf",
        "t": "leaf",
        7: "leaf",
    }
    assert Flattened.of([torch.ones(1)]).top_level() is None
    flat = Flattened.of(state)
    assert Flattened.of(flat) is flat


@pytest.mark.parametrize("rules", [None, "default", "smallest", "int8-exp-avg", [("hist/*", "int8")]])
@pytest.mark.parametrize("shape", ["model", "flat", "list", "no-model"])
def test_quantize_state_dict_of_a_flattened_state_is_the_same(rules, shape):
    from tw_triton import quantize_state_dict
    from tw_triton.rules import resolve_rules
    from tw_triton.tree import Flattened

    g = torch.Generator().manual_seed(0)
    big = lambda: torch.randn(64, 96, generator=g)  # noqa: E731 (>= 4096 elements: quantized by rules)
    states = {
        "model": {"model": {"w": big(), "b": torch.ones(3)}, "optimizer": {"state": {0: {"exp_avg": big()}}}},
        "flat": {"w": big(), "v": big(), "step": 4},
        "list": [big(), {"x": big()}],
        "no-model": {"net": {"w": big()}, "hist": [big()]},
    }
    state = states[shape]
    flat = Flattened.of(state)
    assert [r.to_json() for r in resolve_rules(rules, flat, bits=8, block=64)] == [
        r.to_json() for r in resolve_rules(rules, state, bits=8, block=64)
    ]
    a = quantize_state_dict(state, rules=rules, checkpoint_id="c")
    b = quantize_state_dict(flat, rules=rules, checkpoint_id="c")
    assert a.skeleton == b.skeleton and a.rules == b.rules and a.aliases == b.aliases
    assert list(a.entries) == list(b.entries)
    for path in a.entries:
        ea, eb = a.entries[path], b.entries[path]
        assert (ea.codec, ea.params, ea.shape, ea.dtype) == (eb.codec, eb.params, eb.shape, eb.dtype)
        for name in ea.buffers:
            assert torch.equal(ea.buffers[name], eb.buffers[name])


def test_an_empty_top_level_key_does_not_share_paths_with_other_keys():
    """{"": [x]} once gave x the path "0", the path of a top-level key 0 (found by the
    property test above in CI)."""
    state = {0: np.array([7], dtype=np.uint32), "": [torch.tensor([15.41]), {"": torch.ones(2)}]}
    tensors, skeleton = flatten(state)
    assert len(tensors) == 3
    out = unflatten(skeleton, tensors)
    assert_same(state, out)
