"""``ops.bitmask_encode_many``: the grouped bitmask encode against the spec (the torch
``bitmask_encode`` of each tensor, with its count given).

Without a GPU the kernels run under ``TRITON_INTERPRET=1`` on CPU tensors (the Triton
backend's function called directly); with one, compiled. Every tensor's mask and values
must be the spec's bytes: all zeros, no zero, ``-0.0`` and NaN payloads (values, not
zeros), lengths off the tile (4096) and the byte, many tensors of mixed sizes and of every
dtype the codec takes, and tensors the kernels do not read in place (encoded alone in the
same call).
"""

from __future__ import annotations

import importlib

import torch
from _kernel_testing import (
    FLOATS,
    KERNEL_DEVICE,
    bit_patterns,
    max_examples,
    numels,
    on_kernel_device,
    require_runnable_kernels,
    same_bits,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tw_triton import ops
from tw_triton.ops.backends.triton import bitmask_encode_many_cuda
from tw_triton.ops.reference import bitmask_encode_many_torch, bitmask_encode_torch, nonzero_count

require_runnable_kernels()

kernel_module = importlib.import_module("tw_triton.kernels.bitmask_grouped")
TILE = kernel_module.TILE


def assert_like_spec(xs: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The grouped encode of ``xs`` (on the kernels' device) against the spec's bytes."""
    nnzs = [int(nonzero_count(x)) for x in xs]
    got = bitmask_encode_many_cuda([on_kernel_device(x) for x in xs], nnzs)
    assert len(got) == len(xs)
    for i, (x, (mask, values)) in enumerate(zip(xs, got)):
        want_mask, want_values = bitmask_encode_torch(x, nnz=nnzs[i])
        assert mask.device.type == KERNEL_DEVICE.type
        assert same_bits(mask.cpu(), want_mask), (i, x.dtype, x.numel(), "mask")
        assert same_bits(values.cpu(), want_values), (i, x.dtype, x.numel(), "values")
    return got


def test_all_zeros_no_zeros_negative_zero_and_nan() -> None:
    nan16 = torch.tensor([0x7E01, 0x7C01, -1], dtype=torch.int16)  # NaN payloads, fp16 and bf16
    xs = [
        torch.zeros(3 * TILE, dtype=torch.float32),  # whole tiles, nothing kept
        torch.zeros(TILE + 1, dtype=torch.bfloat16),  # a whole tile and a one-element tail
        torch.ones(2 * TILE + 9, dtype=torch.float16),  # no zero
        torch.full((TILE + 7,), -0.0),  # -0.0 is a value: every element kept
        torch.tensor([0.0, -0.0, float("nan"), 0.0, float("-inf"), -0.0, 0.0, 1e-45, 0.0]),
        nan16.repeat(11).view(torch.float16),
        nan16.repeat(5).view(torch.bfloat16),
        torch.zeros(5, dtype=torch.float16),  # a tail only, nothing kept
        torch.zeros(0),
        torch.ones(8, dtype=torch.bfloat16),  # one whole mask byte
    ]
    got = assert_like_spec(xs)
    assert got[3][1].numel() == TILE + 7 and got[0][1].numel() == 0
    kept = got[4][1].cpu().view(torch.int32)
    assert kept.tolist()[:2] == [torch.tensor(-0.0).view(torch.int32).item(), 0x7FC00000]


def test_tiles_with_nothing_and_tiles_with_everything_in_one_group() -> None:
    """Each tile's place in its tensor's values comes from the tiles before it, in the
    scan of the whole group: tensors after a tensor of many values start at 0."""
    gen = torch.Generator().manual_seed(11)
    for dtype in FLOATS:
        x = bit_patterns(gen, 3 * TILE + 77, dtype, 0.5)
        x[:TILE] = 0
        x[TILE : 2 * TILE] = bit_patterns(gen, TILE, dtype, 0.0)
        dense = bit_patterns(gen, 2 * TILE + 3, dtype, 0.0)
        assert_like_spec([dense, x, x[: 2 * TILE].clone(), dense])


def test_many_tensors_of_mixed_sizes_and_dtypes() -> None:
    gen = torch.Generator().manual_seed(3)
    sizes = [1, 7, 8, 9, 4095, 4096, 4097, 8192 + 13, 100, 0, 3 * TILE, 12_345]
    xs = [bit_patterns(gen, n, FLOATS[i % 3], (0.0, 0.3, 0.9, 1.0)[i % 4]) for i, n in enumerate(sizes * 3)]
    assert_like_spec(xs)


def test_tensors_the_kernels_do_not_read_in_place_are_encoded_alone() -> None:
    """Not 16-byte aligned or not contiguous: the single op each, in the same call, in
    their places among the grouped ones."""
    gen = torch.Generator().manual_seed(1)
    base = bit_patterns(gen, 3 * TILE + 11, torch.bfloat16, 0.6)
    matrix = bit_patterns(gen, 96 * 80, torch.float32, 0.5).view(96, 80)
    xs = [base[1:], matrix.t(), base[8:], matrix, bit_patterns(gen, 17, torch.float16, 0.5)]
    assert_like_spec(xs)


def test_a_count_too_small_stays_inside_the_tensors_values() -> None:
    """Stores are bounded by each tensor's own count: a wrong count cannot write into the
    next tensor's region of the group's values buffer."""
    x = torch.ones(2 * TILE + 5)
    y = torch.arange(1, TILE + 2, dtype=torch.float32)
    got = bitmask_encode_many_cuda([on_kernel_device(x), on_kernel_device(y)], [10, TILE + 1])
    assert got[0][1].numel() == 10 and torch.equal(got[0][1].cpu(), torch.ones(10))
    assert torch.equal(got[1][1].cpu(), y)


def test_the_op_is_the_single_encode_of_each_tensor() -> None:
    """The spec and the dispatched op (the CPU's) give the single op's bytes, into ``out``
    where given."""
    gen = torch.Generator().manual_seed(5)
    xs = [bit_patterns(gen, n, dtype, 0.5) for n, dtype in zip((4096, 33, 9000), FLOATS)]
    nnzs = [int(nonzero_count(x)) for x in xs]
    outs = [None, (torch.empty(5, dtype=torch.uint8), torch.empty(nnzs[1], dtype=torch.float16)), None]
    for got in (ops.bitmask_encode_many(xs, nnzs, out=outs), bitmask_encode_many_torch(xs, nnzs)):
        for x, (mask, values) in zip(xs, got):
            want_mask, want_values = bitmask_encode_torch(x)
            assert same_bits(mask, want_mask) and same_bits(values, want_values)
    assert outs[1][0].data_ptr() == ops.bitmask_encode_many(xs, nnzs, out=outs)[1][0].data_ptr()
    assert ops.bitmask_encode_many([], []) == []


def test_launches_per_element_width_do_not_grow_with_the_tensors(monkeypatch) -> None:
    """Pass 1 and the scatter each in one launch of whole tiles and one of tails: at most
    four per width, whatever the number of tensors."""
    launches = []
    for name in ("bitmask_mask_grouped_kernel", "bitmask_scatter_grouped_kernel"):
        real = getattr(kernel_module, name)

        class Spy:
            def __init__(self, real=real, name=name):
                self.real, self.name = real, name

            def __getitem__(self, grid):
                launches.append(self.name)
                return self.real[grid]

        monkeypatch.setattr(kernel_module, name, Spy())
    gen = torch.Generator().manual_seed(2)
    for count in (4, 24):
        launches.clear()
        xs = [
            bit_patterns(gen, (TILE, 2 * TILE + 5, 17, TILE + 3)[i % 4], FLOATS[i % 3], 0.3)
            for i in range(count)
        ]
        assert_like_spec(xs)
        # Two widths (fp32; fp16 and bf16), each with whole tiles and tails, two passes.
        assert len(launches) == 8, launches


@settings(max_examples=max_examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    members=st.lists(
        st.tuples(numels(), st.sampled_from(FLOATS), st.sampled_from((0.0, 0.5, 0.97, 1.0))),
        min_size=1,
        max_size=6,
    ),
    seed=st.integers(0, 2**31 - 1),
)
def test_grouped_encode_is_byte_identical_to_the_spec(members, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    assert_like_spec([bit_patterns(gen, n, dtype, zeros) for n, dtype, zeros in members])


def test_the_gpu_precompile_runs_both_passes_for_every_width(monkeypatch) -> None:
    """benchmarks/gpu/_precompile.py: each grid entry without a reference also encodes its
    tensor grouped, so the one-tensor launches (whole tiles, tail) of both passes and both
    widths are compiled."""
    from _kernel_testing import GPU_BENCH_DIR

    monkeypatch.syspath_prepend(str(GPU_BENCH_DIR))
    import _precompile

    seen = set()
    for name in ("bitmask_mask_grouped_kernel", "bitmask_scatter_grouped_kernel"):
        real = getattr(kernel_module, name)

        class Spy:
            def __init__(self, real=real, name=name):
                self.real, self.name = real, name

            def __getitem__(self, grid):
                def launch(table, out, carrier, *args, **meta):
                    seen.add((self.name, carrier.dtype, meta["MASKED"]))
                    return self.real[grid](table, out, carrier, *args, **meta)

                return launch

        monkeypatch.setattr(kernel_module, name, Spy())
    firsts = {}
    for entry in _precompile.default_grid():
        if not entry.has_ref:
            firsts.setdefault(entry.dtype, entry)
    with ops.using("bitmask_encode_many", KERNEL_DEVICE.type, bitmask_encode_many_cuda):
        for entry in firsts.values():
            _precompile.run_entry(entry, KERNEL_DEVICE)
    assert seen == {
        (name, dtype, masked)
        for name in ("bitmask_mask_grouped_kernel", "bitmask_scatter_grouped_kernel")
        for dtype in (torch.int16, torch.int32)
        for masked in (False, True)
    }
