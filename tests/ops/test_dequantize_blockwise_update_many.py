"""``dequantize_blockwise_update_many`` (the blockwise-update decode of many tensors per
launch, a load's entries coded with a partner) against the codec's per-tensor path, tensor
by tensor.

Each tensor's ``m_hat = u_hat * (sqrt(v_hat) + eps)`` must be the bits of
``BlockwiseUpdateCodec.decode_with_partner`` (the blockwise decode to fp32, then the
correctly rounded denominator and product in torch, saturated and cast), for every output
dtype, whole tiles and tails, and adversarial inputs: codes and scales no encoder wrote
(huge, subnormal, zero, infinite and NaN scales), partners with zeros, subnormals, huge,
infinite, negative and NaN values. Without a GPU the kernel runs under
``TRITON_INTERPRET=1`` on CPU tensors (the Triton backend's function called directly).
"""

from __future__ import annotations

import math

import pytest
import torch
from _kernel_testing import (
    KERNEL_DEVICE,
    assert_same_bits,
    max_examples,
    on_kernel_device,
    random_floats,
    require_runnable_kernels,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tw_triton import ops
from tw_triton.codecs import get_codec
from tw_triton.errors import CheckpointError
from tw_triton.ops.backends.triton import dequantize_blockwise_update_many_cuda
from tw_triton.qstate import EncodedEntry

require_runnable_kernels()
CODEC = get_codec("blockwise-update")
# Whole tiles only (block 128), a tail only, both, one element, one block.
SIZES = (4096, 5000, 33, 1, 128, 4096 * 2 + 7)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def stored(gen: torch.Generator, n: int, bits: int, block: int, wild: bool):
    """Random packed codes and block scales of ``n`` elements: Adam-like scales, or
    (``wild``) scales over the whole fp32 range with zeros, subnormals, Inf and NaN."""
    codes = torch.randint(0, 256, ((n * bits + 7) // 8,), generator=gen, dtype=torch.uint8)
    nb = -(-n // block)
    if not wild:
        return codes, random_floats(gen, nb, torch.float64, -8, -2).abs().float()
    scales = random_floats(gen, nb, torch.float64, -44, 38).abs().float()
    pick = torch.rand(nb, generator=gen)
    scales[pick < 0.1] = 0.0
    scales[(pick >= 0.1) & (pick < 0.15)] = 1e-45
    scales[(pick >= 0.15) & (pick < 0.2)] = 3e38
    scales[(pick >= 0.2) & (pick < 0.23)] = float("inf")
    scales[(pick >= 0.23) & (pick < 0.25)] = float("nan")
    return codes, scales


def partner(gen: torch.Generator, n: int, wild: bool) -> torch.Tensor:
    """A second moment: positive over many octaves, with zeros, subnormals and huge values;
    (``wild``) also infinite, negative and NaN ones, which no encoder divides by."""
    v = random_floats(gen, n, torch.float64, -30, 2).square()
    pick = torch.rand(n, generator=gen, dtype=torch.float64)
    v = torch.where(pick < 0.05, torch.zeros_like(v), v)
    v = torch.where((pick >= 0.05) & (pick < 0.08), torch.full_like(v, 1e-44), v)
    v = torch.where((pick >= 0.08) & (pick < 0.1), torch.full_like(v, 3e38), v)
    if wild:
        v = torch.where((pick >= 0.1) & (pick < 0.11), torch.full_like(v, float("inf")), v)
        v = torch.where((pick >= 0.11) & (pick < 0.12), -v, v)
        v = torch.where((pick >= 0.12) & (pick < 0.13), torch.full_like(v, float("nan")), v)
    return v.float()


def entry_of(codes, scales, shape, dtype, bits, block, eps) -> EncodedEntry:
    params = {"bits": bits, "block": block, "packing": "lsb-first", "eps": eps, "partner": "v"}
    return EncodedEntry("blockwise-update", params, tuple(shape), dtype, {"codes": codes, "scales": scales})


def group(sizes, bits, block, dtype, eps, seed, wild=False):
    """Entries and partners of ``sizes``, and what the codec decodes each to alone."""
    gen = torch.Generator().manual_seed(seed)
    entries, vs, want = [], [], []
    for n in sizes:
        codes, scales = stored(gen, n, bits, block, wild)
        entries.append(entry_of(codes, scales, (n,), dtype, bits, block, eps))
        vs.append(partner(gen, n, wild))
        want.append(CODEC.decode_with_partner(entries[-1], vs[-1], None, f"tensor {len(want)}"))
    return entries, vs, want


def decode_on_device(entries, vs, bits, block, dtype, eps):
    return dequantize_blockwise_update_many_cuda(
        [on_kernel_device(e.buffers["codes"]) for e in entries],
        [on_kernel_device(e.buffers["scales"]) for e in entries],
        [math.prod(e.shape) for e in entries],
        [on_kernel_device(v) for v in vs],
        eps,
        bits,
        block,
        dtype,
    )


def assert_same(got, want, dtype) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == dtype, i
        assert_same_bits(g.reshape(-1), w.reshape(-1), f"tensor {i}")


@pytest.mark.parametrize("wild", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,block", [(4, 128), (8, 32), (2, 4096)])
def test_a_group_decodes_each_tensor_to_the_codecs_per_tensor_bits(bits, block, dtype, wild) -> None:
    entries, vs, want = group(SIZES, bits, block, dtype, 1e-8, seed=bits + block, wild=wild)
    got = decode_on_device(entries, vs, bits, block, dtype, 1e-8)
    assert_same(got, want, dtype)


def test_saturation_zeros_and_subnormals_where_the_codec_gives_them() -> None:
    """A product past the output's range saturates (never Inf from finite inputs), a zero
    partner multiplies by ``eps`` alone, a subnormal partner's root is normal."""
    n, block = 256, 128
    codes = torch.full((n // 2,), 0xFF, dtype=torch.uint8)  # code 15 everywhere: +7 steps at 4 bits
    scales = torch.tensor([3e38, 1e-3])
    v = torch.cat([torch.full((128,), 3e38), torch.tensor([0.0, 1e-45, 1e-44, 3e38]).repeat(32)])
    for dtype in DTYPES:
        entry = entry_of(codes, scales, (n,), dtype, 4, block, 1e-8)
        want = CODEC.decode_with_partner(entry, v, None, "t")
        assert bool(torch.isfinite(want).all()) and float(want[0]) == torch.finfo(dtype).max
        got = decode_on_device([entry], [v], 4, block, dtype, 1e-8)
        assert_same(got, [want], dtype)


@settings(max_examples=max_examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(1, 9000), min_size=1, max_size=3),
    bits=st.sampled_from([8, 4, 2]),
    block=st.sampled_from([32, 128, 4096]),
    dtype=st.sampled_from(DTYPES),
    eps=st.sampled_from([1e-8, 1e-6, 0.1, 3e-39]),
    wild=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_any_group_decodes_like_the_per_tensor_path(sizes, bits, block, dtype, eps, wild, seed) -> None:
    entries, vs, want = group(sizes, bits, block, dtype, eps, seed, wild)
    got = decode_on_device(entries, vs, bits, block, dtype, eps)
    assert_same(got, want, dtype)


def test_the_reference_op_is_the_per_tensor_path() -> None:
    entries, vs, want = group((700, 5000), 4, 128, torch.bfloat16, 1e-8, seed=5, wild=True)
    got = ops.dequantize_blockwise_update_many(
        [e.buffers["codes"] for e in entries],
        [e.buffers["scales"] for e in entries],
        [700, 5000],
        vs,
        1e-8,
        4,
        128,
        torch.bfloat16,
    )
    assert_same(got, want, torch.bfloat16)


@pytest.mark.parametrize("kernel", [False, True])
def test_the_codecs_grouped_decode_checks_and_decodes_each_entry_as_alone(kernel) -> None:
    """``decode_group_with_partners`` (the op through the dispatch: the torch reference, or
    the kernel) gives each entry its shaped per-tensor decode, and refuses what the
    per-tensor decode refuses, naming the entry."""
    gen = torch.Generator().manual_seed(3)
    ms = [torch.randn(50, 100, generator=gen), torch.randn(33, generator=gen)]
    vs = [m.square() * 0.9 for m in ms]
    params = CODEC.resolve_params({"bits": 3}, bits=8, block=128)
    entries = [CODEC.encode_with_partner(m, params, "v", v, None).entry for m, v in zip(ms, vs)]
    assert CODEC.partner_group_key(entries[0]) == CODEC.partner_group_key(entries[1])
    want = [CODEC.decode_with_partner(e, v, None, "alone") for e, v in zip(entries, vs)]
    dev_entries = [
        EncodedEntry(
            e.codec, e.params, e.shape, e.dtype, {k: on_kernel_device(b) for k, b in e.buffers.items()}
        )
        for e in entries
    ]
    dev_vs = [on_kernel_device(v) for v in vs]
    backend = ops.using(
        "dequantize_blockwise_update_many", KERNEL_DEVICE.type, dequantize_blockwise_update_many_cuda
    )
    with backend if kernel else ops.using("dequantize_blockwise_update_many", KERNEL_DEVICE.type, None):
        got = CODEC.decode_group_with_partners(dev_entries, dev_vs, KERNEL_DEVICE, ["a", "b"])
        assert [tuple(g.shape) for g in got] == [(50, 100), (33,)]
        for g, w in zip(got, want):
            assert torch.equal(g.cpu().view(torch.int32), w.view(torch.int32))
        with pytest.raises(
            CheckpointError, match="^b: partner 'v' decodes to torch.float32 of shape \\(34,\\)"
        ):
            CODEC.decode_group_with_partners(
                dev_entries, [dev_vs[0], on_kernel_device(torch.ones(34))], KERNEL_DEVICE, ["a", "b"]
            )
