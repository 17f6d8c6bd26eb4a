"""The fast CPU torch path of the blockwise codec: writing into given outputs, per-thread
scratch buffers reused across calls and threads, and its word-at-a-time packing.

The bytes themselves are checked against the numpy spec (``_codec_oracle``) here and, for
the kernels, in ``test_quantize_blockwise.py`` / ``test_dequantize_blockwise.py``.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest
import torch
from _codec_oracle import spec_decode_f32, spec_encode, to_f32
from hypothesis import given, settings
from hypothesis import strategies as st

from tw_triton import QuantizationError
from tw_triton.codecs import blockwise as codec
from tw_triton.ops.reference import pack_codes, scratch, scratch_buffers, signed_codes


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view({torch.float32: torch.int32}.get(t.dtype, torch.int16)).numpy()


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 700),
    bits=st.sampled_from((8, 4, 2)),
    block=st.sampled_from((32, 64, 128)),
    dtype=st.sampled_from((torch.float32, torch.bfloat16, torch.float16)),
    with_ref=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
    chunk_blocks=st.integers(1, 5),
)
def test_encode_decode_into_given_outputs_match_the_spec(n, bits, block, dtype, with_ref, seed, chunk_blocks):
    with _chunk(chunk_blocks * block):  # several chunks, a partial last one
        _check_into_outputs(n, bits, block, dtype, with_ref, seed)


def _check_into_outputs(n, bits, block, dtype, with_ref, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g) * 3).to(dtype)
    ref = (x.float() + torch.randn(n, generator=g) * 0.1).to(dtype) if with_ref else None
    # Outputs filled with garbage: every byte must be written.
    codes = torch.full((codec.packed_nbytes(n, bits),), 0xA5, dtype=torch.uint8)
    scales = torch.full((codec.num_blocks(n, block),), float("nan"))
    got = codec.quantize_blockwise_torch(x, ref, bits, block, out=(codes, scales))
    assert got[0] is codes and got[1] is scales
    want_codes, want_scales = spec_encode(to_f32(x), to_f32(ref), bits, block)
    assert np.array_equal(codes.numpy(), want_codes)
    assert np.array_equal(scales.numpy().view(np.int32), want_scales.view(np.int32))

    out = torch.full((n,), float("nan"), dtype=torch.float32)
    res = codec.dequantize_blockwise_torch(codes, scales, n, bits, block, ref, torch.float32, out=out)
    assert res is out
    want = spec_decode_f32(want_codes, want_scales, n, bits, block, to_f32(ref))
    assert np.array_equal(out.numpy().view(np.int32), want.view(np.int32))
    # Into the original dtype too: the same bits as the allocating call.
    out2 = torch.empty(n, dtype=dtype)
    codec.dequantize_blockwise_torch(codes, scales, n, bits, block, ref, dtype, out=out2)
    alloc = codec.dequantize_blockwise_torch(codes, scales, n, bits, block, ref, dtype)
    assert np.array_equal(_bits(out2), _bits(alloc))


@contextlib.contextmanager
def _chunk(n: int):
    """``CHUNK_ELEMENTS = n`` inside the block (one hypothesis example at a time)."""
    old = codec.CHUNK_ELEMENTS
    codec.CHUNK_ELEMENTS = n
    try:
        yield
    finally:
        codec.CHUNK_ELEMENTS = old


@pytest.mark.parametrize(
    "bad, what",
    [
        (lambda n: torch.empty(n, dtype=torch.bfloat16), "torch.bfloat16"),
        (lambda n: torch.empty(n + 1), f"x {129}"),
        (lambda n: torch.empty(2 * n)[::2], "not contiguous"),
    ],
)
def test_decode_rejects_a_wrong_output(bad, what):
    x = torch.randn(128)
    codes, scales = codec.quantize_blockwise_torch(x, None, 8, 32)
    with pytest.raises(QuantizationError, match="out must be a contiguous torch.float32") as e:
        codec.dequantize_blockwise_torch(codes, scales, 128, 8, 32, None, torch.float32, out=bad(128))
    assert what in str(e.value)


def test_encode_rejects_wrong_outputs():
    x = torch.randn(100)
    good_codes = torch.empty(50, dtype=torch.uint8)
    good_scales = torch.empty(4)
    with pytest.raises(
        QuantizationError, match="codes must be a contiguous torch.uint8 tensor of 50 elements"
    ):
        codec.quantize_blockwise_torch(x, None, 4, 32, out=(torch.empty(51, dtype=torch.uint8), good_scales))
    with pytest.raises(
        QuantizationError, match="scales must be a contiguous torch.float32 tensor of 4 elements"
    ):
        codec.quantize_blockwise_torch(x, None, 4, 32, out=(good_codes, torch.empty(4, dtype=torch.float64)))


def test_negative_zero_blocks_get_a_positive_zero_scale():
    # max(amax, -amin) of a block of -0.0 is -0.0 or +0.0 depending on the operand order;
    # the kernel's max |d| is +0.0, and the stored bytes must be the same.
    x = torch.full((64,), -0.0)
    x[32:] = torch.randn(32)
    for bits in (8, 4, 2):
        _, scales = codec.quantize_blockwise_torch(x, None, bits, 32)
        assert scales[0].view(torch.int32).item() == 0
        _, scales = codec.quantize_blockwise_torch(x, x.clone(), bits, 32)  # d = -0 - -0 = +0
        assert scales.view(torch.int32).eq(0).all()


def test_threads_encoding_at_once_get_their_own_scratch():
    # Each thread has its own scratch buffers: concurrent calls must not see each other's.
    codec.release_scratch()
    g = torch.Generator().manual_seed(3)
    inputs = [(torch.randn(5000, generator=g) * (i + 1)).to(torch.bfloat16) for i in range(4)]
    refs = [(t.float() * 0.9).to(torch.bfloat16) for t in inputs]
    expected = [codec.quantize_blockwise_torch(x, r, 4, 64) for x, r in zip(inputs, refs)]
    decoded = [
        codec.dequantize_blockwise_torch(c, s, 5000, 4, 64, r, torch.bfloat16)
        for (c, s), r in zip(expected, refs)
    ]
    errors: list[str] = []
    barrier = threading.Barrier(len(inputs))

    def work(i: int) -> None:
        barrier.wait()
        for _ in range(20):
            c, s = codec.quantize_blockwise_torch(inputs[i], refs[i], 4, 64)
            d = codec.dequantize_blockwise_torch(c, s, 5000, 4, 64, refs[i], torch.bfloat16)
            if not (
                torch.equal(c, expected[i][0])
                and torch.equal(s, expected[i][1])
                and torch.equal(_bits_t(d), _bits_t(decoded[i]))
            ):
                errors.append(f"thread {i} got other bytes")
                return

    with _chunk(1024):  # several chunks per call, so the threads interleave
        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []


def _bits_t(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def test_scratch_is_reused_between_calls_and_released_on_request():
    codec.release_scratch()
    x = torch.randn(4096)
    codec.quantize_blockwise_torch(x, None, 8, 128)
    a = scratch("a", 16, torch.float32, x.device)
    codec.quantize_blockwise_torch(x, None, 8, 128)
    assert scratch("a", 16, torch.float32, x.device).data_ptr() == a.data_ptr()
    codec.release_scratch()
    assert scratch_buffers() == {}


@pytest.mark.parametrize("bits", (4, 2))
def test_word_packing_is_lsb_first(bits):
    k = 8 // bits
    g = torch.Generator().manual_seed(bits)
    u = torch.randint(0, 1 << bits, (256,), generator=g, dtype=torch.uint8)
    out = torch.empty(256 // k, dtype=torch.uint8)
    words = torch.empty(256, dtype=torch.uint8)
    pack_codes(u.clone(), bits, out, words)
    want = sum(u.view(-1, k)[:, j].int() << (j * bits) for j in range(k)).to(torch.uint8)
    assert torch.equal(out, want)
    # and the unpacking gives back u - 2**(bits-1), sign-extended
    x, w, t, e = (torch.empty(256, dtype=torch.uint8) for _ in range(4))
    q = signed_codes(out, bits, x, w, t, e)
    assert torch.equal(q.to(torch.int16), u.to(torch.int16) - (1 << (bits - 1)))


def test_the_2_bit_lookup_gives_every_byte_the_codes_of_the_word_ops():
    every = torch.arange(256, dtype=torch.uint8)
    x, w, t, e = (torch.empty(1024, dtype=torch.uint8) for _ in range(4))
    by_ops = signed_codes(every, 2, x, w, t, e).clone()
    want = torch.stack([((every.int() >> (2 * j)) & 3) - 2 for j in range(4)], 1).reshape(-1)
    assert torch.equal(by_ops.to(torch.int32), want)
    by_table = signed_codes(every, 2, x, w, t, None, codec.crumb_table(torch.device("cpu")))
    assert torch.equal(by_table, by_ops)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("bits", (8, 4, 2))
def test_decode_in_place_into_its_own_reference(dtype, bits):
    n = 3 * 1024 + 77
    g = torch.Generator().manual_seed(bits)
    ref = torch.randn(n, generator=g).to(dtype)
    x = (ref.float() + torch.randn(n, generator=g) * 0.01).to(dtype)
    with _chunk(1024):
        codes, scales = codec.quantize_blockwise_torch(x, ref, bits, 64)
        want = codec.dequantize_blockwise_torch(codes, scales, n, bits, 64, ref, dtype)
        buf = ref.clone()
        got = codec.dequantize_blockwise_torch(codes, scales, n, bits, 64, buf, dtype, out=buf)
    assert got is buf
    assert torch.equal(
        _bits_t(got) if dtype != torch.float32 else got.view(torch.int32),
        _bits_t(want) if dtype != torch.float32 else want.view(torch.int32),
    )
