"""The GPU validation's identity sweep covers the codec coded with a partner
(``blockwise-update``, the default preset's ``exp_avg``): its cases run both device paths
(one tensor, and a group) against the CPU, and a wrong device result fails them.

Without a GPU the device side runs the Triton backend on CPU tensors, its kernels under
``TRITON_INTERPRET=1`` (``_identity.kernels_on_cpu``); with one, on the GPU.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from _kernel_testing import KERNEL_DEVICE, require_runnable_kernels

from tw_triton import ops
from tw_triton.codecs import get_codec

GPU_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"
sys.path.insert(0, str(GPU_DIR))

import _identity  # noqa: E402
import _precompile  # noqa: E402
import validate  # noqa: E402

require_runnable_kernels()
NAME = "blockwise-update"
GROUPED_OPS = ("quantize_blockwise_update_many", "dequantize_blockwise_update_many")


@contextlib.contextmanager
def device_side(**replace: Callable) -> Iterator[None]:
    """The device's backend (on the CPU: the Triton one, interpreted), with ``replace``'s
    ops (``op=fn(real_fn)``) wrapped around it."""
    base = _identity.kernels_on_cpu() if KERNEL_DEVICE.type == "cpu" else contextlib.nullcontext()
    with base, contextlib.ExitStack() as stack:
        for op, wrap in replace.items():
            real = ops.lookup(op, KERNEL_DEVICE.type)
            stack.enter_context(ops.using(op, KERNEL_DEVICE.type, wrap(real)))
        yield


def test_the_cpu_stand_in_runs_the_kernels_and_keeps_the_torch_ops_the_cpus():
    """Torch's fp32 sqrt on a CPU is not CUDA's sqrt.rn: the ops torch's CUDA ops serve
    stay the CPU backend's under kernels_on_cpu; every other op is the Triton backend's."""
    from tw_triton.ops.backends import triton as triton_backend

    before = {op: ops.lookup(op, "cpu") for op in triton_backend.BACKEND}
    with _identity.kernels_on_cpu():
        for op, fn in triton_backend.BACKEND.items():
            want = before[op] if op in triton_backend.TORCH_OPS else fn
            assert ops.lookup(op, "cpu") is want, op
    assert {op: ops.lookup(op, "cpu") for op in triton_backend.BACKEND} == before
    assert {"update_root", "update_divide", "update_multiply"} <= triton_backend.TORCH_OPS


def grid_cases() -> list[_identity.Case]:
    return [c for c in _identity.plan_grid(_precompile.default_grid()) if c.codec == NAME]


def test_the_default_exp_avg_codec_is_in_the_sweep_and_the_precompile_grid():
    with_kernel, without = _identity.kernel_codecs()
    assert NAME in with_kernel and NAME not in without and "exact" in without
    entries = [e for e in _precompile.default_grid() if e.codec == NAME]
    # The "smallest" preset's int3 (bits 4, qmax 3) at Checkpointer's block, every dtype.
    assert {(e.bits, e.block, dict(e.params)["qmax"], e.dtype, e.has_ref) for e in entries} == {
        (4, 128, 3, dtype, False) for dtype in _precompile.DTYPES
    }
    cases = grid_cases()
    assert len(cases) == 3 * len(entries)
    assert {c.variant for c in cases} == {"finite", "adversarial", "nonneg"}
    full = [c for c in _identity.plan([NAME, "blockwise"], dry_run=False) if c.codec == NAME]
    assert {(c.bits, c.block, c.extra) for c in full} == set(_identity.PARTNER_PARAMS)
    assert {c.layout for c in full} == {"contiguous", "offset", "transposed"}
    assert {c.dtype for c in full} == set(_identity.FLOATS)
    assert {c.numel for c in full} >= {1, 33, 4097, None}
    # The partner codec's cases come first, its edge sizes last (a budget cut loses the
    # rarest cases).
    order = [c for c in _identity.plan([NAME, "blockwise"], dry_run=False)]
    sized = [c for c in full if c.numel is not None]
    assert order[: len(full) - len(sized)] == [c for c in full if c.numel is None]
    assert order[-len(sized) :] == sized and len(sized) == 22
    dry = [c for c in _identity.plan([NAME], dry_run=True)]
    assert dry and {c.layout for c in dry} == {"contiguous", "offset", "transposed"}


def test_the_partner_inputs_hit_the_update_edges():
    (case,) = [c for c in grid_cases() if c.dtype == torch.float32 and c.variant == "adversarial"]
    x, ref = _identity.make_input(case, seed=0)
    v = _identity.make_partner(case, x, seed=0)
    assert ref is None and v.dtype == torch.float32 and v.shape == x.shape
    sizes = _precompile.group_sizes(x.numel())
    assert sizes == [4114, 4112, 33] and x.numel() == 8259 == _precompile.sizes(128)[2]
    finite = torch.isfinite(v)
    assert not finite[-sizes[-1] :].all() and finite[: -sizes[-1]].all(), "+inf only in the last member"
    assert (v[finite] >= 0).all()
    assert (v[: case.block] == 0).all() and (v[case.block : 2 * case.block] == torch.finfo(v.dtype).max).all()
    assert (v == 0).sum() > case.block and ((v > 0) & (v < torch.finfo(v.dtype).tiny)).any(), "subnormals"
    assert (v > 1e38).sum() > case.block and (v == 1e-16).any()
    assert torch.isnan(x).any() and (x.abs() > 1e38).any()
    u = x.float() / (v.sqrt() + 1e-8)
    assert (~torch.isfinite(u)).any() and torch.isfinite(u[sizes[0] : sizes[0] + sizes[1]]).all()


def test_the_partner_cases_match_the_cpu_on_both_device_paths():
    """The smoke grid's cases and the full sweep's layouts, sizes and params, on the device
    side through the grouped and the single-tensor ops (counted)."""
    calls = dict.fromkeys(GROUPED_OPS + ("quantize_blockwise", "dequantize_blockwise"), 0)

    def counting(op: str) -> Callable:
        def wrap(real: Callable) -> Callable:
            def fn(*args, **kwargs):
                calls[op] += 1
                return real(*args, **kwargs)

            return fn

        return wrap

    full = [c for c in _identity.plan([NAME], dry_run=False)]
    cases = grid_cases() + [c for c in full if c.layout != "contiguous" or c.numel in (33, 4097)]
    cases += [c for c in full if c.extra != (("qmax", 3),) and c.dtype == torch.bfloat16][:6]
    report = _identity.run_identity(
        KERNEL_DEVICE,
        dry_run=False,
        budget_s=1e9,
        cases=cases,
        device_side=lambda: device_side(**{op: counting(op) for op in calls}),
    )
    assert report.failures == [] and report.run == report.planned == len(cases)
    assert {c.layout for c in cases} == {"contiguous", "offset", "transposed"}
    assert len({(c.bits, c.block) for c in cases}) >= 3
    assert calls["quantize_blockwise_update_many"] == calls["dequantize_blockwise_update_many"] == len(cases)
    assert calls["quantize_blockwise"] == calls["dequantize_blockwise"] == len(cases)


def _flip_a_code(real: Callable) -> Callable:
    def fn(*args, **kwargs):
        out = real(*args, **kwargs)
        out[0][0][0] ^= 1
        return out

    return fn


def _drop_the_flags(real: Callable) -> Callable:
    def fn(*args, flags, **kwargs):
        return real(*args, flags=torch.zeros_like(flags), **kwargs)

    return fn


def _nudge_a_value(real: Callable) -> Callable:
    def fn(*args, **kwargs):
        out = real(*args, **kwargs)
        out[-1].view(-1)[0] = torch.nextafter(
            out[-1].view(-1)[0], torch.tensor(float("inf"), dtype=out[-1].dtype)
        )
        return out

    return fn


def _nudge_the_update(real: Callable) -> Callable:
    def fn(*args, **kwargs):
        u = real(*args, **kwargs)
        return torch.nextafter(u, torch.full_like(u, float("inf")))

    return fn


def _off_by_one_root(real: Callable) -> Callable:
    def fn(u, v, eps, big):
        return real(u, torch.nextafter(v, torch.full_like(v, float("inf"))), eps, big)

    return fn


BROKEN = {
    "a flipped code bit in the grouped encode": (
        "quantize_blockwise_update_many",
        _flip_a_code,
        "group member 0 of 3: buffer 'codes'",
    ),
    "an infinite partner not flagged by the grouped encode": (
        "quantize_blockwise_update_many",
        _drop_the_flags,
        "group member 2 of 3: unusable flag False on the device, True on the CPU",
    ),
    "a value off by one ulp in the grouped decode": (
        "dequantize_blockwise_update_many",
        _nudge_a_value,
        "group member 2 of 3: decoded tensor",
    ),
    "an update off by one ulp in the single encode": (
        "update_divide",
        _nudge_the_update,
        "alone: buffer 'scales'",
    ),
    "a partner off by one ulp in the single decode": (
        "update_multiply",
        _off_by_one_root,
        "alone: decoded tensor",
    ),
}


def test_a_wrong_device_result_fails_the_partner_case_and_the_step():
    (case,) = [c for c in grid_cases() if c.dtype == torch.float32 and c.variant == "adversarial"]
    codec = get_codec(NAME)
    assert _identity.run_case(codec, case, KERNEL_DEVICE, 0, device_side) == []
    for what, (op, wrap, expected) in BROKEN.items():
        problems = _identity.run_case(codec, case, KERNEL_DEVICE, 0, lambda: device_side(**{op: wrap}))
        assert any(p.startswith(expected) for p in problems), (what, problems)
        assert all(not p.startswith("alone") for p in problems) or op.startswith("update"), (what, problems)
    op, wrap, _ = BROKEN["an infinite partner not flagged by the grouped encode"]
    report = _identity.run_identity(
        KERNEL_DEVICE,
        dry_run=False,
        budget_s=1e9,
        cases=[case],
        device_side=lambda: device_side(**{op: wrap}),
    )
    step = validate._identity_step(report)
    assert report.run == 1 and step.status == "FAIL" and "unusable flag" in step.detail, step.detail
