"""Ordered glob rules, the defaults of docs/codecs.md "rules and presets", presets, and their recording."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from tw_triton import quantize_state_dict
from tw_triton.errors import QuantizationError
from tw_triton.rules import (
    DEFAULT_MIN_NUMEL,
    PRESETS,
    make_rule,
    model_patterns,
    resolve_rules,
    select_rule,
)


def training_state():
    g = torch.Generator().manual_seed(0)
    big = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {
        "model": OrderedDict(
            [
                ("enc.weight", big(64, 128)),
                ("enc.bias", big(64)),
                ("norm.weight", big(64)),
                ("emb.weight", big(100, 64).bfloat16()),
                ("bn.num_batches_tracked", torch.tensor(5)),
                ("mask", torch.ones(64, 128, dtype=torch.bool)),
                ("double", big(64, 128).double()),
            ]
        ),
        "optimizer": {
            "state": {
                0: {"step": torch.tensor(3.0), "exp_avg": big(64, 128), "exp_avg_sq": big(64, 128).abs()}
            },
            "param_groups": [{"params": [0], "lr": 1e-3}],
        },
        "rng": {"torch": torch.get_rng_state()},
        "step": 3,
    }


def codecs_of(qstate):
    return {p: (e.codec, e.params.get("bits")) for p, e in qstate.entries.items()}


def test_defaults_follow_design():
    q = quantize_state_dict(training_state(), bits=4, block=64)
    c = codecs_of(q)
    # Large float tensors under the model: quantized with the call's bits/block.
    assert c["model/enc.weight"] == ("blockwise", 4)
    assert c["model/emb.weight"] == ("blockwise", 4)
    assert q.entries["model/enc.weight"].params["block"] == 64
    # Small, integer, bool, float64, optimizer moments, step counters, RNG: exact.
    for p in [
        "model/enc.bias",
        "model/norm.weight",
        "model/bn.num_batches_tracked",
        "model/mask",
        "model/double",
        "optimizer/state/0/step",
        "optimizer/state/0/exp_avg",
        "optimizer/state/0/exp_avg_sq",
        "rng/torch",
    ]:
        assert c[p] == ("exact", None), p


def test_size_threshold_is_inclusive():
    state = {"model": {"a": torch.randn(DEFAULT_MIN_NUMEL), "b": torch.randn(DEFAULT_MIN_NUMEL - 1)}}
    c = codecs_of(quantize_state_dict(state))
    assert c == {"model/a": ("blockwise", 8), "model/b": ("exact", None)}


def test_what_is_under_the_model():
    sd = torch.nn.Linear(128, 64).state_dict()
    assert model_patterns(sd) == ["*"]  # a plain module state_dict is all model
    assert model_patterns({"model": sd, "step": 1}) == ["model/*"]
    assert model_patterns({"model_state_dict": sd, "optimizer_state_dict": {}}) == ["model_state_dict/*"]
    assert model_patterns({"optimizer": {"state": {}}, "step": 1}) == []
    assert model_patterns([sd]) == []
    assert codecs_of(quantize_state_dict(sd))["weight"] == ("blockwise", 8)
    assert codecs_of(quantize_state_dict({"opt": {"w": sd["weight"]}}))["opt/w"] == ("exact", None)


def test_first_match_wins_and_user_rules_come_first():
    rules = [
        ("optimizer/state/*/exp_avg*", "int8"),
        ("model/enc.*", "exact"),
        ("model/*", {"codec": "blockwise", "bits": 2, "block": 32}),
        ("model/enc.weight", "int4"),  # shadowed by the rules above
    ]
    q = quantize_state_dict(training_state(), rules=rules, bits=4)
    c = codecs_of(q)
    assert c["optimizer/state/0/exp_avg"] == ("blockwise", 8)
    assert c["optimizer/state/0/exp_avg_sq"] == ("blockwise", 8)
    assert c["model/enc.weight"] == ("exact", None)
    assert c["model/enc.bias"] == ("exact", None)
    # No min_numel on a user rule: small tensors match too.
    assert c["model/norm.weight"] == ("blockwise", 2)
    assert q.entries["model/norm.weight"].params["block"] == 32
    # A rule whose codec cannot encode the dtype falls through to the next rule.
    assert c["model/bn.num_batches_tracked"] == ("exact", None)
    assert c["model/double"] == ("exact", None)
    assert c["optimizer/state/0/step"] == ("exact", None)


def test_rules_in_force_are_recorded():
    q = quantize_state_dict(
        training_state(), rules=[("model/enc.*", {"codec": "int4", "min_numel": 10})], block=256
    )
    assert q.rules[0] == {
        "pattern": "model/enc.*",
        "codec": "blockwise",
        "params": {"bits": 4, "block": 256, "packing": "lsb-first", "delta": True},
        "min_numel": 10,
    }
    # The defaults follow the user's rules.
    assert q.rules[1]["pattern"] == "model/*" and q.rules[1]["min_numel"] == DEFAULT_MIN_NUMEL
    assert q.rules[-1] == {"pattern": "*", "codec": "exact", "params": {}, "min_numel": 0}
    assert codecs_of(q)["model/enc.bias"] == ("blockwise", 4)


def test_presets():
    state = training_state()
    assert set(PRESETS) >= {"exact", "int8-delta", "int4-delta", "int8-exp-avg"}
    assert all(e.codec == "exact" for e in quantize_state_dict(state, rules="exact").entries.values())
    c4 = codecs_of(quantize_state_dict(state, rules="int4-delta", bits=8))
    assert c4["model/enc.weight"] == ("blockwise", 4) and c4["optimizer/state/0/exp_avg"] == ("exact", None)
    cm = codecs_of(quantize_state_dict(state, rules="int8-exp-avg"))
    assert cm["optimizer/state/0/exp_avg"] == ("blockwise", 8)
    # Linear codes for the second moment broke resumed runs (benchmarks/results): exact.
    assert cm["optimizer/state/0/exp_avg_sq"] == ("exact", None)
    assert cm["optimizer/state/0/step"] == ("exact", None)
    assert cm["model/enc.weight"] == ("blockwise", 8)
    assert codecs_of(quantize_state_dict(state, rules="default")) == codecs_of(quantize_state_dict(state))


def test_delta_false_in_a_rule_opts_out_of_the_reference():
    state = training_state()
    q = quantize_state_dict(
        state, reference=state, rules=[("model/enc.weight", {"codec": "int8", "delta": False})]
    )
    assert q.entries["model/enc.weight"].params["delta"] is False
    assert q.entries["model/emb.weight"].params["delta"] is True


@pytest.mark.parametrize(
    "rules, message",
    [
        ([("model/*", "zstd-9000")], "unknown codec 'zstd-9000'"),
        ([("model/*", {"codec": "blockwise", "bits": 3})], "bits must be one of"),
        ([("model/*", {"codec": "blockwise", "block": 100})], "block must be a power of two"),
        ([("model/*", {"codec": "blockwise", "gamma": 1})], "no parameter"),
        ([("model/*", {"codec": "exact", "bits": 8})], "takes no parameters"),
        ([("model/*", {"bits": 8})], "needs a 'codec' name"),
        ([("model/*", {"codec": "int8", "min_numel": -1})], "min_numel"),
        ([("model/*",)], "pair"),
        (["model/*"], "pair"),
        ([("", "exact")], "non-empty"),
        ("int3-delta", "unknown rules preset"),
        (42, "rules must be"),
    ],
)
def test_bad_rules_raise_quantization_error(rules, message):
    with pytest.raises(QuantizationError, match=message):
        quantize_state_dict(training_state(), rules=rules)


def test_select_rule_on_paths_directly():
    rules = resolve_rules([("a/*/x", "int2")], {"model": {}}, bits=8, block=128)
    t = torch.randn(10)
    assert select_rule(rules, "a/1/x", t).params["bits"] == 2
    assert select_rule(rules, "a/1/y", t).codec == "exact"
    # fnmatch semantics: * crosses /, matching is case-sensitive.
    assert select_rule(rules, "a/1/2/x", t).codec == "blockwise"
    assert select_rule(rules, "A/1/x", t).codec == "exact"
    r = make_rule("p", "int4", bits=8, block=64)
    assert (r.codec, r.params["bits"], r.params["block"]) == ("blockwise", 4, 64)
