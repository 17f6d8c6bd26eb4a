"""Shared pieces of the kernel tests: where kernels run, bit-level comparison, input makers.

Without a GPU the kernels run under Triton's interpreter on CPU tensors (conftest.py sets
``TRITON_INTERPRET=1``); with one they run compiled on CUDA tensors. Either way the result
is compared with the torch path on the CPU, which is the specification.

Compiled, every distinct set of constexprs and pointer dtypes is a Triton compile of its
own, so on a GPU the kernel tests draw their parameters (bits, block, dtype, reference
dtype; the default ``qmax``) from the fixed grid that the GPU validation precompiles
(``benchmarks/gpu/_precompile.py``, :func:`grid_variants`): :data:`ON_GRID`. Under the
interpreter they draw from the whole range. ``TW_TRITON_TEST_KERNEL_GRID=1`` makes a run
on the CPU draw as a GPU run does (tests/ops/test_kernel_grid.py checks it that way).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from hypothesis import strategies as st

KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
BLOCKS = tuple(2**k for k in range(5, 13))  # 32 .. 4096
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}

ON_GRID = KERNEL_DEVICE.type == "cuda" or os.environ.get("TW_TRITON_TEST_KERNEL_GRID") == "1"
GPU_BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"


@dataclass(frozen=True)
class Variant:
    """The kernel parameters of one grid entry (a reference has the tensor's dtype)."""

    bits: int
    block: int
    dtype: torch.dtype
    ref_dtype: torch.dtype | None


@functools.cache
def grid_variants(codec: str) -> tuple[Variant, ...]:
    """The variants of ``codec`` ("blockwise", "log2") in the GPU validation's grid."""
    if str(GPU_BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(GPU_BENCH_DIR))
    from _precompile import default_grid

    out = []
    for e in default_grid():
        extra = {k for k, _ in e.params} - {"bits", "block", "packing"}
        if e.codec == codec and not extra:
            dtype = getattr(torch, e.dtype)
            out.append(Variant(e.bits, e.block, dtype, dtype if e.has_ref else None))
    assert out, f"the GPU grid has no plain {codec!r} entry"
    return tuple(out)


def grid_bits(codec: str) -> tuple[int, ...]:
    """The code widths of ``codec`` in the grid, widest first."""
    return tuple(sorted({v.bits for v in grid_variants(codec)}, reverse=True))


def grid_block(codec: str) -> int:
    """The block of ``codec``'s grid variants (the grid uses one)."""
    (block,) = {v.block for v in grid_variants(codec)}
    return block


def block_for(codec: str, block: int) -> int:
    """``block`` under the interpreter; the grid's block on a GPU."""
    return grid_block(codec) if ON_GRID else block


def max_examples(n: int) -> int:
    """Hypothesis examples of a kernel test: ``n``, or fewer where
    ``TW_TRITON_TEST_MAX_EXAMPLES`` says (the grid check, which only records launches)."""
    return min(n, int(os.environ.get("TW_TRITON_TEST_MAX_EXAMPLES", n)))


def require_runnable_kernels() -> None:
    """Fail loudly (not skip) when kernels can run neither compiled nor interpreted."""
    import triton

    if KERNEL_DEVICE.type == "cpu" and not triton.knobs.runtime.interpret:
        raise AssertionError(
            "no CUDA device and TRITON_INTERPRET is not 1 when triton was imported; "
            "tests/conftest.py should have set it"
        )


def on_kernel_device(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` moved to where the kernels run (a no-op without a GPU)."""
    return None if t is None else t.to(KERNEL_DEVICE)


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Bit-for-bit equality of two float tensors; NaN equals NaN whatever its payload."""
    actual = actual.cpu()
    expected = expected.cpu()
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
    assert torch.equal(nan_a, nan_e), f"{what}: NaN positions differ"
    bits_a = actual.view(INT_VIEW[actual.dtype])[~nan_a]
    bits_e = expected.view(INT_VIEW[expected.dtype])[~nan_e]
    if not torch.equal(bits_a, bits_e):
        bad = (bits_a != bits_e).nonzero()[:5].flatten().tolist()
        raise AssertionError(
            f"{what}: {int((bits_a != bits_e).sum())} elements differ, first at non-NaN "
            f"positions {bad}: kernel {actual[~nan_a][bad].tolist()} vs torch "
            f"{expected[~nan_e][bad].tolist()}"
        )


def random_floats(
    gen: torch.Generator,
    numel: int,
    dtype: torch.dtype,
    lo_exp: float,
    hi_exp: float,
    zero_fraction: float = 0.0,
) -> torch.Tensor:
    """Normal draws scaled by ``10**e``, ``e`` uniform in ``[lo_exp, hi_exp]`` per element.

    Built in float64 and rounded once to ``dtype``, so fp16 may overflow to inf or
    underflow to subnormals and zero: both are inputs the codec must take.
    """
    base = torch.randn(numel, generator=gen, dtype=torch.float64)
    exps = lo_exp + (hi_exp - lo_exp) * torch.rand(numel, generator=gen, dtype=torch.float64)
    values = base * torch.pow(10.0, exps)
    if zero_fraction > 0:
        values[torch.rand(numel, generator=gen, dtype=torch.float64) < zero_fraction] = 0.0
    return values.to(dtype)


@st.composite
def shapes(draw, numel: int) -> tuple[int, ...]:
    """1-D, or 2-D with a divisor of ``numel`` (row-major order is what gets encoded)."""
    if numel == 0 or not draw(st.booleans()):
        return (numel,)
    divisors = [d for d in range(1, min(numel, 64) + 1) if numel % d == 0]
    d = draw(st.sampled_from(divisors))
    return (d, numel // d)


def numels() -> st.SearchStrategy[int]:
    """Sizes around the interesting edges (0, 1, block and tile boundaries) and random."""
    return st.one_of(
        st.sampled_from([0, 1, 2, 3, 31, 32, 33, 127, 129, 4095, 4096, 4097, 8193]),
        st.integers(min_value=0, max_value=10_000),
    )


def exponent_range(dtype: torch.dtype) -> tuple[int, int]:
    """Decimal exponents to draw magnitudes from: 1e-30..1e30, narrower where fp16 ends."""
    return (-9, 5) if dtype == torch.float16 else (-30, 30)


def run_offset_check(op: str, *extra: str) -> str:
    """Run ``_offsets64.py OP DEVICE EXTRA...`` in a child process; its output, or a failure
    with it.

    A child, because offsets that wrap at 2**31 send the kernel to unmapped memory: the
    interpreter then segfaults (a GPU raises an illegal-address error and its context is
    lost), and either must fail this test, not end the session. On a GPU the child uses
    real allocations of up to 43 GiB; with too little free memory for some window the test
    is skipped naming them (conftest.py turns that skip into a failure on a GPU).
    """
    import pytest

    script = Path(__file__).with_name("_offsets64.py")
    proc = subprocess.run(
        [sys.executable, str(script), op, KERNEL_DEVICE.type, *extra],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=600,
    )
    if proc.returncode == 3:
        pytest.skip(f"{op} offset check on {KERNEL_DEVICE}: {proc.stdout.strip()}")
    if proc.returncode != 0:
        crashed = proc.returncode < 0
        raise AssertionError(
            f"{op} offset check failed (rc {proc.returncode}"
            f"{', killed by a signal: offsets likely wrapped' if crashed else ''}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    assert "checked" in proc.stdout, proc.stdout
    return proc.stdout


def unpack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """One uint8 code per element from LSB-first packed bytes (written here, independent of
    the code under test, from the format's definition)."""
    k = 8 // bits
    codes = codes.cpu()
    parts = [(codes >> (j * bits)) & ((1 << bits) - 1) for j in range(k)]
    return torch.stack(parts, dim=1).reshape(-1)


def bit_patterns(gen: torch.Generator, n: int, dtype: torch.dtype, zeros: float) -> torch.Tensor:
    """Random bit patterns of ``dtype``'s width (every NaN payload, -0.0, subnormals, inf),
    with about ``zeros`` of them the all-zero pattern and some -0.0."""
    view = INT_VIEW[dtype]
    info = torch.iinfo(view)
    bits = torch.randint(info.min, info.max, (n,), generator=gen, dtype=torch.int64).to(view)
    u = torch.rand(n, generator=gen)
    bits[u < zeros] = 0
    bits[(u >= zeros) & (u < zeros + 0.05)] = info.min  # the sign bit alone: -0.0
    return bits.view(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads included)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
