"""The ``log2-temporal`` codec: its spec's promises (never negative, zero iff zero, the
error bound, the absolute fallback equal to ``log2``), checked on the torch path with
integers computed independently, and the codec inside states, files and Checkpointer
chains (keyframes keep log2, deltas decode to the encoder's reconstruction)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tw_triton
from tw_triton import ops
from tw_triton.checkpointer import Checkpointer
from tw_triton.codecs import get_codec
from tw_triton.errors import CheckpointError, QuantizationError, ReferenceMismatchError
from tw_triton.format import read_manifest
from tw_triton.ops.reference import dequantize_log2_temporal_torch, quantize_log2_temporal_torch
from tw_triton.rules import keyframe_rules, resolve_rules

MIN_STEP = 1 << 19
INF_BITS = 0x7F800000


def _bits(x: torch.Tensor) -> np.ndarray:
    return x.float().numpy().view(np.int32).astype(np.int64)


@st.composite
def pairs(draw):
    """A second moment and the same moment later: drift, zeros coming and going, jumps."""
    n = draw(st.integers(1, 3000))
    block = draw(st.sampled_from((32, 64, 128, 1024)))
    bits = draw(st.sampled_from((8, 4, 2)))
    span = draw(st.sampled_from((0.0, 2.0, 30.0, 120.0)))
    drift = draw(st.sampled_from((0.0, 0.02, 0.5, 20.0)))
    zeros = draw(st.sampled_from((0.0, 0.02, 0.5)))
    min_step = draw(st.sampled_from((1, 1000, MIN_STEP)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    ref = torch.randn(n, generator=g, dtype=torch.float64).square() * torch.pow(
        2.0, span * torch.rand(n, generator=g, dtype=torch.float64) - span / 2
    )
    x = ref * torch.pow(2.0, drift * torch.randn(n, generator=g, dtype=torch.float64))
    # Finite in float32 too: the drift may carry a large value past float32's range.
    big = torch.finfo(torch.float32).max
    ref, x = ref.clamp(max=big).float(), x.clamp(max=big).float()
    ref[torch.rand(n, generator=g) < zeros] = 0.0
    x[torch.rand(n, generator=g) < zeros] = 0.0
    return x, ref, bits, block, min_step


def _steps(ref: torch.Tensor, bits: int, block: int, min_step: int) -> np.ndarray:
    """The temporal step of each block, from the spec's words, in numpy integers."""
    r = _bits(ref)
    out = []
    for b in range(0, r.size, block):
        rb = r[b : b + block]
        pos = rb[(rb > 0) & (rb < INF_BITS)]
        span = int(pos.max() - pos.min()) if pos.size else 0
        out.append(max(span // ((1 << bits) - 2), min_step))
    return np.array(out, dtype=np.int64)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=pairs())
def test_temporal_never_negative_zero_iff_zero_and_within_half_a_step(case) -> None:
    x, ref, bits, block, min_step = case
    codes, lo, hi = quantize_log2_temporal_torch(x, ref, bits, block, min_step)
    assert not bool((hi < 0).any())  # non-negative finite input: always codable
    dec = dequantize_log2_temporal_torch(codes, lo, hi, ref, x.numel(), bits, block, min_step)
    assert bool((dec >= 0).all()) and bool(torch.isfinite(dec).all())
    assert torch.equal(dec == 0, x == 0)
    assert not bool((dec.view(torch.int32) < 0).any())  # no -0 either
    t, t_hat = _bits(x), _bits(dec)
    steps = _steps(ref, bits, block, min_step)
    temporal = ((lo == 0) & (hi == 0)).numpy()
    for b in range(temporal.size):
        sl = slice(b * block, (b + 1) * block)
        if temporal[b]:
            err = np.abs(t_hat[sl] - t[sl])
            assert err.max() <= steps[b] // 2, (b, err.max(), steps[b])
            r = _bits(ref)[sl]
            # The codes are the rounded change, independently computed.
            d = t[sl] - r
            q = np.sign(d) * ((np.abs(d) + steps[b] // 2) // steps[b])
            want = np.where(t[sl] == 0, -128, q)
            assert np.array_equal(codes[sl].numpy().view(np.int8).astype(np.int64), want)
        else:
            # A block it could not code as a change holds the log2 codec's decode of it.
            xb = x[sl].clone()
            alone = ops.dequantize_log2(
                *ops.quantize_log2(xb, bits, block), xb.numel(), bits, block, xb.dtype
            )
            assert torch.equal(dec[sl], alone), b
            assert int(lo[b]) >= 1


def test_temporal_blocks_fall_back_only_when_they_must() -> None:
    ref = torch.tensor([1.0] * 32 + [0.0] * 32 + [1.0] * 32 + [1.0] * 31 + [float("nan")])
    x = torch.tensor([1.01] * 32 + [0.0] * 31 + [2.0] + [1e30] * 32 + [1.0] * 32)
    codes, lo, hi = quantize_log2_temporal_torch(x, ref, 4, 32, MIN_STEP)
    # unchanged-ish; a zero turned positive; a jump past 127 steps; NaN under a positive value.
    assert lo.tolist()[0] == 0 and hi.tolist()[0] == 0
    assert [int(v) >= 1 for v in lo[1:]] == [True, True, True]
    dec = dequantize_log2_temporal_torch(codes, lo, hi, ref, x.numel(), 4, 32, MIN_STEP)
    assert float(dec[63]) > 0 and bool((dec[32:63] == 0).all())


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), float("-inf")])
def test_temporal_flags_what_it_cannot_code(bad: float) -> None:
    x = torch.ones(64)
    x[40] = bad
    enc = get_codec("log2-temporal").encode(x, {"bits": 4, "block": 32, "min_step": MIN_STEP}, torch.ones(64))
    assert bool(enc.unusable)
    assert enc.entry.buffers["codes"][:16].view(torch.int32).tolist() == [0, -1, 0, -1]  # lo, then hi


