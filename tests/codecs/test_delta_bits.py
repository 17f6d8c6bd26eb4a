"""Weight-delta bits that follow the change (tw_triton.delta_bits): the bound, the choice, the
rule option ``max_error`` and what the file records."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tw_triton
from tw_triton import delta_bits, ops
from tw_triton.errors import QuantizationError
from tw_triton.ops.backends import native
from tw_triton.ops.layout import qmax_for
from tw_triton.ops.reference import delta_statistics_torch
from tw_triton.rules import DELTA_MAX_ERROR, resolve_rules, rules_as_specs
from tw_triton.state.fingerprints import read_device_scalars


def bound(x, ref, bits=2, block=128):
    return delta_bits.error_bound(read_device_scalars(ops.delta_statistics(x, ref, block)), block, bits)


def two_bit_error(x, ref):
    q = tw_triton.quantize(x, bits=2, block=128, reference=ref)
    return float((tw_triton.dequantize(q, reference=ref) - x).norm() / x.norm())


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(1e-4, 1.0), n=st.integers(1, 3000))
def test_the_bound_holds_and_is_close(seed, scale, n):
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(n, generator=g)
    x = ref + scale * torch.randn(n, generator=g) ** 3
    e = bound(x, ref)
    # Integer sums of 12-bit magnitudes: the bound is within a few percent of the exact one.
    s = torch.nn.functional.pad((x - ref).abs(), (0, (-n) % 128)).view(-1, 128).amax(1).double()
    exact = 0.5 * math.sqrt(128 * float((s * s).sum())) / float(x.double().norm())
    assert e == pytest.approx(exact, rel=0.05, abs=1e-6)
    assert two_bit_error(x, ref) <= exact * (1 + 1e-5)


def test_more_bits_for_a_large_change_and_two_for_a_small_one():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(64, 128, generator=g)
    small = ref + 1e-4 * torch.randn(64, 128, generator=g)
    large = ref + 0.05 * torch.randn(64, 128, generator=g)
    huge = ref + 2.0 * torch.randn(64, 128, generator=g)
    fast = ref + 0.2 * torch.randn(64, 128, generator=g)
    state = {"model": {"small": small, "large": large, "huge": huge, "fast": fast}}
    q = tw_triton.quantize_state_dict(
        state, reference={"model": {k: ref for k in state["model"]}}, rules="smallest"
    )
    bits = {p.split("/")[-1]: (e.params["bits"], e.params.get("qmax")) for p, e in q.entries.items()}
    # The bound (max_error 1.5 %) is 7.2 % / qmax for large: qmax 5 in the 4-bit container
    # (1.44 %); fast, about 4x that: qmax 19 in the 8-bit one; huge, 126 % / qmax: qmax 84.
    assert bits == {"small": (2, None), "large": (4, 5), "fast": (8, 19), "huge": (8, 84)}
    # The file records each entry's bits and the rule's bound.
    assert any(r.get("max_error") == DELTA_MAX_ERROR["smallest"] for r in q.rules)


def test_choice_is_the_smallest_qmax_within_the_bound():
    values = [0] * 4
    # A zero delta keeps the rule's bits; a zero tensor with a change takes the widest.
    assert delta_bits.choose([0, 1065353216, 0, 1], 128, 2, 0.01) == (2, 1)
    assert delta_bits.choose([1065353216, 0, 1, 0], 128, 2, 0.01) == (8, 127)
    assert delta_bits.error_bound(values, 128, 2) == 0.0
    ref = torch.zeros(4096)
    x = torch.ones(4096)  # no reference: the delta is the tensor, e(qmax) = 0.5 / qmax
    stats = read_device_scalars(ops.delta_statistics(x, ref, 128))
    assert delta_bits.error_bound(stats, 128, 2) == pytest.approx(0.5)
    # Every qmax in turn, 1 to 127, in the narrowest container (2, 4 or 8 bits).
    for qmax in range(1, 128):
        bits = delta_bits.container(qmax)
        assert delta_bits.error_bound(stats, 128, bits, qmax) == pytest.approx(0.5 / qmax)
        assert delta_bits.error_bound(stats, 128, 8, qmax) == delta_bits.error_bound(stats, 128, bits, qmax)
        # Just at the bound and just above it: this qmax; just below it: the next.
        assert delta_bits.choose(stats, 128, 2, 0.5 / qmax) == (bits, qmax)
        assert delta_bits.choose(stats, 128, 2, 0.5 / qmax * (1 + 1e-9)) == (bits, qmax)
        if qmax < 127:
            assert delta_bits.choose(stats, 128, 2, 0.5 / qmax * (1 - 1e-9)) == (
                delta_bits.container(qmax + 1),
                qmax + 1,
            )
    assert delta_bits.choose(stats, 128, 2, 0.5 / 127 - 1e-9) == (8, 127)  # none fits: the widest
    assert delta_bits.choose(stats, 128, 4, 0.5) == (4, 7)  # never fewer than the rule's bits
    assert delta_bits.choose(stats, 128, 4, 0.03) == (8, 17)  # 0.5 / 17 <= 0.03 < 0.5 / 16
    # A coarser set of choices takes the next of its own.
    widths = (1, 3, 7, 15, 31, 63, 127)
    assert delta_bits.choose(stats, 128, 4, 0.03, widths) == (8, 31)
    assert delta_bits.choose(stats, 128, 2, 0.2, widths) == (4, 3)


def test_levels_are_coded_in_the_narrowest_container():
    """``qmax`` 1 is 2 bits; 2 to 7 are levels in the 4-bit container, 8 to 127 in the 8-bit
    one; the params record ``qmax`` only where it narrows the container."""
    base = {"bits": 2, "block": 128, "packing": "lsb-first", "delta": True}
    got = {q: delta_bits.coded_params(base, q) for q in range(1, 128)}
    for q, params in got.items():
        bits = 2 if q == 1 else 4 if q <= 7 else 8
        assert params["bits"] == delta_bits.container(q) == bits
        assert params.get("qmax") == (None if q in (1, 7, 127) else q)
        assert params["block"] == 128 and params["delta"] is True
    assert "qmax" not in delta_bits.coded_params({**base, "qmax": 3}, 127)


def test_nonfinite_tensor_keeps_a_choice_and_is_stored_exact():
    x = torch.randn(8192)
    x[3] = float("nan")
    q = tw_triton.quantize_state_dict(
        {"model": {"w": x}}, reference={"model": {"w": torch.zeros(8192)}}, rules="smallest"
    )
    assert q.entries["model/w"].codec == "exact"


def test_max_error_rule_option_round_trips_and_is_checked():
    state = {"model": {"w": torch.randn(8192)}}
    rules = resolve_rules([("model/*", {"codec": "int2", "max_error": 0.05})], state, bits=8, block=128)
    assert rules[0].max_error == 0.05 and rules[0].params["bits"] == 2
    assert resolve_rules(rules_as_specs(rules), state, bits=8, block=128)[: len(rules)] == rules
    for bad in (0, 1.5, "x", True):
        with pytest.raises(QuantizationError, match="max_error"):
            resolve_rules([("model/*", {"codec": "int2", "max_error": bad})], state, bits=8, block=128)
    with pytest.raises(QuantizationError, match="max_error"):
        resolve_rules([("model/*", {"codec": "log2", "max_error": 0.1})], state, bits=8, block=128)
    with pytest.raises(QuantizationError, match="max_error"):
        resolve_rules([("model/*", {"codec": "int3", "max_error": 0.1})], state, bits=8, block=128)
    # Rules without it record what they did before.
    assert "max_error" not in resolve_rules("small", state, bits=8, block=128)[-2].to_json()


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 70000), scale=st.floats(1e-30, 1e30))
def test_statistics_are_exact_integers_whatever_the_summation_order(seed, n, scale):
    # The choice of bits must not depend on the device or its reduction order: the sums are
    # those of the exact integers, computed here in Python, and the same on one thread or two.
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g) * scale).float()
    ref = (x + torch.randn(n, generator=g) * scale * 0.01).float()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = read_device_scalars(delta_statistics_torch(x, ref, 128))
        torch.set_num_threads(2)
        two = read_device_scalars(delta_statistics_torch(x, ref, 128))
    finally:
        torch.set_num_threads(before)
    assert one == two == read_device_scalars(ops.delta_statistics(x, ref, 128))
    if min(abs(x).max(), (x - ref).abs().max()) < delta_bits.TINY:
        return  # the sums of tiny maxima are not used (error_bound: the widest bits)
    b = x.abs().amax()
    levels = (
        x.abs().mul(256.0 / b.clamp_min(torch.finfo(torch.float32).tiny)).floor().to(torch.int64).tolist()
    )
    assert one[3] == sum(v * v for v in levels)
    d = torch.nn.functional.pad((x - ref).abs(), (0, (-n) % 128)).view(-1, 128).amax(1)
    a = d.amax()
    blocks = d.mul(4096.0 / a.clamp_min(torch.finfo(torch.float32).tiny)).floor().to(torch.int64).tolist()
    assert one[2] == sum(v * v for v in blocks)


SPECIALS = [
    0.0,
    -0.0,
    1e-45,
    1e-40,
    1.17549435e-38,
    3.4e38,
    -3.4e38,
    float("nan"),
    float("inf"),
    -float("inf"),
]


@pytest.mark.skipif(not native.enabled(), reason="the compiled CPU codec is not built")
@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 5000),
    block=st.sampled_from([1, 32, 128, 4096]),
    scale=st.sampled_from([1e-42, 1e-38, 1e-6, 1.0, 1e30]),
    dtypes=st.sampled_from(
        [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, None)]
    ),
    specials=st.floats(0.0, 0.05),
)
def test_the_compiled_statistics_are_the_specs(seed, n, block, scale, dtypes, specials):
    """The C statistics give the torch spec's four integers, or leave the tensor to it
    (non-finite values or differences, a maximum whose reciprocal overflows)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * scale
    pick = torch.rand(n, generator=g) < specials
    x[pick] = torch.tensor(SPECIALS)[torch.randint(0, len(SPECIALS), (int(pick.sum()),), generator=g)]
    ref = x + torch.randn(n, generator=g) * scale * 0.01
    x, ref = x.to(dtypes[0]), None if dtypes[1] is None else ref.to(dtypes[1])
    got = native.delta_statistics_native(x, ref, block)
    want = read_device_scalars(delta_statistics_torch(x, ref, block))
    finite = bool(torch.isfinite(x.float()).all()) and (
        ref is None or bool(torch.isfinite(x.float() - ref).all())
    )
    tiny = min(abs(delta_bits_as_float(v)) for v in want[:2]) < 1e-37
    if got is None:
        assert not finite or tiny
    else:
        assert got == want
    if finite and not tiny:
        assert got is not None  # the common case runs in C
    assert read_device_scalars(ops.delta_statistics(x, ref, block))[:2] == want[:2]


