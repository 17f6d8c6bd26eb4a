"""Step (b) of the GPU validation: device vs CPU byte identity of every codec with a kernel.

For each codec of the registry that declares ``has_kernel``, each bits, block and dtype, a
case encodes the same logical tensor on the device and on the CPU (the torch path, the
specification) through the :class:`~tw_triton.codecs.Codec` interface, and requires

* the same buffers, byte for byte (codes, scales, bounds: whatever the codec stores),
* the same "unusable" flag (a NaN/Inf block, a negative element for ``log2``),
* the same decoded tensor, bit for bit (NaN matches NaN), each side decoding its own entry.

Nothing here knows a codec's buffers or input domain: a codec registered later is covered as
soon as it sets ``has_kernel = True``. Inputs are built to hit the edges of every codec:
exact and near ties at each ``qmax``, subnormals, values next to the dtype's largest,
blocks of zeros, ``-0.0``, NaN and +-Inf, a reference whose difference overflows, sizes
that are not a multiple of the block (partial tiles, odd counts at 4 and 2 bits),
non-contiguous (transposed) tensors, and slices at an odd element offset (a pointer that
is not 16-byte aligned, which Triton compiles as a separate, unvectorized specialization).

Each distinct kernel specialization is compiled once by Triton (then cached on disk), which
is most of this step's time on a first run; the sweep is ordered so that the common cases
run first, and a case count short of the plan is reported as INCOMPLETE, never as a pass.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tw_triton.codecs import Codec, codec_names, get_codec

FLOATS = (torch.bfloat16, torch.float32, torch.float16)
ALL_BITS = (8, 4, 2)
ALL_BLOCKS = tuple(2**k for k in range(5, 13))  # 32 .. 4096
TILE = 4096  # elements per program of the kernels: inputs span at least two tiles
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


@dataclass(frozen=True)
class Case:
    """One comparison: a codec at bits/block on a dtype, an input variant and a layout."""

    codec: str
    bits: int
    block: int
    dtype: torch.dtype
    variant: str  # "adversarial", "finite" or "nonneg"
    layout: str  # "contiguous", "transposed" or "offset"
    ref_dtype: torch.dtype | None  # None: no reference
    numel: int | None = None  # None: the default size for the block
    extra: tuple[tuple[str, Any], ...] = ()  # more codec params (e.g. qmax), sorted

    def label(self) -> str:
        ref = "none" if self.ref_dtype is None else _short(self.ref_dtype)
        n = "" if self.numel is None else f" n={self.numel}"
        more = "".join(f" {k}={v}" for k, v in self.extra)
        return (
            f"{self.codec} bits={self.bits} block={self.block}{more} {_short(self.dtype)} ref={ref} "
            f"{self.variant} {self.layout}{n}"
        )


@dataclass
class IdentityReport:
    planned: int = 0
    run: int = 0
    failures: list[str] = field(default_factory=list)
    codecs: list[str] = field(default_factory=list)
    without_kernel: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def kernel_codecs() -> tuple[list[str], list[str]]:
    """``(names with a kernel, names without)`` from the registry."""
    with_k, without = [], []
    for name in codec_names():
        codec = get_codec(name)
        (with_k if getattr(codec, "has_kernel", False) else without).append(name)
    return with_k, without


# ------------------------------------------------------------------------------ inputs


def _segments(dtype: torch.dtype, block: int, variant: str, gen: torch.Generator) -> list[torch.Tensor]:
    """fp64 pieces of ``2 * block`` elements, each aimed at one edge of the codecs."""
    n = 2 * block
    fi = torch.finfo(dtype)
    tiny = {torch.float32: 1e-40, torch.float16: 1e-6, torch.bfloat16: 1e-39}[dtype]

    def randn() -> torch.Tensor:
        return torch.randn(n, generator=gen, dtype=torch.float64)

    out = [randn() * 10.0 ** (6 * torch.rand(n, generator=gen, dtype=torch.float64) - 3)]
    # Exact ties: (k + 1/2) * 2**-4 with the block's absmax exactly qmax * 2**-4, so d / s
    # is a half-integer for each qmax (127, 7, 1); near ties one fp32 ulp either side.
    for qmax in (127, 7, 1):
        k = torch.randint(-qmax, qmax, (n,), generator=gen).double() + 0.5
        k[::block] = qmax
        out.append(k / 16)
        if dtype == torch.float32:
            wiggle = 1 + (torch.randint(-1, 2, (n,), generator=gen).double() * 2.0**-23)
            out.append(k / 16 * wiggle)
    out.append(randn() * tiny)  # subnormals of the dtype
    huge = randn().sign() * fi.max * (0.5 + 0.5 * torch.rand(n, generator=gen, dtype=torch.float64))
    out.append(huge)
    mixed = randn() * tiny
    mixed[::7] = fi.max / 3
    out.append(mixed)  # one huge value among subnormals: most codes round to zero
    out.append(torch.zeros(n, dtype=torch.float64))
    out.append(torch.full((n,), 0.75, dtype=torch.float64))  # one distinct value
    neg_zero = randn()
    neg_zero[::3] = -0.0
    out.append(neg_zero)
    if variant == "adversarial":
        special = randn()
        special[5] = float("nan")
        special[n // 2] = float("inf")
        special[n - 1] = float("-inf")
        out.append(special)
    return out


def make_input(case: Case, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The case's logical tensor and reference on the CPU (contiguous, 1-D)."""
    gen = torch.Generator().manual_seed(seed)
    parts = _segments(case.dtype, case.block, case.variant, gen)
    x64 = torch.cat(parts)
    if case.numel is not None:
        x64 = x64.repeat(-(-case.numel // x64.numel()))[: case.numel]
    else:
        # Two whole tiles at least (unmasked launch) plus a partial block (masked tail).
        want = max(x64.numel(), 2 * TILE) + case.block // 2 + 3
        if case.layout == "transposed":
            want += (-want) % 3
        extra = want - x64.numel()
        if extra > 0:
            x64 = torch.cat([x64, torch.randn(extra, generator=gen, dtype=torch.float64)])
    if case.variant == "nonneg":
        x64 = x64.abs()
    x = x64.to(case.dtype)
    if case.ref_dtype is None:
        return x, None
    ref64 = x.double() + torch.randn(x.numel(), generator=gen, dtype=torch.float64) * 1e-2 * x.double().abs()
    if case.variant == "adversarial":
        # A reference of the other sign next to the largest values: the difference overflows.
        ref64 = torch.where(x.double().abs() > torch.finfo(case.dtype).max / 4, -x.double(), ref64)
    return x, ref64.to(case.ref_dtype)


def lay_out(t: torch.Tensor, layout: str, device: torch.device) -> torch.Tensor:
    """``t`` (1-D) on ``device`` as a contiguous, transposed or odd-offset tensor."""
    if layout == "contiguous":
        return t.to(device)
    if layout == "transposed":
        # Logical row-major order = t: a (n/3, 3) tensor stored as the transpose of (3, n/3).
        return t.view(-1, 3).t().contiguous().to(device).t()
    if layout == "offset":
        storage = torch.empty(t.numel() + 1, dtype=t.dtype, device=device)
        view = storage[1:]
        view.copy_(t.to(device))
        return view
    raise ValueError(f"unknown layout {layout!r}")


# ------------------------------------------------------------------------------ compare


def same_bits(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """``None`` if ``a`` and ``b`` (CPU) hold the same bits, else a short description."""
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return f"{a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if a.is_floating_point():
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        if not torch.equal(nan_a, nan_b):
            return f"NaN at different positions ({int((nan_a != nan_b).sum())})"
        view = INT_VIEW.get(a.dtype, torch.int64 if a.element_size() == 8 else None)
        a, b = a[~nan_a].view(view), b[~nan_b].view(view)
    if torch.equal(a, b):
        return None
    diff = (a.reshape(-1) != b.reshape(-1)).nonzero().flatten()
    return f"{diff.numel()} of {a.numel()} differ, first at {diff[:4].tolist()}"


def run_case(codec: Codec, case: Case, device: torch.device, seed: int) -> list[str]:
    """Encode and decode ``case`` on ``device`` and on the CPU; return the differences."""
    x_host, ref_host = make_input(case, seed)
    x_dev = lay_out(x_host, case.layout, device)
    x_cpu = lay_out(x_host, case.layout, torch.device("cpu"))
    ref_dev = None if ref_host is None else lay_out(ref_host, case.layout, device)
    ref_cpu = None if ref_host is None else lay_out(ref_host, case.layout, torch.device("cpu"))
    params = codec.resolve_params(dict(case.extra), bits=case.bits, block=case.block)
    if not codec.accepts(x_cpu):
        return []
    use_ref = codec.uses_reference(params)
    enc_dev = codec.encode(x_dev, params, ref_dev if use_ref else None)
    enc_cpu = codec.encode(x_cpu, params, ref_cpu if use_ref else None)
    problems = []
    bufs_dev, bufs_cpu = enc_dev.entry.buffers, enc_cpu.entry.buffers
    if sorted(bufs_dev) != sorted(bufs_cpu):
        return [f"buffers {sorted(bufs_dev)} vs {sorted(bufs_cpu)}"]
    for name in sorted(bufs_cpu):
        d = bufs_dev[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        c = bufs_cpu[name].detach().contiguous().reshape(-1).view(torch.uint8)
        bad = same_bits(d, c)
        if bad:
            problems.append(f"buffer {name!r}: {bad}")
    if enc_dev.entry.params != enc_cpu.entry.params:
        problems.append(f"params {enc_dev.entry.params} vs {enc_cpu.entry.params}")
    flags = [None if e.unusable is None else bool(e.unusable.cpu()) for e in (enc_dev, enc_cpu)]
    if flags[0] != flags[1]:
        problems.append(f"unusable flag {flags[0]} on the device, {flags[1]} on the CPU")
    ctx = f"validate {case.label()}"
    dec_dev = codec.decode(enc_dev.entry, ref_dev if use_ref else None, device, ctx)
    dec_cpu = codec.decode(enc_cpu.entry, ref_cpu if use_ref else None, torch.device("cpu"), ctx)
    if dec_dev.device.type != device.type:
        problems.append(f"decoded on {dec_dev.device}, expected {device}")
    bad = same_bits(dec_dev.cpu(), dec_cpu)
    if bad:
        problems.append(f"decoded tensor: {bad}")
    return problems


# ------------------------------------------------------------------------------ plan


def accepted(case: Case) -> bool:
    """Whether the case's codec takes its dtype (``log2-temporal``: float32 only)."""
    return get_codec(case.codec).accepts(torch.empty(1, dtype=case.dtype))


def plan(codecs: list[str], dry_run: bool) -> Iterator[Case]:
    """The cases the codecs take, most important first (a budget cut loses the rarest ones)."""
    return filter(accepted, _plan(codecs, dry_run))


def _plan(codecs: list[str], dry_run: bool) -> Iterator[Case]:

    def ref_options(name: str, dtype: torch.dtype) -> tuple[torch.dtype | None, ...]:
        codec = get_codec(name)
        delta = codec.uses_reference(codec.resolve_params({}, bits=8, block=128))
        return (None, dtype) if delta else (None,)

    if dry_run:
        # The harness on tiny sizes: every variant and layout once, two blocks.
        for name, bits, block, dtype in itertools.product(codecs, (8, 4), (32, 128), FLOATS):
            for ref in ref_options(name, dtype):
                for variant in ("adversarial", "nonneg"):
                    yield Case(name, bits, block, dtype, variant, "contiguous", ref)
            yield Case(name, bits, block, dtype, "finite", "offset", ref_options(name, dtype)[-1])
            yield Case(name, bits, block, dtype, "finite", "transposed", ref_options(name, dtype)[-1])
        return
    # 1. Every bits x block on bf16 (the training dtype), with and without a reference.
    for name, bits, block in itertools.product(codecs, ALL_BITS, ALL_BLOCKS):
        for ref in ref_options(name, torch.bfloat16):
            for variant in ("adversarial", "finite", "nonneg"):
                yield Case(name, bits, block, torch.bfloat16, variant, "contiguous", ref)
    # 2. Misaligned and non-contiguous views, every dtype and bits.
    for name, bits, dtype, layout in itertools.product(codecs, ALL_BITS, FLOATS, ("offset", "transposed")):
        for block in (32, 128):
            for ref in ref_options(name, dtype):
                yield Case(name, bits, block, dtype, "finite", layout, ref)
    # 3. Sizes around block and tile edges (odd counts leave half-filled bytes at 4, 2 bits).
    for name, bits, dtype in itertools.product(codecs, ALL_BITS, (torch.float32, torch.bfloat16)):
        for numel in (1, 2, 3, 5, 31, 33, 127, 129, 4095, 4097, 3 * 4096 + 1):
            yield Case(name, bits, 128, dtype, "finite", "contiguous", ref_options(name, dtype)[-1], numel)
    # 4. fp32 and fp16 at a few blocks; references of another dtype.
    for name, bits, block, dtype in itertools.product(codecs, ALL_BITS, (32, 128, 4096), FLOATS[1:]):
        for ref in ref_options(name, dtype):
            for variant in ("adversarial", "nonneg"):
                yield Case(name, bits, block, dtype, variant, "contiguous", ref)
    for name, bits, dtype, ref in itertools.product(codecs, ALL_BITS, FLOATS, FLOATS):
        if ref != dtype and ref_options(name, dtype)[-1] is not None:
            yield Case(name, bits, 128, dtype, "adversarial", "contiguous", ref)
    # 5. The remaining blocks for fp32 and fp16.
    for name, bits, block, dtype in itertools.product(codecs, ALL_BITS, ALL_BLOCKS, FLOATS[1:]):
        if block not in (32, 128, 4096):
            yield Case(name, bits, block, dtype, "adversarial", "contiguous", ref_options(name, dtype)[-1])


def plan_grid(grid: list[Any]) -> list[Case]:
    """The smoke test's cases: each entry of the default kernel grid (``_precompile.Entry``:
    the variants the presets launch) on random, adversarial and non-negative inputs, in the
    sizes that launch whole tiles and a masked tail. The same fixed grid on every device."""
    out = []
    for e in grid:
        extra = tuple((k, v) for k, v in e.params if k not in ("bits", "block", "packing"))
        dtype = getattr(torch, e.dtype)
        for variant in ("finite", "adversarial", "nonneg"):
            ref = dtype if e.has_ref else None
            out.append(Case(e.codec, e.bits, e.block, dtype, variant, "contiguous", ref, extra=extra))
    return out


def run_identity(
    device: torch.device,
    *,
    dry_run: bool,
    budget_s: float,
    log: Callable[[str], None] = lambda _: None,
    codecs: list[str] | None = None,
    cases: list[Case] | None = None,
) -> IdentityReport:
    """Run the plan (or ``cases``) until done or ``budget_s`` is spent; a failure never
    stops the sweep."""
    with_k, without = kernel_codecs()
    names = with_k if codecs is None else codecs
    if cases is not None:
        names = sorted({c.codec for c in cases})
    report = IdentityReport(codecs=names, without_kernel=without)
    cases = list(plan(names, dry_run)) if cases is None else cases
    report.planned = len(cases)
    start = time.perf_counter()
    for i, case in enumerate(cases):
        if time.perf_counter() - start > budget_s:
            log(f"identity: budget of {budget_s:.0f} s spent after {report.run} of {report.planned} cases")
            break
        try:
            problems = run_case(get_codec(case.codec), case, device, seed=i)
        except Exception as exc:  # noqa: BLE001 - a crash in one case is that case's failure
            problems = [f"raised {type(exc).__name__}: {exc}"]
        report.run += 1
        for p in problems:
            report.failures.append(f"{case.label()}: {p}")
        if problems:
            log(f"identity FAIL {case.label()}: {problems[0]}")
    report.seconds = time.perf_counter() - start
    return report


def as_json(report: IdentityReport) -> dict[str, Any]:
    return {
        "codecs": report.codecs,
        "codecs_without_kernel": report.without_kernel,
        "cases_planned": report.planned,
        "cases_run": report.run,
        "failures": report.failures[:200],
        "failure_count": len(report.failures),
        "seconds": round(report.seconds, 2),
    }