def test_an_uncodable_or_partial_block_decodes_as_the_encoder_wrote_it() -> None:
    """What the encoder writes for a block it cannot code (bounds -1, codes 0) decodes to
    zeros, as log2's does; a partial last block of absolute codes is no corruption."""
    codec = get_codec("log2-temporal")
    params = {"bits": 4, "block": 32, "min_step": MIN_STEP, "delta": True}
    x = torch.rand(70) + 0.5
    x[3] = float("nan")
    ref = torch.rand(70) + 0.5
    ref[65] = 0.0  # a zero that turns positive: the partial last block is absolute
    enc = codec.encode(x, params, ref)
    assert bool(enc.unusable)
    dec = codec.decode(enc.entry, ref, None, "ctx")
    assert bool((dec[:32] == 0).all()) and bool((dec[32:] > 0).all())
    lo = enc.entry.buffers["codes"][:12].view(torch.int32)
    assert lo[0] == -1 and lo[2] >= 1
    enc.entry.buffers["codes"][24] = 1  # a code where the encoder writes 0
    with pytest.raises(CheckpointError, match="element 0 has code 1"):
        codec.decode(enc.entry, ref, None, "ctx")


def test_temporal_state_with_nan_is_stored_exact_and_logged(caplog) -> None:
    rules = [("v", {"codec": "log2-temporal", "min_numel": 0})]
    v = torch.rand(256)
    v[3] = float("nan")
    with caplog.at_level(logging.WARNING):
        q = tw_triton.quantize_state_dict({"v": v}, rules=rules, reference={"v": torch.rand(256)})
    assert q.entries["v"].codec == "exact" and "'v'" in caplog.text
    assert q.entries["v"].buffers["data"].view(torch.int32).equal(v.view(torch.int32))