def delta_bits_as_float(bits: int) -> float:
    import struct

    return struct.unpack("<f", struct.pack("<i", bits))[0]


@pytest.mark.parametrize("tiny", [1e-39, 1e-32, 7e-31])
def test_a_tensor_or_delta_of_tiny_values_gets_the_widest_bits(tiny):
    """Maxima below TINY (the level scale overflows fp32 there, about 1e-35) give the widest
    bits, not a crash or a choice made of undefined sums."""
    x = torch.full((4096,), tiny)
    for ref in (torch.zeros(4096), x + 1.0, None):
        values = read_device_scalars(ops.delta_statistics(x, ref, 128))
        assert delta_bits.error_bound(values, 128, 2) == math.inf
    q = tw_triton.quantize_state_dict(
        {"model": {"w": x}}, reference={"model": {"w": torch.zeros(4096)}}, rules="smallest"
    )
    assert q.entries["model/w"].params["bits"] == 8
    back = tw_triton.dequantize_state_dict(q, reference={"model": {"w": torch.zeros(4096)}})
    assert float((back["model"]["w"] - x).abs().max()) <= tiny / 127 * 0.51 + 1e-45  # half an 8-bit step


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 9000),
    scale=st.floats(1e-5, 3.0),
    max_error=st.floats(1e-3, 0.2),
    bits=st.sampled_from([2, 4]),
)
def test_every_width_restores_within_max_error(seed, n, scale, max_error, bits):
    """Whatever ``qmax`` the choice takes (fewer levels than a container's included), the
    restored tensor is within the bound and ``max_error`` of the saved one, the entry
    records the container and ``qmax``, and one level fewer would not have fit."""
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(n, generator=g)
    x = ref + scale * torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 2
    rule = [("model/*", {"codec": "blockwise", "bits": bits, "max_error": max_error, "min_numel": 0})]
    q = tw_triton.quantize_state_dict({"model": {"w": x}}, reference={"model": {"w": ref}}, rules=rule)
    entry = q.entries["model/w"]
    back = tw_triton.dequantize_state_dict(q, reference={"model": {"w": ref}})["model"]["w"]
    values = read_device_scalars(ops.delta_statistics(x, ref, 128))
    chosen, qmax = delta_bits.choose(values, 128, bits, max_error)
    assert (entry.params["bits"], entry.params.get("qmax", qmax_for(chosen))) == (chosen, qmax)
    error = float((back - x).norm() / x.norm())
    assert error <= delta_bits.error_bound(values, 128, chosen, qmax) * (1 + 1e-5) + 1e-7
    if qmax < 127:
        assert error <= max_error * (1 + 1e-5) + 1e-7
    assert qmax >= qmax_for(bits)
    if qmax > qmax_for(bits):  # one level fewer would not have fit
        assert delta_bits.error_bound(values, 128, 8, qmax - 1) > max_error


