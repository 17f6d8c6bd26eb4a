"""Session setup shared by the test files.

Without a GPU the Triton kernels run under Triton's interpreter, on CPU tensors. Triton
decides between interpreted and compiled when each ``@triton.jit`` function is defined
(its own standard library included, at ``import triton``), so the switch has to be set
here, before any test module imports triton. The rest of the library only launches kernels
on CUDA tensors, so the setting changes nothing for other tests. With a GPU the kernels
stay compiled and the kernel tests run them on CUDA tensors instead.

The ``cuda`` marker collects every test that runs a CUDA path when a GPU is present, so
that ``pytest -m cuda`` is the GPU half of the suite (``benchmarks/gpu/validate.py`` runs it):

* ``@pytest.mark.cuda``: the test needs a CUDA device. Without one it is skipped, with the
  reason shown; with one, a skip (from inside the test, or any other marker) is turned into
  a failure, so nothing of the GPU half can pass by being silently skipped.
* ``@pytest.mark.cuda(devices=2)``: the test needs that many devices. On a machine with
  fewer it is skipped, with a reason that starts ``needs 2 CUDA devices``, even with a GPU:
  the no-skip rule holds only where the devices are there (the validation lists such tests
  apart, as not run on that machine).
* The kernel test modules in :data:`KERNEL_MODULES` compare the kernels with the torch path
  on ``KERNEL_DEVICE``: under the interpreter on the CPU, compiled on CUDA. They get the
  marker here, as ``cuda(interpreted=True)``: they run without a GPU too, and with one the
  same no-skip rule holds.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings as hypothesis_settings

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# Property tests draw the same examples on every run (a seed from each test's name), so a
# run on a fresh machine cannot fail on a draw no earlier run made. HYPOTHESIS_PROFILE=explore
# draws new ones (and keeps failures in .hypothesis/), for looking for bugs on purpose.
hypothesis_settings.register_profile("deterministic", derandomize=True, database=None)
hypothesis_settings.register_profile("explore", derandomize=False)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))

# The override lets a test check the GPU-side rules of this file on a machine without one.
HAS_CUDA = torch.cuda.is_available() or os.environ.get("TW_TRITON_TEST_ASSUME_CUDA") == "1"
CUDA_DEVICES = (
    torch.cuda.device_count()
    if torch.cuda.is_available()
    else int(os.environ.get("TW_TRITON_TEST_ASSUME_CUDA_DEVICES", "1"))
    if HAS_CUDA
    else 0
)

# Modules whose tests run the kernels on the GPU when there is one (and interpreted if not).
KERNEL_MODULES = frozenset(
    {
        "test_quantize_blockwise.py",
        "test_dequantize_blockwise.py",
        "test_quantize_log2.py",
        "test_grouped_ops.py",
        "test_bitmask_kernels.py",
        "test_quantize_log2_temporal.py",
        "test_quantize_log2_temporal_many.py",
        "test_delta_statistics_many.py",
        "test_bitmask_encode_many.py",
        # The grouped decodes and checks of a load, and the other grouped kernels of a save.
        "test_log2_temporal_check.py",
        "test_dequantize_log2_temporal_many.py",
        "test_dequantize_log2_many.py",
        "test_dequantize_blockwise_update_many.py",
        "test_quantize_blockwise_update_many.py",
        "test_sparsity_counts_many.py",
    }
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "cuda: runs a CUDA path on a GPU (skipped without one unless interpreted=True, or "
        "with fewer than devices=N; a skip while the devices are present is a failure)",
    )


def _interpreted(marker: pytest.Mark) -> bool:
    return bool(marker.kwargs.get("interpreted", False))


def _devices(marker: pytest.Mark | None) -> int:
    return int(marker.kwargs.get("devices", 1)) if marker is not None else 1


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in KERNEL_MODULES and item.get_closest_marker("cuda") is None:
            item.add_marker(pytest.mark.cuda(interpreted=True))
        marker = item.get_closest_marker("cuda")
        if marker is not None and not HAS_CUDA and not _interpreted(marker):
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device (marker 'cuda')"))
        elif marker is not None and HAS_CUDA and CUDA_DEVICES < _devices(marker):
            n = _devices(marker)
            item.add_marker(
                pytest.mark.skip(
                    reason=f"needs {n} CUDA devices, this machine has {CUDA_DEVICES} (marker 'cuda')"
                )
            )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    marker = item.get_closest_marker("cuda")
    if HAS_CUDA and report.skipped and marker is not None and CUDA_DEVICES >= _devices(marker):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid}: a 'cuda' test was skipped although a CUDA device is present "
            f"({reason}); the GPU half of the suite must run in full"
        )


@pytest.fixture
def parses(monkeypatch) -> list[str]:
    """The base names of the files whose header is parsed, in order."""
    from tw_triton.format import header

    seen: list[str] = []
    real = header.read_layout

    def counted(f, path):
        seen.append(os.path.basename(path))
        return real(f, path)

    monkeypatch.setattr(header, "read_layout", counted)
    return seen


@pytest.fixture
def gc_generations():
    """The generations of the garbage collections that start while the test runs, in order."""
    import gc

    seen: list[int] = []

    def record(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(record)
    try:
        yield seen
    finally:
        gc.callbacks.remove(record)


@pytest.fixture(autouse=True)
def _fallback_warnings_per_test():
    """A partner fallback warns once per process: each test starts as a fresh process."""
    from tw_triton.state import partners

    partners.warned_fallbacks.clear()
    yield
