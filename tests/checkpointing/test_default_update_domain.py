"""The default preset ``smallest`` codes Adam's ``exp_avg`` in the update's domain
(``blockwise-update`` at int3, with its ``exp_avg_sq``); the other signed moments, and an
``exp_avg`` without a second moment, keep int4."""

from __future__ import annotations

import logging

import torch

import tw_triton
from tw_triton import format as fmt
from tw_triton.rules import resolve_rules


def _train(opt_cls, model: torch.nn.Module, **kw) -> torch.optim.Optimizer:
    torch.manual_seed(0)
    opt = opt_cls(model.parameters(), lr=1e-2, **kw)
    for _ in range(2):
        model(torch.randn(16, 128)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return opt


def _entries(tmp_path, model, opt) -> dict:
    ck = tw_triton.Checkpointer(tmp_path, fsync=False)  # rules: the default, smallest
    ck.save(1, model=model, optimizer=opt).result()
    entries = fmt.read_manifest(ck.path_for(1))["entries"]
    ck.close()
    return entries


def test_the_default_codes_adams_first_moment_as_int3_updates_with_its_second(tmp_path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(128, 64)
    opt = _train(torch.optim.AdamW, model)
    m = _entries(tmp_path, model, opt)["optimizer/state/0/exp_avg"]
    assert m["codec"] == "blockwise-update"
    assert (m["params"]["bits"], m["params"]["qmax"]) == (4, 3)  # int3: seven levels in 4 bits
    assert m["params"]["partner"] == "optimizer/state/0/exp_avg_sq"
    # The restored moment is u_hat * (sqrt(v_hat) + eps): close to the trained one, not equal.
    model2 = torch.nn.Linear(128, 64)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    ck = tw_triton.Checkpointer(tmp_path, fsync=False)
    ck.restore(model=model2, optimizer=opt2)
    ck.close()
    before, after = opt.state[model.weight]["exp_avg"], opt2.state[model2.weight]["exp_avg"]
    assert not torch.equal(before, after)
    v = opt2.state[model2.weight]["exp_avg_sq"]
    u, u_hat = before / (v.sqrt() + 1e-8), after / (v.sqrt() + 1e-8)
    # int3 blockwise codes of u: at most half a level (absmax / 3 / 2) per element, per block.
    bound = u.reshape(-1, 128).abs().amax(1, keepdim=True) / 6
    assert bool(((u_hat - u).reshape(-1, 128).abs() <= bound * 1.001 + 1e-6).all())


def test_other_signed_moments_and_a_partnerless_exp_avg_keep_int4(tmp_path, caplog) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(128, 64)
    sgd = _train(torch.optim.SGD, model, momentum=0.9)
    buf = _entries(tmp_path / "sgd", model, sgd)["optimizer/state/0/momentum_buffer"]
    assert buf["codec"] == "blockwise" and buf["params"]["bits"] == 4 and "qmax" not in buf["params"]
    # Adamax keeps exp_avg with exp_inf, not exp_avg_sq: the rule's fallback, int4, logged.
    model = torch.nn.Linear(128, 64)
    adamax = _train(torch.optim.Adamax, model)
    with caplog.at_level(logging.WARNING, logger="tw_triton"):
        m = _entries(tmp_path / "adamax", model, adamax)["optimizer/state/0/exp_avg"]
    assert m["codec"] == "blockwise" and m["params"]["bits"] == 4 and "qmax" not in m["params"]
    assert any("coded without a partner" in r.getMessage() for r in caplog.records)


def test_the_fallback_bits_are_the_rules_and_checked() -> None:
    import pytest

    from tw_triton.errors import QuantizationError
    from tw_triton.rules import partner_free

    z = torch.zeros(64, 64)
    state = {"model": {"w": z}, "optimizer": {"state": {0: {"exp_avg": z, "exp_avg_sq": z}}}}
    (rule,) = [r for r in resolve_rules("smallest", state, bits=8, block=128) if r.pattern == "*exp_avg"]
    assert rule.params["fallback_bits"] == 4
    alone = partner_free(rule)
    assert (alone.codec, alone.params["bits"], "qmax" in alone.params) == ("blockwise", 4, False)
    spec = {"codec": "blockwise-update", "bits": 3, "fallback_bits": 3}
    (rule,) = [
        r for r in resolve_rules([("*exp_avg", spec)], state, bits=8, block=128) if r.pattern == "*exp_avg"
    ]
    assert (partner_free(rule).params["bits"], partner_free(rule).params["qmax"]) == (4, 3)
    for bad in (5, True, "4", 1):
        with pytest.raises(QuantizationError, match="fallback_bits"):
            resolve_rules(
                [("*exp_avg", {"codec": "blockwise-update", "fallback_bits": bad})], state, bits=8, block=128
            )
