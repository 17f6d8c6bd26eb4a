"""The ``log2`` second-moment codec: its spec's promises, checked on the torch path against
facts computed independently (numpy integers), and the codec inside a training state."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch
from _codec_oracle import spec_decode_log2, spec_encode_log2
from hypothesis import given, settings
from hypothesis import strategies as st

import tw_triton
from tw_triton.codecs import get_codec
from tw_triton.codecs.log2 import (
    Log2Tensor,
    dequantize_log2,
    dequantize_log2_torch,
    levels,
    quantize_log2,
    quantize_log2_torch,
)
from tw_triton.errors import CheckpointError, QuantizationError

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _bits(x: torch.Tensor) -> np.ndarray:
    return x.float().numpy().view(np.int32).astype(np.int64)


@st.composite
def moments(draw):
    dtype = draw(st.sampled_from(FLOATS))
    n = draw(st.integers(1, 3000))
    block = draw(st.sampled_from((32, 64, 128, 1024)))
    bits = draw(st.sampled_from((8, 4, 2)))
    lo, hi = (-7, 4) if dtype == torch.float16 else (-40, 30)
    e0 = draw(st.integers(lo, hi))
    span = draw(st.integers(0, 30))
    seed = draw(st.integers(0, 2**31 - 1))
    zeros = draw(st.sampled_from((0.0, 0.3, 1.0)))
    g = torch.Generator().manual_seed(seed)
    e = e0 + span * torch.rand(n, generator=g, dtype=torch.float64)
    v = torch.randn(n, generator=g, dtype=torch.float64).square() * torch.pow(10.0, e)
    v[torch.rand(n, generator=g, dtype=torch.float64) < zeros] = 0.0
    return v.clamp(max=torch.finfo(dtype).max).to(dtype), bits, block


# Values that take every branch of the encoder: zeros of both signs, uncodable elements,
# the extremes of fp32, subnormals, and plain positives.
_SPECIALS = (0.0, -0.0, float("nan"), float("inf"), -float("inf"), -1.0, 3.4e38, 1e-45, 1e-40, 1.0)


@st.composite
def mixed_blocks(draw):
    """Tensors whose blocks are all positive, all ``+0``, or mixed with special values, in
    chunks of the torch path's size or a few blocks, strided or not."""
    dtype = draw(st.sampled_from(FLOATS))
    block = draw(st.sampled_from((32, 128, 256)))
    bits = draw(st.sampled_from((8, 4, 2)))
    n = draw(st.sampled_from((1, 31, 129, 3 * 256 + 5, (1 << 20) + 300)))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.exp2((torch.rand(n, generator=g) - 0.5) * draw(st.floats(0, 60)))
    zero_blocks = torch.rand(-(-n // block), generator=g) < draw(st.sampled_from((0.0, 0.5, 1.0)))
    x.view(-1)[zero_blocks.repeat_interleave(block)[:n]] = 0.0
    for i in draw(st.lists(st.integers(0, n - 1), max_size=8)):
        x[i] = draw(st.sampled_from(_SPECIALS))
    x = x.to(dtype)
    if draw(st.booleans()) and n > 2:
        x = x[::2]
    return x, bits, block


@settings(max_examples=60, deadline=None)
@given(mixed_blocks())
def test_log2_torch_path_equals_the_numpy_spec_byte_for_byte(case) -> None:
    """The chunked torch path (fast all-positive and all-zero blocks, masked mixed ones,
    word-wide packing) against the spec restated plainly in numpy."""
    x, bits, block = case
    codes, lo, hi = quantize_log2_torch(x, bits, block)
    want_codes, want_lo, want_hi = spec_encode_log2(x.float().reshape(-1).numpy(), bits, block)
    assert np.array_equal(lo.numpy(), want_lo) and np.array_equal(hi.numpy(), want_hi)
    assert np.array_equal(codes.numpy(), want_codes)
    y = dequantize_log2_torch(codes, lo, hi, x.numel(), bits, block, x.dtype)
    want = torch.from_numpy(spec_decode_log2(want_codes, want_lo, want_hi, x.numel(), bits, block)).to(
        x.dtype
    )
    assert torch.equal(y.view(torch.uint8), want.view(torch.uint8))


@settings(max_examples=200, deadline=None)
@given(moments())
def test_log2_never_negative_zero_iff_zero_and_bounded_in_the_log_domain(case) -> None:
    x, bits, block = case
    q = quantize_log2(x, bits=bits, block=block)
    y = dequantize_log2(q)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert not bool(q.unusable)
    xf, yf = x.float(), y.float()
    zero = xf == 0
    assert bool((yf[zero] == 0).all()), "a zero did not decode to zero"
    assert bool((yf[~zero] > 0).all()), "a positive value decoded to zero or below"
    # Independent of the implementation: the block bounds and the error in the bit domain.
    t = _bits(x)
    t_hat = _bits(y.float()) if x.dtype == torch.float32 else None
    n_steps = levels(bits)
    for b0 in range(0, x.numel(), block):
        tb = t[b0 : b0 + block]
        pos = tb > 0
        if not pos.any():
            continue
        lo, hi = int(tb[pos].min()), int(tb[pos].max())
        assert int(q.lo[b0 // block]) == lo and int(q.hi[b0 // block]) == hi
        yb = yf[b0 : b0 + block][torch.from_numpy(pos)]
        lo_v, hi_v = np.array([lo, hi], dtype=np.int32).view(np.float32)
        assert bool((yb >= float(lo_v) * (1 - 2**-8)).all()) and bool((yb <= float(hi_v)).all())
        if t_hat is not None:
            step = (hi - lo) / n_steps
            err = np.abs(t_hat[b0 : b0 + block][pos] - tb[pos])
            assert err.max() <= step / 2 + 2 + (hi - lo) * 2**-21, (err.max(), step)


@settings(max_examples=60, deadline=None)
@given(moments())
def test_log2_is_monotone_within_a_block(case) -> None:
    x, bits, block = case
    y = dequantize_log2(quantize_log2(x, bits=bits, block=block)).float()
    xf = x.float()
    for b0 in range(0, x.numel(), block):
        order = torch.argsort(xf[b0 : b0 + block], stable=True)
        yb = y[b0 : b0 + block][order]
        assert bool((yb[1:] >= yb[:-1]).all())


def test_log2_eight_bits_is_close_on_a_realistic_second_moment() -> None:
    g = torch.Generator().manual_seed(0)
    grads = torch.randn(64, 4096, generator=g) * torch.logspace(-6, -1, 64).unsqueeze(1)
    v = grads.square()
    y = dequantize_log2(quantize_log2(v, bits=8, block=128))
    ratio = (y / v).log2().abs()
    assert float(ratio.max()) < 0.2  # within 15 % everywhere, on a real-looking spread


@pytest.mark.parametrize("bad", [-1.0, -1e-38, float("nan"), float("inf"), float("-inf")])
def test_log2_flags_what_it_cannot_code(bad: float) -> None:
    x = torch.ones(300)
    x[-1] = bad
    q = quantize_log2(x, bits=4, block=128)
    assert bool(q.unusable)
    assert int(q.lo[-1]) == -1 and int(q.hi[-1]) == -1 and int(q.hi[0]) > 0


def test_log2_negative_zero_is_a_zero() -> None:
    x = torch.tensor([-0.0, 1.0, 0.0, 2.0] * 8)
    q = quantize_log2(x, bits=2, block=32)
    assert not bool(q.unusable)
    y = dequantize_log2(q)
    assert bool((y[::2] == 0).all()) and bool((y[1::2] > 0).all())


def test_log2_stored_bytes() -> None:
    for bits in (8, 4, 2):
        q = quantize_log2(torch.rand(1000), bits=bits, block=128)
        assert q.codes.numel() == (1000 * bits + 7) // 8
        assert q.lo.numel() == q.hi.numel() == 8 and q.lo.dtype == torch.int32


def test_log2_rejects_bad_arguments() -> None:
    with pytest.raises(QuantizationError, match="float32"):
        quantize_log2(torch.ones(4, dtype=torch.int32))
    with pytest.raises(QuantizationError, match="bits"):
        quantize_log2(torch.ones(4), bits=3)
    with pytest.raises(QuantizationError, match="Log2Tensor"):
        dequantize_log2(torch.ones(4))  # type: ignore[arg-type]
    codec = get_codec("log2")
    with pytest.raises(QuantizationError, match="delta"):
        codec.resolve_params({"delta": True}, bits=4, block=128)


def _adam_state(steps: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 64)).square().mean().backward()
        opt.step()
    return model, opt


RULES = [("optimizer/state/*/exp_avg_sq", {"codec": "log2", "bits": 4, "min_numel": 0})]


def test_log2_in_a_training_state_round_trips_through_a_file(tmp_path) -> None:
    model, opt = _adam_state()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    q = tw_triton.quantize_state_dict(state, rules=RULES)
    coded = [p for p, e in q.entries.items() if e.codec == "log2"]
    assert coded and all(p.endswith("exp_avg_sq") for p in coded)
    tw_triton.save(q, tmp_path / "s.tw")
    back = tw_triton.load(tmp_path / "s.tw")
    for i, s in opt.state_dict()["state"].items():
        v, v_hat = s["exp_avg_sq"], back["optimizer"]["state"][i]["exp_avg_sq"]
        assert bool(((v == 0) == (v_hat == 0)).all()) and bool((v_hat >= 0).all())
        nz = v > 0
        assert float((v_hat[nz] / v[nz]).log2().abs().max()) < 1.5
        # The first moment and the step stay exact: only the rule's paths changed.
        assert torch.equal(s["exp_avg"], back["optimizer"]["state"][i]["exp_avg"])


def test_log2_tensor_with_a_negative_is_stored_exact_and_logged(caplog) -> None:
    model, opt = _adam_state()
    state = {"optimizer": opt.state_dict()}
    first = next(iter(state["optimizer"]["state"]))
    state["optimizer"]["state"][first]["exp_avg_sq"].view(-1)[3] = -1.0
    with caplog.at_level(logging.WARNING, logger="tw_triton.state"):
        q = tw_triton.quantize_state_dict(state, rules=RULES)
    path = f"optimizer/state/{first}/exp_avg_sq"
    assert q.entries[path].codec == "exact"
    assert any(path in r.getMessage() and "stored exact" in r.getMessage() for r in caplog.records)


def test_log2_decode_names_the_entry_on_malformed_buffers(tmp_path) -> None:
    model, opt = _adam_state()
    q = tw_triton.quantize_state_dict({"optimizer": opt.state_dict()}, rules=RULES)
    path, entry = next((p, e) for p, e in q.entries.items() if e.codec == "log2")
    entry.buffers["hi"] = entry.buffers["hi"][:-1]
    with pytest.raises(CheckpointError, match=r"exp_avg_sq.*hi are torch.int32 x"):
        tw_triton.dequantize_state_dict(q)
    entry.buffers.pop("hi")
    with pytest.raises(CheckpointError, match="expects a buffer 'hi'"):
        tw_triton.dequantize_state_dict(q)


def test_log2_tensor_is_a_frozen_record() -> None:
    q = quantize_log2(torch.rand(64), bits=8, block=32)
    assert isinstance(q, Log2Tensor) and q.numel == 64
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.bits = 4  # type: ignore[misc]


def test_log2_torch_path_writes_into_given_outputs_and_checks_them() -> None:
    x = torch.randn(5 * 128 + 9).square()
    want = quantize_log2_torch(x, 4, 128)
    # Garbage in the outputs must not leak into the result (lo and hi are not pre-zeroed).
    out = tuple(torch.full_like(t, 7) for t in want)
    got = quantize_log2_torch(x, 4, 128, out=out)
    assert got is out and all(torch.equal(a, b) for a, b in zip(got, want))
    dec = torch.full((x.numel(),), float("nan"))
    assert dequantize_log2_torch(*want, x.numel(), 4, 128, torch.float32, out=dec) is dec
    assert torch.equal(dec, dequantize_log2_torch(*want, x.numel(), 4, 128, torch.float32))
    with pytest.raises(QuantizationError, match="lo must be a contiguous"):
        quantize_log2_torch(x, 4, 128, out=(want[0], want[1][:-1], want[2]))
    with pytest.raises(QuantizationError, match="out must be a contiguous torch.bfloat16"):
        dequantize_log2_torch(*want, x.numel(), 4, 128, torch.bfloat16, out=dec)
