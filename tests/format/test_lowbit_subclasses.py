"""Low-bit optimizer states without the optional packages (issue 32, item 2): a tensor
subclass outside the allowlist is refused at save time naming path and type; a file naming
a type outside the allowlist (or a known one with other inner tensors or metadata) fails
to load with CheckpointError and imports nothing; states a low-bit optimizer already
quantized (bitsandbytes' state dict layout, inner tensors) are stored exact whatever the
rules. The optimizers themselves: tests/integrations/test_lowbit_optimizers.py.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tw_triton
from tw_triton import Checkpointer, lowbit, rules
from tw_triton.errors import CheckpointError, QuantizationError, UnsupportedTensorError


class Wrapper(torch.Tensor):
    """A wrapper subclass: its data live in ``inner``, not in storage of its own."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(func)


def test_an_unknown_wrapper_subclass_is_refused_at_save_naming_path_and_type(tmp_path):
    state = {"optimizer": {"state": {0: {"exp_avg": Wrapper(torch.ones(8))}}}}
    with pytest.raises(UnsupportedTensorError) as info:
        tw_triton.quantize_state_dict(state)
    assert isinstance(info.value, CheckpointError) and isinstance(info.value, QuantizationError)
    message = str(info.value)
    assert "'optimizer/state/0/exp_avg'" in message and f"{__name__}.Wrapper" in message
    with Checkpointer(tmp_path / "run") as ckpt, pytest.raises(UnsupportedTensorError, match="Wrapper"):
        ckpt.save(0, optimizer=state["optimizer"])


def test_subclasses_that_own_their_storage_are_stored_as_plain_tensors(tmp_path):
    class Marked(torch.Tensor):
        pass

    state = {"p": torch.nn.Parameter(torch.arange(6.0)), "m": torch.arange(4.0).as_subclass(Marked)}
    path = tmp_path / "a.tw.safetensors"
    tw_triton.save(tw_triton.quantize_state_dict(state), path)
    out = tw_triton.load(path)
    assert torch.equal(out["p"], state["p"].detach()) and torch.equal(out["m"], torch.arange(4.0))


def _crafted(tmp_path, **node):
    """A file whose skeleton holds a subclass node (``node`` overrides its fields) over three
    stored inner tensors, as an AdamW8bit moment of 256 elements would be."""
    inner = {
        "codes": torch.zeros(256, dtype=torch.uint8),
        "scale": torch.ones(2),
        "qmap": torch.linspace(-1, 1, 256),
    }
    q = tw_triton.quantize_state_dict(inner, rules="exact")
    q.entries = {lowbit.inner_path("m", k): e for k, e in q.entries.items()}
    fields = {
        "subclass": "torchao.optim.subclass_8bit.OptimState8bit",
        "inner": [[k, {"tensor": lowbit.inner_path("m", k)}] for k in inner],
        "meta": {"list": [True, {"dtype": "float32"}]},
        "size": [256],
        "stride": [1],
    }
    fields.update(node)
    q.skeleton = {"dict": [["m", fields]]}
    path = tmp_path / "crafted.tw.safetensors"
    tw_triton.save(q, path)
    return path


@pytest.mark.parametrize(
    "node, expected",
    [
        ({"subclass": "builtins.eval"}, "'builtins.eval' is not one tw_triton rebuilds"),
        ({"subclass": "torchao.optim.subclass_8bit.Other"}, "is not one tw_triton rebuilds"),
        ({"inner": []}, "with inner tensors \\[\\], expected"),
        ({"meta": {"pickle": "80049"}}, "subclass metadata"),
        ({"meta": {"list": [True, {"dtype": "os.system"}]}}, "subclass metadata"),
        ({"size": [-1]}, "expected a list of non-negative ints"),
    ],
)
def test_a_file_naming_a_subclass_outside_the_allowlist_fails_to_load_importing_nothing(
    tmp_path, monkeypatch, node, expected
):
    path = _crafted(tmp_path, **node)
    imported = []
    real = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda name, *a: imported.append(name) or real(name, *a))
    with pytest.raises(CheckpointError, match=expected) as info:
        tw_triton.load(path)
    assert str(path) in str(info.value) and "'m'" in str(info.value)
    assert imported == []


