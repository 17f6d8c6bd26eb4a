"""Step (c) of the GPU validation: codec throughput beside a device-to-device copy.

Every codec with a kernel is timed through its :class:`~tw_triton.codecs.Codec` interface
(what the state API calls: the kernel launches, the output allocations and the device-side
NaN/Inf flag), encode and decode, on bf16 (with a bf16 reference for a delta codec) and fp32
inputs of 64 MiB and more. Its bandwidth counts the bytes it must move (input, reference
and the encoded buffers for an encode; encoded buffers, reference and output for a decode),
and is set beside the bandwidth of ``dst.copy_(src)`` moving the same number of bytes
(half read, half written), timed in the same run with the same timer:
``triton.testing.do_bench`` (median) on CUDA, a ``perf_counter`` loop (median) on the CPU.

Goal on a GPU: >= 85 % of copy bandwidth from 64 MiB up. The goal is reported, it does
not fail the validation (correctness steps do).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from tw_triton.codecs import get_codec

GOAL_FRACTION = 0.85
GOAL_MIN_BYTES = 64 << 20


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def bench_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """Median milliseconds of ``fn``: ``do_bench`` on CUDA, a timed loop on the CPU."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))
    fn()
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _copy_ms(nbytes: int, device: torch.device) -> float:
    """Milliseconds to copy ``nbytes / 2`` bytes (``nbytes`` moved) on ``device``."""
    half = max(1, nbytes // 2)
    src = torch.empty(half, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    return bench_ms(lambda: dst.copy_(src), device)


def run_throughput(
    device: torch.device,
    *,
    sizes_bytes: tuple[int, ...],
    codecs: list[str],
    budget_s: float,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Time every codec x op x dtype x bits at each size; rows of the result table."""
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    complete = True
    gen = torch.Generator(device=device).manual_seed(0)
    for size in sizes_bytes:
        for name in codecs:
            codec = get_codec(name)
            for dtype in (torch.bfloat16, torch.float32):
                if not codec.accepts(torch.empty(1, dtype=dtype)):
                    continue  # log2-temporal: float32 only
                numel = size // torch.empty((), dtype=dtype).element_size()
                x = torch.randn(numel, dtype=dtype, device=device, generator=gen)
                ref = None
                for bits in (8, 4):
                    if time.perf_counter() - start > budget_s:
                        complete = False
                        break
                    params = codec.resolve_params({}, bits=bits, block=128)
                    if codec.uses_reference(params):
                        if ref is None:
                            ref = x + 1e-2 * torch.randn(numel, dtype=dtype, device=device, generator=gen)
                        r = ref
                    else:
                        r = None
                    # Non-negative inputs for codecs that only code those (log2, and
                    # log2-temporal, whose reference is then near it): abs costs nothing in
                    # the timing, it is done once here.
                    nonneg = name.startswith("log2")
                    src = x.abs() if nonneg else x
                    if nonneg and r is not None:
                        r = r.abs()
                    enc = codec.encode(src, params, r)
                    enc_bytes = sum(_nbytes(b) for b in enc.entry.buffers.values())
                    in_bytes = _nbytes(src) + (0 if r is None else _nbytes(r))
                    ops = {
                        "encode": (lambda: codec.encode(src, params, r), in_bytes + enc_bytes),
                        "decode": (
                            lambda: codec.decode(enc.entry, r, device, "throughput"),
                            enc_bytes + (0 if r is None else _nbytes(r)) + _nbytes(src),
                        ),
                    }
                    for op, (fn, moved) in ops.items():
                        ms = bench_ms(fn, device)
                        copy_ms = _copy_ms(moved, device)
                        gbps = moved / ms / 1e6
                        copy_gbps = moved / copy_ms / 1e6
                        frac = gbps / copy_gbps
                        row = {
                            "codec": name,
                            "op": op,
                            "dtype": str(dtype).removeprefix("torch."),
                            "reference": r is not None,
                            "bits": bits,
                            "block": 128,
                            "input_mib": round(size / (1 << 20), 1),
                            "bytes_moved": moved,
                            "ms": round(ms, 4),
                            "gb_per_s": round(gbps, 2),
                            # Elements a second, whatever the dtype: equal in bf16 and fp32
                            # where the arithmetic, not the memory, is the bound.
                            "g_elements_per_s": float(f"{numel / ms / 1e6:.4g}"),  # > 0 on a slow CPU too
                            "copy_gb_per_s": round(copy_gbps, 2),
                            "fraction_of_copy": round(frac, 4),
                        }
                        if device.type == "cuda" and size >= GOAL_MIN_BYTES:
                            row["goal_met"] = frac >= GOAL_FRACTION
                        rows.append(row)
                        log(
                            f"throughput {name} {op} {row['dtype']} bits={bits} "
                            f"{row['input_mib']} MiB: {gbps:.1f} GB/s = {100 * frac:.0f} % of copy"
                        )
                del x, ref
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    goal_rows = [r for r in rows if "goal_met" in r]
    return {
        "rows": rows,
        "complete": complete,
        "seconds": round(time.perf_counter() - start, 2),
        "goal": f">= {int(GOAL_FRACTION * 100)} % of copy bandwidth from {GOAL_MIN_BYTES >> 20} MiB",
        "goal_met": (all(r["goal_met"] for r in goal_rows) if goal_rows else None),
    }
