"""The compiled CPU codec (``tw_triton.ops.backends.native``) against the plain-torch reference.

The torch functions are the spec of the CPU path; the C ones must give the same bytes on
encode and the same bits on decode, on every dtype, width, qmax, block and special value
(zeros, negative zeros, subnormals, huge values, NaN and Inf, and quotients that land on
half-integers). Exact equality everywhere: no tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _codec_oracle import near_tie_blocks
from _native_builds import build_id, native_builds, use_build
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tw_triton import TwTritonError
from tw_triton.codecs import blockwise as bw
from tw_triton.codecs import log2 as lg
from tw_triton.ops.backends import native

needs_native = pytest.mark.skipif(not native.enabled(), reason="compiled codec not built or turned off")

_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_VIEW[t.dtype])


@pytest.fixture(params=native_builds() or [None], ids=build_id)
def build(request, monkeypatch):
    """Each build in turn (on an AVX2 machine ``enabled()`` alone would only ever run the
    AVX2 one): both must give the spec's bytes."""
    use_build(request.param, monkeypatch, native)
    return request.param


def test_the_compiled_codec_is_built_and_on():
    """CI installs with a C compiler: a silently failed build would leave every test below
    skipped and the CPU path slow. ``TW_TRITON_NATIVE=0`` is the one way to run without."""
    assert native.enabled()
    builds = native_builds()
    assert builds and builds[0].rsplit("/", 1)[-1].startswith("_native.")
    if native.library().tw_cpu_has_avx2():
        assert any("_native_avx2." in b for b in builds), "an AVX2 CPU but no AVX2 build"
        assert native.library()._name.endswith(builds[-1].rsplit("/", 1)[-1])


def test_the_switch_turns_it_off_and_rejects_other_values(monkeypatch):
    monkeypatch.setenv(native.ENV_NATIVE, "0")
    assert not native.enabled()
    codes, scales = torch.empty(128, dtype=torch.uint8), torch.empty(1)
    assert not native.encode_blockwise(torch.ones(128), None, 8, 128, 127, codes, scales)
    monkeypatch.setenv(native.ENV_NATIVE, "yes")
    with pytest.raises(TwTritonError, match="TW_TRITON_NATIVE must be 0 or 1, found 'yes'"):
        native.enabled()


def _values(
    kind: str, n: int, dtype: torch.dtype, g: torch.Generator, bits: int, block: int, qmax: int
) -> torch.Tensor:
    """Test inputs of a kind: typical, wide-ranging with special values, or built on ties."""
    if kind == "normal":
        return (torch.randn(n, generator=g) * 3).to(dtype)
    if kind == "ties":
        rng = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=g)))
        d = near_tie_blocks(rng, -(-n // block), block, bits, -140.0, 100.0, qmax=qmax)[:n]
        return torch.from_numpy(d.copy()).to(dtype)
    # Magnitudes over 2**-140 .. 2**120, with zeros, -0, NaN, +-Inf sprinkled in.
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-140, 120, (n,), generator=g).float())
    pick = torch.randint(0, 40, (n,), generator=g)
    specials = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-45, 3.4e38])
    x = torch.where(pick < len(specials), specials[pick.clamp(max=len(specials) - 1)], x)
    return x.to(dtype)


CASES = dict(
    n=st.integers(1, 5000),
    bits=st.sampled_from((8, 4, 2)),
    block=st.sampled_from((32, 128, 1024, 4096)),
    dtype=st.sampled_from((torch.float32, torch.bfloat16)),
    ref_dtype=st.sampled_from((None, torch.float32, torch.bfloat16)),
    kind=st.sampled_from(("normal", "wide", "ties")),
    narrow=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**CASES)
