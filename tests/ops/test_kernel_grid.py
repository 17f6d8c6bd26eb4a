"""The GPU half of the kernel tests compiles only what the GPU validation precompiled.

On a GPU each distinct kernel specialization is a Triton compile, so the kernel tests
draw their parameters there from the fixed grid of benchmarks/gpu/_precompile.py (issue 29,
item 3; ``ON_GRID`` in tests/_kernel_testing.py). Checked on the CPU: the kernel test
modules run as a GPU run draws (``TW_TRITON_TEST_KERNEL_GRID=1``, interpreted, few
hypothesis examples) with every launch recorded (tests/_kernel_launches.py), and each
launch's specialization must be one that the precompile's own run of the grid launches.
With a GPU the same runs happen there, compiled.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import _kernel_launches as launches
import _offsets64
import torch
from _kernel_testing import GPU_BENCH_DIR, KERNEL_DEVICE, Variant, grid_variants, on_kernel_device

from tw_triton import ops

REPO = Path(__file__).resolve().parents[2]
KERNEL_TESTS = [
    "tests/ops/test_quantize_blockwise.py",
    "tests/ops/test_dequantize_blockwise.py",
    "tests/ops/test_quantize_log2.py",
]
KERNEL_OPS = ("quantize_blockwise", "dequantize_blockwise", "quantize_log2", "dequantize_log2")


def precompiled_launches() -> set:
    """What the precompile launches: each grid entry through its codec on the kernel
    device (without a GPU, the kernels stand in for the CPU backend, interpreted)."""
    sys.path.insert(0, str(GPU_BENCH_DIR))
    from _precompile import default_grid, run_entry

    with launches.recording() as seen, contextlib.ExitStack() as stack:
        if KERNEL_DEVICE.type == "cpu":
            for op in KERNEL_OPS:
                stack.enter_context(ops.using(op, "cpu", ops.lookup(op, "cuda")))
        for entry in default_grid():
            run_entry(entry, KERNEL_DEVICE)
    return set(seen)


def test_the_gpu_kernel_tests_launch_only_precompiled_variants(tmp_path):
    grid = precompiled_launches()
    assert {name for name, _, _ in grid} == set(launches.KERNELS.values())
    out = tmp_path / "launches.json"
    env = dict(os.environ)
    env.update(
        TW_TRITON_TEST_KERNEL_GRID="1",
        TW_TRITON_TEST_MAX_EXAMPLES="5",
        TW_TRITON_LAUNCHES_OUT=str(out),
        PYTHONPATH=os.pathsep.join([str(REPO / "tests"), env.get("PYTHONPATH", "")]),
    )
    if KERNEL_DEVICE.type == "cpu":
        env["TRITON_INTERPRET"] = "1"  # before the plugin imports triton
    # The int64 offset checks run in a child of their own; their windows are checked below.
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "_kernel_launches", "-p", "no:cacheprovider"]
    proc = subprocess.run(
        [*cmd, "-k", "not int64", *KERNEL_TESTS],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    tested = launches.from_json(json.loads(out.read_text()))
    assert {name for name, _, _ in tested} == set(launches.KERNELS.values())
    off_grid = sorted(tested - grid)
    assert not off_grid, f"{len(off_grid)} launches the precompile does not make, e.g. {off_grid[:3]}"


def test_an_off_grid_launch_is_told_apart():
    """The key tells a block or a reference dtype outside the grid from the grid's; fewer
    levels in a container (any ``qmax``: the ``max_error`` widths 3, 5, 6, 7) launch the
    container's own variants, ``qmax`` being a runtime value."""
    grid = precompiled_launches()
    from tw_triton.kernels import quantize_blockwise

    x = on_kernel_device(torch.randn(300))
    for ref, block in ((None, 32), (x.to(torch.bfloat16), 128)):
        with launches.recording(run=False) as seen:  # on a GPU, nothing compiled off the grid
            quantize_blockwise(x, ref, 4, block)
        assert seen and not seen & grid, (block, ref)
    for bits, qmax in ((4, None), (4, 3), (4, 5), (8, 15), (8, 31), (8, 63)):
        with launches.recording(run=False) as seen:
            quantize_blockwise(x, x.clone(), bits, 128, qmax)
        assert seen and seen <= grid, (bits, qmax)


def test_the_gpu_offset_windows_are_grid_variants():
    for w in _offsets64.device_windows():
        assert Variant(w.bits, w.block, w.dtype, w.ref_dtype) in grid_variants("blockwise"), w.label()