def test_a_file_records_any_qmax_and_reads_it_back(tmp_path):
    """Every ``qmax`` the choice may take, 1 to 127, is written in its container, read back
    with its params checked, and decoded as in memory; one over the container is refused."""
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(4, 64, generator=g)
    x = ref + 0.1 * torch.randn(4, 64, generator=g)
    for q in range(1, 128):
        params = delta_bits.coded_params({"bits": 2, "block": 32}, q)
        rule = [("model/*", {"codec": "blockwise", **params, "min_numel": 0})]
        state = tw_triton.quantize_state_dict(
            {"model": {"w": x}}, reference={"model": {"w": ref}}, rules=rule
        )
        path = tmp_path / f"q{q}.safetensors"
        tw_triton.format.write_file(state, path)
        back = tw_triton.format.read_file(path)
        entry = back.entries["model/w"]
        assert (
            entry.params["bits"] == delta_bits.container(q)
            and entry.params.get("qmax", qmax_for(entry.params["bits"])) == q
        )
        got = tw_triton.dequantize_state_dict(back, reference={"model": {"w": ref}})["model"]["w"]
        want = tw_triton.dequantize_state_dict(state, reference={"model": {"w": ref}})["model"]["w"]
        assert torch.equal(got, want), q
    with pytest.raises(QuantizationError, match="qmax"):
        tw_triton.quantize_state_dict(
            {"model": {"w": x}},
            reference={"model": {"w": ref}},
            rules=[("model/*", {"codec": "blockwise", "bits": 4, "qmax": 8, "min_numel": 0})],
        )