def test_temporal_params_and_dtypes() -> None:
    codec = get_codec("log2-temporal")
    assert codec.accepts(torch.ones(4)) and not codec.accepts(torch.ones(4, dtype=torch.bfloat16))
    assert codec.resolve_params({}, bits=4, block=128) == {
        "bits": 4,
        "block": 128,
        "min_step": MIN_STEP,
        "delta": True,
    }
    for params, match in (
        ({"min_step": 0}, "min_step"),
        ({"min_step": True}, "min_step"),
        ({"delta": 1}, "delta"),
        ({"bits": 3}, "bits"),
        ({"packing": "lsb-first"}, "no parameter"),
    ):
        with pytest.raises(QuantizationError, match=match):
            codec.resolve_params(params, bits=4, block=128)
    assert codec.keyframe_spec({"bits": 4, "block": 64, "min_step": 9, "delta": True}) == (
        "log2",
        {"bits": 4, "block": 64, "packing": "lsb-first"},
    )


def test_temporal_decode_checks_its_reference_and_codes() -> None:
    codec = get_codec("log2-temporal")
    params = {"bits": 4, "block": 32, "min_step": MIN_STEP, "delta": True}
    ref = torch.rand(64) + 0.5
    entry = codec.encode(ref * 1.1, params, ref).entry
    with pytest.raises(CheckpointError, match="ctx: delta entry decoded without its reference"):
        codec.decode(entry, None, None, "ctx")
    with pytest.raises(ReferenceMismatchError, match="ctx: reference has shape"):
        codec.decode(entry, torch.ones(65), None, "ctx")
    zeroed = ref.clone()
    zeroed[5] = 0.0
    with pytest.raises(CheckpointError, match="ctx: corrupt log2-temporal codes: element 5 has code"):
        codec.decode(entry, zeroed, None, "ctx")
    # Block 0 absolute (lo = hi = 1), block 1 temporal; codes above 2**4 - 1 in block 0.
    bounds = torch.tensor([1, 0, 1, 0], dtype=torch.int32).view(torch.uint8)
    entry.buffers["codes"] = torch.cat([bounds, torch.full((64,), 200, dtype=torch.uint8)])
    with pytest.raises(CheckpointError, match="element 0 has code 200"):
        codec.decode(entry, ref, None, "ctx")


def test_temporal_decode_over_writes_into_its_reference() -> None:
    codec = get_codec("log2-temporal")
    params = {"bits": 4, "block": 32, "min_step": MIN_STEP, "delta": True}
    ref = torch.rand(8, 40) + 0.5
    entry = codec.encode(ref * 1.3, params, ref).entry
    want = codec.decode(entry, ref, None, "ctx")
    over = ref.clone()
    got = codec.decode_over(entry, over, None, "ctx")
    assert got is over and torch.equal(got, want)


def test_without_a_reference_it_codes_against_zero() -> None:
    """A moment the reference lacks (created after the keyframe) is coded against zero; a
    save with no reference at all codes it as a keyframe would (the same absolute codes,
    at half the bytes)."""
    rules = [("v", {"codec": "log2-temporal", "min_numel": 0})]
    x = torch.rand(300)
    q = tw_triton.quantize_state_dict({"v": x}, rules=rules, reference={"u": torch.rand(3)})
    e = q.entries["v"]
    assert e.codec == "log2-temporal" and e.buffers["codes"].numel() == 300 + 8 * 3
    assert e.params["delta"] is False and "ref_fp" not in e.params
    back = tw_triton.dequantize_state_dict(q)["v"]
    assert bool((back > 0).all())
    alone = tw_triton.quantize_state_dict({"v": x}, rules=rules)
    assert alone.entries["v"].codec == "log2"
    assert torch.equal(tw_triton.dequantize_state_dict(alone)["v"], back)