def test_blockwise_encode_and_decode_match_the_torch_path(
    build, n, bits, block, dtype, ref_dtype, kind, narrow, seed
):
    g = torch.Generator().manual_seed(seed)
    qmax = bw.check_qmax(bits, {8: 100, 4: 3, 2: 1}[bits] if narrow else None)
    x = _values(kind, n, dtype, g, bits, block, qmax)
    ref = None
    if ref_dtype is not None:
        ref = (x.float() + torch.randn(n, generator=g) * 0.01).to(ref_dtype)
        if kind == "wide":
            ref[::7] = float("nan")  # NaN deltas: infinite scales; NaN results on decode
    codes, scales = bw.quantize_blockwise_cpu(x, ref, bits, block, qmax=qmax)
    want_codes, want_scales = bw.quantize_blockwise_torch(x, ref, bits, block, qmax=qmax)
    assert torch.equal(codes, want_codes)
    assert torch.equal(_bits(scales), _bits(want_scales))
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = bw.dequantize_blockwise_cpu(codes, scales, n, bits, block, ref, out_dtype)
        want = bw.dequantize_blockwise_torch(codes, scales, n, bits, block, ref, out_dtype)
        assert torch.equal(_bits(got), _bits(want)), out_dtype
    if ref is not None:
        # In place over the reference, as a delta load does.
        want = bw.dequantize_blockwise_torch(codes, scales, n, bits, block, ref, ref.dtype)
        over = ref.clone()
        assert bw.dequantize_blockwise_cpu(codes, scales, n, bits, block, over, ref.dtype, out=over) is over
        assert torch.equal(_bits(over), _bits(want))


@needs_native
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_tensor_split_between_threads_gives_the_same_bytes(monkeypatch, threads):
    monkeypatch.setattr(native, "SPLIT_MIN_ELEMENTS", 1)
    n, block = 128 * 37 + 5, 128
    x = torch.randn(n) * torch.linspace(0.1, 100, n)
    ref = x.to(torch.bfloat16)
    x[1000:1010] = float("inf")  # a block whose decode leaves NaN: finished by torch
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert native.block_ranges(n, block)[-1][1] == n
        assert len(native.block_ranges(n, block)) == threads
        codes, scales = bw.quantize_blockwise_cpu(x, ref, 4, block)
        got = bw.dequantize_blockwise_cpu(codes, scales, n, 4, block, ref, torch.float32)
    finally:
        torch.set_num_threads(before)
    want_codes, want_scales = bw.quantize_blockwise_torch(x, ref, 4, block)
    assert torch.equal(codes, want_codes) and torch.equal(_bits(scales), _bits(want_scales))
    want = bw.dequantize_blockwise_torch(codes, scales, n, 4, block, ref, torch.float32)
    assert torch.equal(_bits(got), _bits(want))
    assert got[1000:1010].isnan().all()


@needs_native
def test_a_nan_result_leaves_the_rest_to_the_torch_path():
    """The C decode stops at the first block whose result holds a NaN and reports where;
    the blocks before it are its own, the rest the torch path's."""
    n, block = 128 * 4, 128
    scales = torch.tensor([1.0, 2.0, float("inf"), 0.5])
    codes = torch.full((n,), 128, dtype=torch.uint8)  # q = 0: 0 * inf is NaN in block 2
    out = torch.full((n,), 7.0)
    left = native.decode_blockwise(codes, scales, n, 8, block, None, out)
    assert left == [(256, n)]
    assert (out[:256] == 0).all() and (out[256:] == 7.0).all()  # unwritten from block 2 on


def test_inputs_it_does_not_take_go_to_the_torch_path():
    codes, scales = torch.empty(256, dtype=torch.uint8), torch.empty(2)
    for x in (torch.ones(256, dtype=torch.float16), torch.ones(512)[::2], torch.ones(16, 16).t()):
        assert not native.encode_blockwise(x, None, 8, 128, 127, codes, scales)
    # A wrong-size output is never handed to C code, which would write past it.
    assert not native.encode_blockwise(torch.ones(256), None, 8, 128, 127, codes[:255], scales)
    assert (
        native.decode_blockwise(codes, scales, 256, 8, 128, None, torch.empty(256, dtype=torch.float16))
        is None
    )
    assert native.decode_blockwise(codes[:200], scales, 256, 8, 128, None, torch.empty(256)) is None
    # ... and the public functions still give the torch path's bytes for them.
    x = torch.randn(64, 48).t()
    assert torch.equal(
        bw.quantize_blockwise_cpu(x, None, 8, 32)[0], bw.quantize_blockwise_torch(x, None, 8, 32)[0]
    )


