"""``quantize_blockwise_update_many`` (the blockwise-update encode of many tensors per
launch) against the per-tensor torch path of the codec, tensor by tensor.

Each tensor's ``u = m / (sqrt(v_hat) + eps)`` is formed in the kernel's tile; its codes and
scales must be the bytes of the codec's torch expression (:func:`denominator`, then a
division) followed by the single blockwise op, and its flag raised exactly where a block of
``u`` cannot be coded or the denominator is infinite. Without a GPU the kernel runs under
``TRITON_INTERPRET=1`` on CPU tensors (the Triton backend's function called directly).
"""

from __future__ import annotations

import pytest
import torch
from _kernel_testing import (
    KERNEL_DEVICE,
    max_examples,
    on_kernel_device,
    random_floats,
    require_runnable_kernels,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tw_triton import ops
from tw_triton.codecs.blockwise_update import denominator
from tw_triton.ops.backends.triton import quantize_blockwise_update_many_cuda
from tw_triton.ops.reference import quantize_blockwise_torch

require_runnable_kernels()
# Around the tile (4096 elements at block 128) and block boundaries.
SIZES = (4096, 5000, 33, 4096 * 2 + 7, 1, 128)


def per_tensor(m: torch.Tensor, v: torch.Tensor, eps: float, bits: int, block: int, qmax: int | None):
    """The codec's per-tensor path: its torch update, then the single blockwise op."""
    d = denominator(v, eps)
    codes, scales = quantize_blockwise_torch(m.float() / d, None, bits, block, qmax=qmax)
    return codes, scales, bool(torch.isinf(scales).any() or torch.isinf(d).any())


def assert_group_like_torch(ms, vs, eps, bits, block, qmax=None) -> list[int]:
    flags = torch.zeros(len(ms), dtype=torch.int64, device=KERNEL_DEVICE)
    got = quantize_blockwise_update_many_cuda(
        [on_kernel_device(m) for m in ms],
        [on_kernel_device(v) for v in vs],
        eps,
        bits,
        block,
        flags=flags,
        qmax=qmax,
    )
    assert len(got) == len(ms)
    for i, (m, v) in enumerate(zip(ms, vs)):
        codes, scales, bad = per_tensor(m, v, eps, bits, block, qmax)
        assert torch.equal(got[i][0].cpu(), codes), f"tensor {i}: codes differ"
        assert torch.equal(got[i][1].cpu().view(torch.int32), scales.view(torch.int32)), f"tensor {i}: scales"
        assert int(flags[i]) == int(bad), f"tensor {i}: flag {int(flags[i])}, expected {int(bad)}"
    return flags.tolist()


def moments(gen: torch.Generator, n: int, dtype: torch.dtype = torch.float32):
    """Adam-like moments: ``m`` over many magnitudes, ``v`` near ``m**2`` with zeros, tiny
    (subnormal) and huge values."""
    m = random_floats(gen, n, torch.float64, -12, 2, zero_fraction=0.05)
    v = m * m * torch.pow(10.0, torch.randn(n, generator=gen, dtype=torch.float64))
    pick = torch.rand(n, generator=gen, dtype=torch.float64)
    v = torch.where(pick < 0.05, torch.zeros_like(v), v)
    v = torch.where((pick >= 0.05) & (pick < 0.08), torch.full_like(v, 1e-44), v)
    v = torch.where((pick >= 0.08) & (pick < 0.1), torch.full_like(v, 3e38), v)
    return m.to(dtype), v.to(torch.float32)


@pytest.mark.parametrize("bits,block,qmax", [(4, 128, 3), (8, 32, None), (2, 4096, None)])
def test_a_group_gives_each_tensor_the_per_tensor_bytes_and_flags(bits, block, qmax) -> None:
    gen = torch.Generator().manual_seed(bits + block)
    pairs = [moments(gen, n) for n in SIZES]
    ms, vs = [m for m, _ in pairs], [v for _, v in pairs]
    ms[2][3] = float("nan")  # a NaN in m: its block's scale is infinite
    vs[3][-1] = float("inf")  # an infinite partner in the tail tile: u = 0, still flagged
    vs[0][100] = float("inf")  # in a whole tile
    assert assert_group_like_torch(ms, vs, 1e-8, bits, block, qmax) == [1, 0, 1, 1, 0, 0]


@settings(max_examples=max_examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(min_value=1, max_value=9000), min_size=1, max_size=4),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    eps=st.sampled_from([1e-8, 1e-6, 0.1, 3e-39]),
    bits=st.sampled_from([8, 4, 2]),
    seed=st.integers(min_value=0, max_value=2**31 - 1),
)
def test_grouped_update_encode_is_byte_identical_to_the_per_tensor_path(
    sizes, dtype, eps, bits, seed
) -> None:
    gen = torch.Generator().manual_seed(seed)
    pairs = [moments(gen, n, dtype) for n in sizes]
    assert_group_like_torch([m for m, _ in pairs], [v for _, v in pairs], eps, bits, 128)


def test_the_reference_op_matches_the_per_tensor_path_and_flags_nan() -> None:
    gen = torch.Generator().manual_seed(7)
    pairs = [moments(gen, n) for n in (300, 129)]
    ms, vs = [m for m, _ in pairs], [v for _, v in pairs]
    vs[1][5] = float("nan")
    flags = torch.zeros(2, dtype=torch.int64)
    got = ops.quantize_blockwise_update_many(ms, vs, 1e-8, 4, 128, flags=flags)
    for i, (m, v) in enumerate(zip(ms, vs)):
        codes, scales, _ = per_tensor(m, v, 1e-8, 4, 128, None)
        assert torch.equal(got[i][0], codes) and torch.equal(got[i][1], scales)
    assert flags.tolist() == [0, 1]