def test_a_missing_or_reshaped_reference_entry_is_a_reference_mismatch(tmp_path) -> None:
    ref = {"v": torch.rand(64, 64), "w": torch.rand(8)}
    q = tw_triton.quantize_state_dict(
        {"v": ref["v"] * 1.01, "w": ref["w"]},
        rules=[("v", {"codec": "log2-temporal", "min_numel": 0})],
        reference=ref,
    )
    path = tmp_path / "delta.safetensors"
    tw_triton.save(q, path, fsync=False)
    with pytest.raises(ReferenceMismatchError, match="entry 'v' has no tensor") as info:
        tw_triton.load(path, reference={"w": ref["w"]})
    assert str(path) in str(info.value)
    with pytest.raises(ReferenceMismatchError, match="entry 'v' has shape \\(64, 64\\)") as info:
        tw_triton.load(path, reference={"v": torch.rand(64, 65), "w": ref["w"]})
    assert str(path) in str(info.value)
    back = tw_triton.load(path, reference=ref)["v"]
    assert bool((back > 0).all())


def test_keyframe_rules_keep_log2_for_the_temporal_rule() -> None:
    state = {"optimizer": {"state": {0: {"exp_avg_sq": torch.rand(8192)}}}, "model": {"w": torch.rand(8192)}}

    def codecs_of(rules, glob):
        return [r.codec for r in rules if r.pattern == glob]

    rules = resolve_rules("smallest", state, bits=8, block=128)
    # Every non-negative role's glob: the temporal rule first, then log2 (other dtypes).
    assert codecs_of(rules, "*exp_avg_sq") == ["log2-temporal", "log2"]
    assert codecs_of(rules, "*/state/*/square_avg") == ["log2-temporal", "log2"]
    assert codecs_of(rules, "*exp_avg") == ["blockwise-update"]
    assert codecs_of(rules, "*/state/*/momentum_buffer") == ["blockwise"]
    kf = keyframe_rules(rules)
    assert kf[0].codec == "log2" and kf[0].params == {"bits": 4, "block": 128, "packing": "lsb-first"}
    assert "log2-temporal" not in {r.codec for r in kf}
    assert codecs_of(resolve_rules("small", state, bits=8, block=128), "*exp_avg_sq") == [
        "log2-temporal",
        "log2",
    ]
    assert codecs_of(resolve_rules("safe", state, bits=8, block=128), "*exp_avg_sq") == ["log2"]


