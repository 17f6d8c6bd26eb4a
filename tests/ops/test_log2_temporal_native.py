"""The compiled CPU codec of ``log2-temporal`` (``tw_triton/csrc/log2_temporal.c``) against
the torch spec: every byte of the encode and every bit of the decode equal, on moments that
barely move, zeros appearing and disappearing, ``-0``, subnormals, the largest finite value,
NaN, Inf and negatives in the tensor or in the reference, ragged last blocks, every width,
block size and step floor; corrupt codes; and the CPU op taking the C path when the library
is built and the torch path when it is off.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _native_builds import build_id, native_builds, use_build
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tw_triton import ops
from tw_triton.codecs import get_codec
from tw_triton.errors import CheckpointError
from tw_triton.ops.backends import cpu, native, native_temporal
from tw_triton.ops.reference import (
    dequantize_log2_temporal_torch,
    log2_temporal_code_errors_torch,
    quantize_log2_temporal_torch,
)
from tw_triton.ops.reference import log2_temporal as reference_log2_temporal
from tw_triton.ops.reference.log2_temporal import MIN_STEP

needs_native = pytest.mark.skipif(not native.enabled(), reason="compiled codec not built or turned off")
F32_MAX = torch.finfo(torch.float32).max


@pytest.fixture(params=native_builds() or [None], ids=build_id)
def build(request, monkeypatch):
    """Each build in turn (an AVX2 machine would otherwise only run the AVX2 one)."""
    use_build(request.param, monkeypatch, native_temporal)
    return request.param


def pair(gen: torch.Generator, n: int, kind: str, span: float, drift: float) -> tuple[torch.Tensor, ...]:
    """A moment ``x`` and its reference: squares over ``span`` octaves, moved by
    ``2**(drift * N(0, 1))``, with the specials of ``kind`` mixed into either."""
    g = torch.randn(n, generator=gen, dtype=torch.float64)
    ref64 = (g * torch.pow(2.0, span * torch.rand(n, generator=gen, dtype=torch.float64) - span / 2)) ** 2
    x64 = ref64 * torch.pow(2.0, drift * torch.randn(n, generator=gen, dtype=torch.float64))
    x, ref = x64.clamp(max=F32_MAX).float(), ref64.clamp(max=F32_MAX).float()
    if kind == "plain":
        return x, ref
    tiny = torch.finfo(torch.float32).tiny
    specials = {
        # zeros (and -0) in either; subnormals, the smallest and largest finite values
        "zeros": [0.0, -0.0, 1e-45, tiny / 4, tiny, F32_MAX],
        # uncodable in x, or not a positive finite reference
        "bad": [float("nan"), float("inf"), -float("inf"), -1.0, -1e-40, -0.0, 0.0, 1e-45, F32_MAX],
    }[kind]
    table = torch.tensor(specials, dtype=torch.float32)
    for t, rate in ((x, 0.01 if kind == "bad" else 0.03), (ref, 0.03)):
        pick = torch.rand(n, generator=gen) < rate
        t[pick] = table[torch.randint(0, len(specials), (int(pick.sum()),), generator=gen)]
    return x, ref


def assert_like_spec(x: torch.Tensor, ref: torch.Tensor, bits: int, block: int, min_step: int) -> None:
    """The CPU op's encode and decode (the C codec where it takes them) equal the spec's."""
    n = x.numel()
    got = cpu.quantize_log2_temporal_cpu(x, ref, bits, block, min_step)
    want = quantize_log2_temporal_torch(x, ref, bits, block, min_step)
    for name, a, b in zip(("codes", "lo", "hi"), got, want):
        assert torch.equal(a, b), f"{name} differ at {(a != b).nonzero()[:8].flatten().tolist()}"
    dec = cpu.dequantize_log2_temporal_cpu(*want, ref, n, bits, block, min_step)
    spec = dequantize_log2_temporal_torch(*want, ref, n, bits, block, min_step)
    assert torch.equal(dec.view(torch.int32), spec.view(torch.int32))
    # In place over the reference, as a delta load does.
    over = ref.clone()
    assert cpu.dequantize_log2_temporal_cpu(*want, over, n, bits, block, min_step, out=over) is over
    assert torch.equal(over.view(torch.int32), spec.view(torch.int32))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.one_of(st.sampled_from([1, 31, 32, 33, 4095, 4096, 4097]), st.integers(1, 9000)),
    bits=st.sampled_from((8, 4, 2)),
    block=st.sampled_from((32, 64, 128, 256, 1024, 4096)),
    kind=st.sampled_from(("plain", "zeros", "bad")),
    span=st.sampled_from((0.0, 4.0, 40.0, 200.0)),
    drift=st.sampled_from((0.0, 0.02, 1.0, 30.0)),
    min_step=st.sampled_from((1, 2, 3, 7, MIN_STEP, 1 << 29, 1 << 31)),
    seed=st.integers(0, 2**31 - 1),
)
def test_encode_and_decode_match_the_spec(build, n, bits, block, kind, span, drift, min_step, seed):
    x, ref = pair(torch.Generator().manual_seed(seed), n, kind, span, drift)
    assert_like_spec(x, ref, bits, block, min_step)


@pytest.mark.parametrize("min_step", (1, 2, 3, 4, 7, 1 << 31))
def test_every_remainder_and_the_edge_of_127_steps(build, min_step):
    """A constant reference (step = ``min_step``) and, block by block, every window of 32
    consecutive patterns from past -128 steps to past +128 steps of it: each remainder of
    the rounding, ties, and blocks that end right at |q| = 127 or start at 128."""
    edge = min(128 * min_step, 1 << 12) + 40
    base = torch.tensor([1.5]).view(torch.int32)
    start = torch.arange(-edge, edge - 31, dtype=torch.int32).unsqueeze(1)
    x = (base + start + torch.arange(32, dtype=torch.int32)).view(torch.float32).reshape(-1)
    for bits in (8, 4, 2):
        assert_like_spec(x, torch.full_like(x, 1.5), bits, 32, min_step)


def test_clamps_extremes_and_ragged_blocks(build):
    """Changes that decode past the largest finite value or below the smallest pattern,
    a jump far past 127 steps, zeros that appear or disappear, a partial last block."""
    top = 0x7F7FFFFF
    t = torch.tensor([5] * 32 + [top] * 32 + [1] * 32, dtype=torch.int32)
    r = torch.tensor([1000] * 32 + [top - 3600] * 32 + [top] * 32, dtype=torch.int32)
    assert_like_spec(t.view(torch.float32), r.view(torch.float32), 4, 32, 1000)
    info = torch.finfo(torch.float32)
    special = [0.0, -0.0, info.tiny, info.smallest_normal / 4, info.max, 1.0, 3.0]
    x = torch.tensor(special * 9 + [0.0] * 32 + [5.0] * 32 + special[:5])
    ref = torch.tensor(list(reversed(special)) * 9 + [5.0] * 32 + [0.0] * 32 + special[:5])
    for bits in (8, 4, 2):
        assert_like_spec(x, ref, bits, 32, MIN_STEP)
        assert_like_spec(x, ref, bits, 32, 1)


def _corrupt(bits: int, block: int) -> tuple[torch.Tensor, ...]:
    """Codes and bounds that no encoder writes (and the uncodable block's ``-1, -1``) among
    good blocks: each must decode as the spec decodes it."""
    gen = torch.Generator().manual_seed(bits)
    bounds = [
        (0, 0),  # temporal, random codes: over references that are not positive finite too
        (1 << 23, 1 << 30),  # absolute, codes above 2**bits - 1 where bits < 8
        (-1, -1),  # uncodable, codes not 0
        (5, 3),  # lo > hi
        (0x7F7FFF00, 0x7FC00000),  # hi a NaN pattern
        (-7, 1 << 20),  # lo negative
        (0, 1 << 24),  # lo 0, hi positive: an absolute block the encoder never writes
        (0, 0),
    ]
    n = block * len(bounds) - 3
    codes = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    lo = torch.tensor([a for a, _ in bounds], dtype=torch.int32)
    hi = torch.tensor([b for _, b in bounds], dtype=torch.int32)
    x, ref = pair(gen, n, "bad", 40.0, 0.1)
    return codes, lo, hi, ref


@pytest.mark.parametrize("bits", (8, 4, 2))
def test_corrupt_codes_decode_as_the_spec_decodes_them(build, bits):
    block = 64
    codes, lo, hi, ref = _corrupt(bits, block)
    n = codes.numel()
    got = cpu.dequantize_log2_temporal_cpu(codes, lo, hi, ref, n, bits, block, MIN_STEP)
    want = dequantize_log2_temporal_torch(codes, lo, hi, ref, n, bits, block, MIN_STEP)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@needs_native
def test_the_c_decode_leaves_what_it_cannot_vouch_for_to_torch():
    """It stops at the first block that is neither temporal nor absolute with sane bounds
    and codes, leaving it and the rest of its range unwritten."""
    block = 64
    codes, lo, hi, ref = _corrupt(8, block)
    out = torch.full((codes.numel(),), 7.0)
    left = native_temporal.decode_log2_temporal(codes, lo, hi, ref, codes.numel(), 8, block, MIN_STEP, out)
    assert left == [(2 * block, codes.numel())]  # 8 bits: block 1's codes are all in range
    assert (out[2 * block :] == 7.0).all() and not (out[: 2 * block] == 7.0).all()
    codes, lo, hi, ref = _corrupt(2, block)
    out = torch.full((codes.numel(),), 7.0)
    assert native_temporal.decode_log2_temporal(
        codes, lo, hi, ref, codes.numel(), 2, block, MIN_STEP, out
    ) == [(block, codes.numel())]


@needs_native
@pytest.mark.parametrize("threads", [2, 3])
def test_a_tensor_split_between_threads_gives_the_same_bytes(monkeypatch, threads):
    monkeypatch.setattr(native, "SPLIT_MIN_ELEMENTS", 1)
    block, bits = 128, 4
    x, ref = pair(torch.Generator().manual_seed(threads), 128 * 37 + 5, "zeros", 40.0, 0.05)
    codes, lo, hi, _ = _corrupt(bits, block)  # blocks left to torch inside a thread's range
    n = codes.numel()
    cref = pair(torch.Generator().manual_seed(9), n, "zeros", 40.0, 0.0)[1]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert len(native.block_ranges(x.numel(), block)) == threads
        got = cpu.quantize_log2_temporal_cpu(x, ref, bits, block, MIN_STEP)
        dec = cpu.dequantize_log2_temporal_cpu(*got, ref, x.numel(), bits, block, MIN_STEP)
        bad = cpu.dequantize_log2_temporal_cpu(codes, lo, hi, cref, n, bits, block, MIN_STEP)
    finally:
        torch.set_num_threads(before)
    want = quantize_log2_temporal_torch(x, ref, bits, block, MIN_STEP)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    spec = dequantize_log2_temporal_torch(*want, ref, x.numel(), bits, block, MIN_STEP)
    assert torch.equal(dec.view(torch.int32), spec.view(torch.int32))
    spec = dequantize_log2_temporal_torch(codes, lo, hi, cref, n, bits, block, MIN_STEP)
    assert torch.equal(bad.view(torch.int32), spec.view(torch.int32))


class _Spy:
    """The library with its calls recorded."""

    def __init__(self, lib):
        self.lib, self.calls = lib, []

    def __getattr__(self, name):
        fn = getattr(self.lib, name)

        def call(*args):
            self.calls.append(name)
            return fn(*args)

        return call


@pytest.fixture
def spies(monkeypatch):
    """``(library spy, torch-spec calls)`` around the CPU backend."""
    spy = _Spy(native.library()) if native.library() is not None else _Spy(None)
    monkeypatch.setattr(native_temporal, "library", lambda: spy)
    torch_calls = []
    for name in ("quantize_log2_temporal_torch", "dequantize_log2_temporal_torch"):
        fn = getattr(cpu, name)
        monkeypatch.setattr(
            cpu, name, lambda *a, _fn=fn, _n=name, **k: torch_calls.append(_n) or _fn(*a, **k)
        )
    return spy, torch_calls


def _round_trip() -> tuple[torch.Tensor, ...]:
    x, ref = pair(torch.Generator().manual_seed(1), 5000, "zeros", 40.0, 0.05)
    codec = get_codec("log2-temporal")
    params = codec.resolve_params({}, bits=4, block=128)
    enc = codec.encode(x, params, ref)
    back = codec.decode(enc.entry, ref, None, "f.tw.safetensors:exp_avg_sq")
    want = dequantize_log2_temporal_torch(*quantize_log2_temporal_torch(x, ref, 4, 128), ref, 5000, 4, 128)
    assert torch.equal(back.view(-1).view(torch.int32), want.view(torch.int32))
    return back


@needs_native
def test_the_cpu_op_and_the_codec_run_the_c_codec(spies):
    spy, torch_calls = spies
    assert ops.backends()[("quantize_log2_temporal", "cpu")].endswith("cpu.quantize_log2_temporal_cpu")
    assert ops.backends()[("dequantize_log2_temporal", "cpu")].endswith("cpu.dequantize_log2_temporal_cpu")
    _round_trip()
    assert spy.calls == ["tw_log2_temporal_encode", "tw_log2_temporal_check", "tw_log2_temporal_decode"]
    assert torch_calls == []


def test_turned_off_the_torch_spec_runs(spies, monkeypatch):
    spy, torch_calls = spies
    monkeypatch.setenv(native.ENV_NATIVE, "0")
    _round_trip()
    assert spy.calls == []
    assert torch_calls == ["quantize_log2_temporal_torch", "dequantize_log2_temporal_torch"]


def test_without_the_library_the_torch_spec_runs(spies, monkeypatch):
    """As on a machine without a C compiler: ``library()`` finds no build."""
    spy, torch_calls = spies
    monkeypatch.setattr(native, "library", lambda: None)
    _round_trip()
    assert spy.calls == []
    assert torch_calls == ["quantize_log2_temporal_torch", "dequantize_log2_temporal_torch"]


@needs_native
def test_inputs_it_does_not_take_go_to_the_spec(spies):
    """A strided tensor or reference, a bf16 reference, a step floor past 2**31, a
    wrong-size output: never handed to the C code, and still the spec's bytes."""
    spy, _ = spies
    x, ref = pair(torch.Generator().manual_seed(2), 64 * 40, "zeros", 40.0, 0.05)
    cases = [
        (x.view(64, 40).t(), ref.view(64, 40).t(), MIN_STEP),
        (x, torch.stack([ref, ref], 1)[:, 0], MIN_STEP),
        (x, ref.to(torch.bfloat16), MIN_STEP),
        (x, ref, (1 << 31) + 1),
    ]
    for a, r, step in cases:
        got = cpu.quantize_log2_temporal_cpu(a, r, 4, 64, step)
        want = quantize_log2_temporal_torch(a, r, 4, 64, step)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        dec = cpu.dequantize_log2_temporal_cpu(*want, r, a.numel(), 4, 64, step)
        assert torch.equal(dec, dequantize_log2_temporal_torch(*want, r, a.numel(), 4, 64, step))
    codes, lo, hi = (
        torch.empty(x.numel(), dtype=torch.uint8),
        torch.empty(40, dtype=torch.int32),
        torch.empty(40),
    )
    assert not native_temporal.encode_log2_temporal(x, ref, 4, 64, MIN_STEP, codes, lo, hi.int()[:39])
    assert not native_temporal.encode_log2_temporal(x, ref, 4, 64, MIN_STEP, codes[:-1], lo, hi.int())
    assert spy.calls == []


@pytest.mark.parametrize("compiled", (True, False))
def test_the_codec_reports_uncodable_and_corrupt_the_same(monkeypatch, compiled):
    """An uncodable tensor is flagged for exact storage, and corrupt codes raise the same
    CheckpointError naming the block or element, with the C codec or without it."""
    if compiled and not native.enabled():
        pytest.skip("compiled codec not built")
    monkeypatch.setenv(native.ENV_NATIVE, "1" if compiled else "0")
    codec = get_codec("log2-temporal")
    params = codec.resolve_params({}, bits=4, block=32)
    x, ref = pair(torch.Generator().manual_seed(3), 32 * 6, "plain", 4.0, 0.01)
    x[70] = float("nan")
    assert bool(codec.encode(x, params, ref).unusable)
    x[70] = 1.0
    enc = codec.encode(x, params, ref)
    assert not bool(enc.unusable)
    stored = enc.entry.buffers["codes"]
    words = stored[: 8 * 6].view(torch.int32)
    assert words[1] == 0 and words[7] == 0  # block 1 is temporal
    ref[41] = float("nan")
    stored[8 * 6 + 41] = 3  # a temporal code over a NaN reference
    with pytest.raises(CheckpointError, match="f: corrupt log2-temporal codes: element 41 has code 3,"):
        codec.decode(enc.entry, ref, None, "f")
    words[1], words[7] = 3, 2
    with pytest.raises(
        CheckpointError, match="f: corrupt log2-temporal codes: block 1 has bounds lo=3, hi=2"
    ):
        codec.decode(enc.entry, ref, None, "f")


def _checked_cases(bits: int, block: int) -> list[tuple[str, tuple[torch.Tensor, ...]]]:
    """Encoder output, and one corruption of each kind the check refuses."""
    x, ref = pair(torch.Generator().manual_seed(bits), block * 9 + 5, "plain", 8.0, 0.01)
    ref[3 * block + 2] = 0.0  # a positive over a zero reference: block 3 goes absolute
    codes, lo, hi = quantize_log2_temporal_torch(x, ref, bits, block, MIN_STEP)
    assert lo[0] == 0 and lo[3] >= 1
    cases = [("encoded", (codes, lo, hi, ref))]

    def case(name: str, **change: Any) -> None:
        c, lo2, hi2, r = (t.clone() for t in (codes, lo, hi, ref))
        for what, (i, v) in change.items():
            {"codes": c, "lo": lo2, "hi": hi2, "ref": r}[what][i] = v
        cases.append((name, (c, lo2, hi2, r)))

    case("temporal code over a zero reference", ref=(block + 7, 0.0), codes=(block + 7, 1))
    case("temporal code over a NaN reference", ref=(5 * block, float("nan")), codes=(5 * block, 0))
    if bits < 8:  # (at 8 bits every byte is a code)
        case("absolute code past 2**bits - 1", codes=(3 * block + 1, 1 << bits))
    case("uncodable block with a code", lo=(4, -1), hi=(4, -1), codes=(4 * block + 3, 1))
    case("lo = 0 in an absolute block", lo=(6, 0), hi=(6, 9))
    case("lo > hi", lo=(2, 9), hi=(2, 3))
    case("hi at +inf", lo=(9, 1), hi=(9, 0x7F800000))
    case("last ragged block", ref=(9 * block + 4, -1.0), codes=(9 * block + 4, 2))
    return cases


@pytest.mark.parametrize("bits", (8, 4, 2))
@pytest.mark.parametrize("threads", (1, 3))
def test_the_c_check_refuses_what_the_spec_refuses(build, monkeypatch, bits, threads):
    """The compiled check before a decode (it writes nothing) passes the encoder's output
    and refuses each corruption the torch check names; the CPU op then gives the spec's
    message. Split between threads, a corruption in any range is found."""
    monkeypatch.setattr(native, "SPLIT_MIN_ELEMENTS", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    block = 64
    for name, (codes, lo, hi, ref) in _checked_cases(bits, block):
        want = log2_temporal_code_errors_torch(codes, lo, hi, ref, bits, block)
        assert (want is None) == (name == "encoded"), name
        assert native_temporal.check_log2_temporal(codes, lo, hi, ref, bits, block) == (want is None), name
        assert cpu.log2_temporal_code_errors_cpu(codes, lo, hi, ref, bits, block) == want, name


@pytest.mark.parametrize("chunk", (64, 128, 1 << 19))
def test_the_spec_check_names_the_same_culprit_in_chunks(monkeypatch, chunk):
    """The torch check works chunk by chunk (bounded temporaries) and names the first bad
    element wherever the chunks split."""
    monkeypatch.setattr(reference_log2_temporal, "CHUNK_ELEMENTS", chunk)
    for name, (codes, lo, hi, ref) in _checked_cases(4, 64):
        got = log2_temporal_code_errors_torch(codes, lo, hi, ref, 4, 64)
        if name == "encoded":
            assert got is None
        else:
            assert got is not None and (got.startswith("element ") or got.startswith("block ")), name
    codes, lo, hi, ref = _checked_cases(4, 64)[1][1]
    assert log2_temporal_code_errors_torch(codes, lo, hi, ref, 4, 64) == (
        f"element {64 + 7} has code 1, which no encoder writes there"
    )
