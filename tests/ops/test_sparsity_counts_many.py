"""``ops.sparsity_counts_many``: the grouped count kernel against the spec (the torch
``sparsity_counts`` of each tensor).

Without a GPU the kernel runs under ``TRITON_INTERPRET=1`` on CPU tensors (the Triton
backend's function called directly); with one, compiled. Every tensor's two slots must hold
the spec's ``(nnz, runs)``: runs that cross tile boundaries (4096 elements) and tails
included, ``-0.0`` a value, any mix of widths and of tensors the kernel does not read in
place (counted by the single op).
"""

from __future__ import annotations

import importlib

import torch
from _kernel_testing import (
    FLOATS,
    INT_VIEW,
    KERNEL_DEVICE,
    bit_patterns,
    max_examples,
    on_kernel_device,
    require_runnable_kernels,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tw_triton import ops
from tw_triton.ops.backends.triton import sparsity_counts_many_cuda
from tw_triton.ops.reference import sparsity_counts_many_torch, sparsity_counts_torch

require_runnable_kernels()

kernel_module = importlib.import_module("tw_triton.kernels.sparsity_counts_grouped")
TILE = kernel_module.TILE


def spec(xs: list[torch.Tensor]) -> list[int]:
    return [int(c) for x in xs for c in sparsity_counts_torch(x)]


def grouped(xs: list[torch.Tensor], start: list[int] | None = None) -> list[int]:
    out = torch.tensor(start or [0] * (2 * len(xs)), dtype=torch.int64, device=KERNEL_DEVICE)
    sparsity_counts_many_cuda([on_kernel_device(x) for x in xs], out=out)
    return out.tolist()


def runs_across_tiles(dtype: torch.dtype) -> torch.Tensor:
    """Zeros on both sides of every tile boundary, a run spanning a whole tile, a lone zero
    first in a tile after a value, a value first in a tile after zeros, and a tail."""
    x = torch.ones(4 * TILE + 100, dtype=dtype)
    x[TILE - 3 : TILE + 5] = 0  # one run across the first boundary
    x[2 * TILE - 1 : 3 * TILE + 1] = 0  # a run over a whole tile and two boundaries
    x[3 * TILE + 2] = 0  # after the boundary's values
    x[4 * TILE - 1] = 0  # last of a tile, before a value
    x[4 * TILE + 1 :] = 0  # the tail ends in zeros
    return x


def test_runs_across_tile_boundaries_are_counted_once() -> None:
    for dtype in FLOATS:
        x = runs_across_tiles(dtype)
        assert grouped([x]) == spec([x]) == [int((x != 0).sum()), 5], dtype


def test_all_zero_no_zero_and_negative_zero() -> None:
    xs = [
        torch.zeros(3 * TILE, dtype=torch.float32),  # whole tiles only: one run
        torch.zeros(TILE + 1, dtype=torch.bfloat16),  # a whole tile and a one-element tail
        torch.ones(2 * TILE + 9, dtype=torch.float16),  # no zero
        torch.full((TILE + 7,), -0.0),  # -0.0 is a value: no zero at all
        torch.zeros(5, dtype=torch.float16),  # a tail only
        torch.zeros(0),
    ]
    assert grouped(xs) == spec(xs)
    assert grouped(xs)[:8] == [0, 1, 0, 1, 2 * TILE + 9, 0, TILE + 7, 0]


def test_counts_are_added_to_the_slots() -> None:
    """The op adds to ``out`` (a save's zero-filled buffer), as the spec does."""
    x = runs_across_tiles(torch.float32)
    want = spec([x])
    assert grouped([x], start=[10, -3]) == [want[0] + 10, want[1] - 3]
    out = torch.tensor([10, -3], dtype=torch.int64)
    assert sparsity_counts_many_torch([x], out=out).tolist() == [want[0] + 10, want[1] - 3]


def test_tensors_the_kernel_does_not_read_in_place_are_counted_alone() -> None:
    """Not 16-byte aligned, not contiguous, or of another width: the single op each, in the
    same call as the kernel's tensors, each into its own slots."""
    gen = torch.Generator().manual_seed(1)
    base = bit_patterns(gen, 3 * TILE + 11, torch.bfloat16, 0.6)
    matrix = bit_patterns(gen, 96 * 80, torch.float32, 0.5).view(96, 80)
    xs = [
        base[1:],  # 2 bytes off
        matrix.t(),  # transposed
        base[8:],  # 16 bytes off: read in place
        bit_patterns(gen, TILE + 3, torch.float32, 0.5).double(),  # 8 bytes an element
        matrix,
    ]
    assert grouped(xs) == spec(xs)


def test_launches_per_element_width_do_not_grow_with_the_tensors(monkeypatch) -> None:
    """Every tensor with whole tiles in one launch, every tail in another: at most two per
    width, one table copy each."""
    launches = []
    real = kernel_module.sparsity_counts_grouped_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(kernel_module, "sparsity_counts_grouped_kernel", Spy())
    gen = torch.Generator().manual_seed(2)
    xs = [bit_patterns(gen, n, FLOATS[(i // 3) % 3], 0.3) for i, n in enumerate([TILE, 2 * TILE + 5, 17] * 4)]
    assert grouped(xs) == spec(xs)
    # Two widths (fp32; fp16 and bf16), each with whole tiles and tails.
    assert len(launches) == 4, launches


def test_int64_offsets_past_2_to_the_32_elements() -> None:
    """A table row whose tiles start past 2**32 elements (its address moved back by as many
    bytes, so only offsets computed in 64 bits land in the real buffer); the element before
    the first tile is read too: a zero there continues the window's first run."""
    k = kernel_module
    window = bit_patterns(torch.Generator().manual_seed(3), 2 * TILE + 30, torch.float32, 0.5)
    window[:3] = 0
    buf = torch.cat([torch.ones(TILE - 1), torch.zeros(1), window]).to(KERNEL_DEVICE)
    ints = buf.view(torch.int32)
    first_tile = (1 << 32) // TILE + 5
    shift = (first_tile - 1) * TILE  # element TILE of buf is element first_tile * TILE
    n = first_tile * TILE + window.numel()
    address = ints.data_ptr() - shift * 4
    full = window.numel() // TILE
    out = torch.zeros(2, dtype=torch.int64, device=KERNEL_DEVICE)
    rows = [[address, 0, 0, 0, n, first_tile, 0, 0], [address, 0, 0, 0, n, first_tile + full, 0, 0]]
    tables = [torch.tensor(r, dtype=torch.int64, device=KERNEL_DEVICE) for r in rows]
    meta = dict(BLOCK=TILE, ROWS=1, LOG_T=1, num_warps=8)
    k.sparsity_counts_grouped_kernel[(full,)](tables[0], out, ints, 1, MASKED=False, **meta)
    k.sparsity_counts_grouped_kernel[(1,)](tables[1], out, ints, 1, MASKED=True, **meta)
    nnz, runs = spec([window])
    assert out.tolist() == [nnz, runs - 1]


def test_the_op_dispatches_by_device_and_takes_no_tensors() -> None:
    x = runs_across_tiles(torch.float16)
    out = torch.zeros(2, dtype=torch.int64)
    assert ops.sparsity_counts_many([x], out=out) is out and out.tolist() == spec([x])
    assert ops.sparsity_counts_many([], out=out) is out


@settings(max_examples=max_examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tensors=st.lists(
        st.tuples(
            st.sampled_from([0, 1, 15, 16, 4095, 4096, 4097, 8191, 8192 + 33, 3 * 4096 + 1]),
            st.sampled_from(FLOATS),
            st.sampled_from([0.0, 0.1, 0.5, 0.9, 0.999, 1.0]),
        ),
        min_size=1,
        max_size=6,
    ),
    seed=st.integers(0, 2**31 - 1),
)
def test_any_group_counts_like_the_spec(tensors, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    xs = []
    for n, dtype, zeros in tensors:
        x = bit_patterns(gen, n, dtype, zeros)
        if n > TILE and zeros not in (0.0, 1.0):
            # A run of zeros across the first tile boundary, or a value on each side.
            x.view(INT_VIEW[dtype])[TILE - 2 : TILE + 2] = 0 if seed % 2 else 1
        xs.append(x)
    assert grouped(xs) == spec(xs)


def test_the_gpu_precompile_runs_the_kernel_for_every_width(monkeypatch) -> None:
    """benchmarks/gpu/_precompile.py: each grid entry without a reference also counts its
    tensor, so the one-tensor launches (whole tiles, tail) of both widths are compiled."""
    from _kernel_testing import GPU_BENCH_DIR

    monkeypatch.syspath_prepend(str(GPU_BENCH_DIR))
    import _precompile

    seen = set()
    real = kernel_module.sparsity_counts_grouped_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(table, out, carrier, *args, **meta):
                seen.add((carrier.dtype, meta["MASKED"]))
                return real[grid](table, out, carrier, *args, **meta)

            return launch

    monkeypatch.setattr(kernel_module, "sparsity_counts_grouped_kernel", Spy())
    firsts = {}
    for entry in _precompile.default_grid():
        if not entry.has_ref:
            firsts.setdefault(entry.dtype, entry)
    with ops.using("sparsity_counts_many", KERNEL_DEVICE.type, sparsity_counts_many_cuda):
        for entry in firsts.values():
            _precompile.run_entry(entry, KERNEL_DEVICE)
    assert seen == {(torch.int16, False), (torch.int16, True), (torch.int32, False), (torch.int32, True)}