def test_a_known_subclass_needs_its_package_to_be_rebuilt(tmp_path, monkeypatch):
    path = _crafted(tmp_path)

    def missing(name, *args):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(importlib, "import_module", missing)
    with pytest.raises(CheckpointError, match="needs the package 'torchao'"):
        tw_triton.load(path)


def _bnb_state(n: int = 8192) -> dict:
    """A bitsandbytes 8-bit Adam state dict as its ``state_dict()`` lays it out (uint8
    states, float32 absmax per block of 256 and 256-entry code maps under its key)."""
    g = torch.Generator().manual_seed(0)
    quant = {
        "state1": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g),
        "state2": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g),
        "absmax1": torch.rand(n // 256, generator=g),
        "absmax2": torch.rand(n // 256, generator=g),
        "qmap1": torch.linspace(-1, 1, 256),
        "qmap2": torch.linspace(0, 1, 256),
    }
    return {
        "model": {"w": torch.randn(n, generator=g)},
        "optimizer": {
            "state": {0: {"step": 3, lowbit.BNB_STATE_KEY: quant}},
            "param_groups": [{"lr": 1e-3, "params": [0]}],
        },
    }


@pytest.mark.parametrize("preset", ["smallest", "safe", [("optimizer/*", "int2"), ("*absmax*", "int4")]])
def test_bnb_states_are_stored_exact_whatever_the_rules(tmp_path, preset):
    state = _bnb_state()
    q = tw_triton.quantize_state_dict(state, rules=preset)
    quant = state["optimizer"]["state"][0][lowbit.BNB_STATE_KEY]
    for name in quant:
        assert q.entries[f"optimizer/state/0/{lowbit.BNB_STATE_KEY}/{name}"].codec == "exact"
    path = tmp_path / "bnb.tw.safetensors"
    tw_triton.save(q, path)
    back = tw_triton.load(path)["optimizer"]["state"][0][lowbit.BNB_STATE_KEY]
    assert all(torch.equal(back[k], v) for k, v in quant.items())
    # The same float32 tensor under another key is what the rules say (the test can fail).
    if not isinstance(preset, str):
        other = tw_triton.quantize_state_dict({"optimizer": {"absmax1": quant["absmax1"]}}, rules=preset)
        assert other.entries["optimizer/absmax1"].codec == "blockwise"


def test_inner_tensor_paths_are_exact_and_no_key_gives_them():
    smallest = rules.resolve_rules("smallest", {"optimizer": {}}, bits=8, block=128)
    x = torch.randn(8192)
    assert rules.select_rule(smallest, "optimizer/state/0/exp_avg_sq", x).codec == "log2-temporal"
    everything = rules.resolve_rules([("*", "int4")], {}, bits=8, block=128)
    for path in ("optimizer/state/0/exp_avg_sq/%scale", "exp_avg/%codes", f"a/{lowbit.BNB_STATE_KEY}/x"):
        assert lowbit.stored_as_is(path)
        assert {rules.select_rule(r, path, x).codec for r in (smallest, everything)} == {"exact"}
    assert rules.select_rule(everything, "exp_avg/codes", x).codec == "blockwise"
    # A "%" in a key is escaped, so a user's key never reads as an inner tensor.
    tensors, _ = tw_triton.tree.flatten({"exp_avg": {"%codes": x, "%": x, "": x}})
    assert not any(lowbit.stored_as_is(p) for p in tensors)
    assert lowbit.outer_path("o/exp_avg/%codes") == "o/exp_avg" and lowbit.outer_path("o/%25c") == "o/%25c"


_META = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
    | st.sampled_from([torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.uint8])
    | st.lists(st.integers(0, 2**20), max_size=4).map(torch.Size),
    lambda kids: st.lists(kids, max_size=4) | st.lists(kids, max_size=4).map(tuple),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(_META)
def test_subclass_metadata_round_trips_with_its_types(meta):
    back = lowbit.decode_meta(lowbit.encode_meta(meta, "p"), "p")

    def typed(v):
        if isinstance(v, (list, tuple)) and not isinstance(v, torch.Size):
            return (type(v).__name__, [typed(x) for x in v])
        return (type(v).__name__, v)

    assert typed(back) == typed(meta)


def test_subclass_metadata_a_file_cannot_record_is_refused():
    with pytest.raises(UnsupportedTensorError, match="'p'.*of type object"):
        lowbit.encode_meta([True, object()], "p")