def _second_moment(kind: str, n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Non-negative inputs over many octaves; with zeros and -0 mixed in, or with an
    uncodable element (negative, NaN, Inf) in some blocks."""
    x = torch.randn(n, generator=g) ** 2 * torch.exp2(torch.randint(-120, 100, (n,), generator=g).float())
    if kind != "positive":
        pick = torch.randint(0, 10, (n,), generator=g)
        x = torch.where(pick == 0, 0.0, torch.where(pick == 1, -0.0, x))
    if kind == "uncodable":
        pick = torch.randint(0, 500, (n,), generator=g)
        specials = torch.tensor([float("nan"), float("inf"), -1.0, 1e-45])
        x = torch.where(pick < 4, specials[pick.clamp(max=3)], x)
    return x.to(dtype)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(1, 5000),
    bits=st.sampled_from((8, 4, 2)),
    block=st.sampled_from((32, 128, 1024, 4096)),
    dtype=st.sampled_from((torch.float32, torch.bfloat16)),
    kind=st.sampled_from(("positive", "zeros", "uncodable")),
    seed=st.integers(0, 2**31 - 1),
)
def test_log2_encode_and_decode_match_the_torch_path(build, n, bits, block, dtype, kind, seed):
    x = _second_moment(kind, n, dtype, torch.Generator().manual_seed(seed))
    got = lg.quantize_log2_cpu(x, bits, block)
    want = lg.quantize_log2_torch(x, bits, block)
    for a, b, name in zip(got, want, ("codes", "lo", "hi")):
        assert torch.equal(a, b), name
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        dec = lg.dequantize_log2_cpu(*want, n, bits, block, out_dtype)
        ref = lg.dequantize_log2_torch(*want, n, bits, block, out_dtype)
        assert torch.equal(_bits(dec), _bits(ref)), out_dtype


@needs_native
def test_log2_bounds_the_encoder_cannot_write_are_left_to_the_torch_path():
    """Bounds outside ``0 <= lo <= hi < bits(+inf)`` (a crafted file, or the -1 of an
    uncodable block) stop the C decode at that block; the torch path decodes the rest as
    the spec says, NaN patterns included."""
    n, block = 128 * 3, 128
    codes = torch.randint(0, 256, (n,), dtype=torch.uint8)
    lo = torch.tensor([1 << 23, -1, 0x7F7FFF00], dtype=torch.int32)
    hi = torch.tensor([1 << 30, -1, 0x7FC00000], dtype=torch.int32)
    out = torch.full((n,), 7.0)
    assert native.decode_log2(codes, lo, hi, n, 8, block, out) == [(128, n)]
    assert (out[128:] == 7.0).all()
    for dtype in (torch.float32, torch.bfloat16):
        got = lg.dequantize_log2_cpu(codes, lo, hi, n, 8, block, dtype)
        assert torch.equal(_bits(got), _bits(lg.dequantize_log2_torch(codes, lo, hi, n, 8, block, dtype)))


@needs_native
def test_log2_split_between_threads_gives_the_same_bytes(monkeypatch):
    monkeypatch.setattr(native, "SPLIT_MIN_ELEMENTS", 1)
    n, block = 256 * 41 + 3, 256
    x = _second_moment("zeros", n, torch.float32, torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = lg.quantize_log2_cpu(x, 4, block)
        dec = lg.dequantize_log2_cpu(*got, n, 4, block, torch.float32)
    finally:
        torch.set_num_threads(before)
    want = lg.quantize_log2_torch(x, 4, block)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(_bits(dec), _bits(lg.dequantize_log2_torch(*want, n, 4, block, torch.float32)))


# Byte planes (the entropy stage's merge): pure data movement, against numpy slicing.


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    width=st.sampled_from([1, 2, 3, 4, 5, 8, 16]), count=st.integers(1, 5000), seed=st.integers(0, 2**31 - 1)
)
def test_merge_planes_matches_numpy(build, width, count, seed):
    data = np.random.default_rng(seed).integers(0, 256, count * width, dtype=np.uint8)
    planes = [np.ascontiguousarray(data[k::width]) for k in range(width)]
    out = np.full(count * width + 3, 0xEE, dtype=np.uint8)
    assert native.merge_planes(planes, out[:-3])
    np.testing.assert_array_equal(out[:-3], data)
    assert (out[-3:] == 0xEE).all()


@needs_native
def test_planes_it_does_not_take_are_refused_untouched():
    z = lambda n=4, dtype=np.uint8: np.zeros(n, dtype=dtype)  # noqa: E731
    bad_planes = [
        [z(), z(5), z()],  # sizes differ
        [z(), z(8)[::2], z()],  # strided
        [z(dtype=np.int16)] * 3,  # not bytes
        [],  # no planes
    ]
    out = z(12)
    for planes in bad_planes:
        assert not native.merge_planes(planes, out)
    good = [np.ones(4, dtype=np.uint8)] * 3
    assert not native.merge_planes(good, z(11))  # not whole elements
    assert not out.any()
    frozen = z(12)
    frozen.flags.writeable = False
    assert not native.merge_planes(good, frozen)
    assert not frozen.any()