def _moments(steps: int, n: int = 8192, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """A second moment updated as AdamW does (beta2 = 0.999), with a row of zeros that
    turns positive half way and values that collapse to zero."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.pow(2.0, 20 * torch.rand(n, generator=g) - 10)
    v = scale * scale  # warmed up: what it averages to
    v[:256] = 0.0
    out = []
    for s in range(steps):
        for _ in range(5):
            grad = torch.randn(n, generator=g) * scale
            if s < steps // 2:
                grad[:256] = 0.0
            v = 0.999 * v + 0.001 * grad * grad
        if s == steps - 2:
            v[-64:] = 0.0
        out.append({"exp_avg_sq": v.clone(), "step": torch.tensor(float(s))})
    return out


def _expected(states: list[dict[str, torch.Tensor]], closed: bool) -> list[torch.Tensor]:
    """What a chain must load, from the ops: the keyframe's log2 decode, then each delta
    against the last reconstruction (closed) or the keyframe's (open)."""
    n = states[0]["exp_avg_sq"].numel()
    v0 = states[0]["exp_avg_sq"]
    key = ops.dequantize_log2(*ops.quantize_log2(v0, 4, 128), n, 4, 128, torch.float32)
    out, ref = [key], key
    for s in states[1:]:
        enc = ops.quantize_log2_temporal(s["exp_avg_sq"], ref, 4, 128, MIN_STEP)
        dec = ops.dequantize_log2_temporal(*enc, ref, n, 4, 128, MIN_STEP)
        out.append(dec)
        ref = dec if closed else ref
    return out


@pytest.mark.parametrize("async_write, delta", [(True, "closed"), (False, "closed"), (True, "open")])
def test_checkpointer_chain_loads_the_encoders_reconstruction(tmp_path, async_write, delta) -> None:
    states = _moments(6)
    with Checkpointer(
        tmp_path,
        keyframe_every=100,
        keep_last=None,
        rules="smallest",
        delta=delta,
        async_write=async_write,
        fsync=False,
    ) as ck:
        for step, s in enumerate(states):
            ck.save(step, optimizer={"state": {0: s}})
    ck = Checkpointer(tmp_path, keep_last=None)
    infos = ck.infos()
    codecs = [read_manifest(i.path)["entries"]["optimizer/state/0/exp_avg_sq"]["codec"] for i in infos]
    assert codecs == ["log2"] + ["log2-temporal"] * 5
    want = _expected(states, closed=delta == "closed")
    for step in range(6):
        got = ck.load(step)["optimizer"]["state"][0]["exp_avg_sq"]
        assert torch.equal(got.view(torch.int32), want[step].view(torch.int32)), step
        assert torch.equal(got == 0, states[step]["exp_avg_sq"] == 0), step


def test_temporal_deltas_are_much_smaller_than_log2(tmp_path) -> None:
    states = _moments(4)
    with Checkpointer(tmp_path, keyframe_every=100, keep_last=None, rules="smallest", fsync=False) as ck:
        for step, s in enumerate(states):
            ck.save(step, optimizer={"state": {0: s}})
    m = [read_manifest(i.path) for i in Checkpointer(tmp_path, keep_last=None).infos()]

    def stored(manifest) -> int:
        bufs = manifest["entries"]["optimizer/state/0/exp_avg_sq"]["buffers"].values()
        assert len(bufs) == 1 or manifest is m[0]  # one buffer: its bounds are staged with the codes
        return sum(b["data_offsets"][1] - b["data_offsets"][0] for b in bufs)

    assert stored(m[2]) * 4 < stored(m[0]), [stored(x) for x in m]


def test_temporal_reconstruction_stays_positive_and_finite_at_the_ends() -> None:
    """Rounding to a whole step could land at or below zero next to the smallest
    subnormal, or past the largest finite value: the clamp keeps it positive and finite."""
    top = 0x7F7FFFFF
    t = torch.tensor([5] * 32 + [top] * 32, dtype=torch.int32)
    r = torch.tensor([1000] * 32 + [top - 3600] * 32, dtype=torch.int32)  # step: min_step
    x, ref = t.view(torch.float32), r.view(torch.float32)
    codes, lo, hi = quantize_log2_temporal_torch(x, ref, 4, 32, 1000)
    assert lo.tolist() == [0, 0] and hi.tolist() == [0, 0]
    assert codes.view(torch.int8)[[0, 32]].tolist() == [-1, 4]  # 0 and top + 400 before the clamp
    dec = dequantize_log2_temporal_torch(codes, lo, hi, ref, 64, 4, 32, 1000)
    assert dec.view(torch.int32)[[0, 32]].tolist() == [1, top]


@pytest.mark.parametrize("async_write", [True, False])
def test_a_moment_created_after_the_keyframe_is_coded_on_its_own(tmp_path, async_write) -> None:
    """An optimizer saved before its first step has no moments in the keyframe: the deltas
    after it code them against zero (``delta: false``) instead of refusing the save."""
    states = _moments(3)
    with Checkpointer(
        tmp_path, keyframe_every=100, keep_last=None, async_write=async_write, fsync=False
    ) as ck:
        ck.save(0, model={"w": torch.ones(8)}, optimizer={"state": {}})
        for step, s in enumerate(states, start=1):
            ck.save(step, model={"w": torch.ones(8)}, optimizer={"state": {0: s}})
    ck = Checkpointer(tmp_path, keep_last=None)
    for step, s in enumerate(states, start=1):
        entry = read_manifest(ck.path_for(step))["entries"]["optimizer/state/0/exp_avg_sq"]
        assert entry["codec"] == "log2-temporal" and entry["params"]["delta"] is False
        got = ck.load(step)["optimizer"]["state"][0]["exp_avg_sq"]
        assert torch.equal(got == 0, s["exp_avg_sq"] == 0) and bool((got >= 0).all())
