"""Step (b) of the GPU validation: device vs CPU byte identity of every codec with a kernel.

For each codec of the registry that runs kernels (``has_kernel``, or coded with a partner:
``_precompile.launches_kernels``), each bits, block and dtype, a
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

A codec coded with a *partner* (``blockwise-update``: Adam's ``exp_avg`` as ``u = m /
(sqrt(v_hat) + eps)``, with ``v_hat`` its ``exp_avg_sq``'s decode) is compared the same
way on both of its device paths: one tensor at a time (``encode_with_partner``,
``decode_with_partner``) and as a group (``encode_group_with_partners``,
``decode_group_with_partners``: the grouped kernels a device save and load launch), each
member against the CPU's encode and decode of that member alone. Its partner is built to
hit the update's edges (:func:`make_partner`): zeros and subnormals (a denominator of
about ``eps``), values next to fp32's largest (a huge one), whole blocks of either, and in
the adversarial variant an infinite partner in the group's last member, which must raise
that member's flag alone.

:func:`kernels_on_cpu` lets the sweep run without a GPU as it does on one: the Triton
backend's kernels serve CPU tensors for the device side of each case (under
``TRITON_INTERPRET=1``, interpreted), the CPU backend the other; the tests run it that way.

Each distinct kernel specialization is compiled once by Triton (then cached on disk), which
is most of this step's time on a first run; the sweep is ordered so that the common cases
run first, and a case count short of the plan is reported as INCOMPLETE, never as a pass.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from _precompile import group_sizes, launches_kernels

from tw_triton import ops
from tw_triton.codecs import Codec, codec_names, get_codec
from tw_triton.delta_bits import QMAX_CHOICES, WIDEST, container
from tw_triton.ops.layout import qmax_for
from tw_triton.qstate import EncodedEntry

FLOATS = (torch.bfloat16, torch.float32, torch.float16)
ALL_BITS = (8, 4, 2)
ALL_BLOCKS = tuple(2**k for k in range(5, 13))  # 32 .. 4096
TILE = 4096  # elements per program of the kernels: inputs span at least two tiles
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
CPU = torch.device("cpu")
PARTNER = "partner"  # the partner path recorded in a partner codec's entries
# A partner codec's (bits, block, extra params): the "smallest" preset's int3 first
# (tw_triton.rules.UPDATE_DOMAIN: bits 4, qmax 3, block 128), then a small fixed grid.
PARTNER_PARAMS: tuple[tuple[int, int, tuple[tuple[str, Any], ...]], ...] = (
    (4, 128, (("qmax", 3),)),
    (8, 128, ()),
    (2, 32, ()),
    (4, 4096, ()),
)


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
    # A grouped encode's members' qmax (one grouped op, each member coded with its own);
    # empty: the single path.
    group_qmax: tuple[int, ...] = ()

    def label(self) -> str:
        ref = "none" if self.ref_dtype is None else _short(self.ref_dtype)
        n = "" if self.numel is None else f" n={self.numel}"
        more = "".join(f" {k}={v}" for k, v in self.extra)
        if self.group_qmax:
            more += " group qmax=" + "/".join(map(str, self.group_qmax))
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
    """``(names with a kernel, names without)`` from the registry; a codec coded with a
    partner runs kernels (``_precompile.launches_kernels``)."""
    with_k, without = [], []
    for name in codec_names():
        (with_k if launches_kernels(get_codec(name)) else without).append(name)
    return with_k, without


def has_partners(name: str) -> bool:
    return bool(getattr(get_codec(name), "has_partners", False))


@contextlib.contextmanager
def kernels_on_cpu() -> Iterator[None]:
    """The Triton backend serving CPU tensors for the ``with`` block: the device side of a
    case run on the CPU (under ``TRITON_INTERPRET=1``, the kernels interpreted). The ops
    served by torch's CUDA ops (``TORCH_OPS``) stay the CPU backend's: on CPU tensors
    torch runs its CPU code (whose fp32 ``sqrt`` may be 1 ulp off CUDA's ``sqrt.rn``),
    not what a GPU runs; only a GPU checks them."""
    from tw_triton.ops.backends import triton as triton_backend

    with contextlib.ExitStack() as stack:
        for op, fn in triton_backend.BACKEND.items():
            if op not in triton_backend.TORCH_OPS:
                stack.enter_context(ops.using(op, "cpu", fn))
        yield


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


def make_partner(case: Case, x: torch.Tensor, seed: int) -> torch.Tensor:
    """A float32 partner (``v_hat``) for ``x`` (1-D, on the CPU): Adam-like, ``x**2`` over
    a few decades, with zeros, subnormals (``sqrt(v) + eps`` about ``eps``), ``1e-16``
    (``sqrt(v)`` equal to ``eps``), values next to fp32's largest, a whole block of zeros
    and one of the largest value; the adversarial variant puts ``+inf`` in the last
    :func:`~_precompile.group_sizes` member (in the single path: the whole tensor)."""
    gen = torch.Generator().manual_seed(seed + 1)
    n, big = x.numel(), torch.finfo(torch.float32).max
    x64 = x.double().nan_to_num(nan=1.0, posinf=big, neginf=-big)
    v = x64 * x64 * torch.pow(10.0, torch.randn(n, generator=gen, dtype=torch.float64))
    pick = torch.rand(n, generator=gen, dtype=torch.float64)
    for lo, hi, value in ((0, 0.05, 0.0), (0.05, 0.08, 1e-44), (0.08, 0.1, 3e38), (0.1, 0.12, 1e-16)):
        v = torch.where((pick >= lo) & (pick < hi), torch.full_like(v, value), v)
    if n >= 2 * case.block:
        v[: case.block] = 0.0
        v[case.block : 2 * case.block] = big
    v = v.clamp(max=big).to(torch.float32)
    if case.variant == "adversarial":
        v[-min(5, n)] = float("inf")
    return v


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


def run_case(
    codec: Codec, case: Case, device: torch.device, seed: int, device_side: Callable = contextlib.nullcontext
) -> list[str]:
    """Encode and decode ``case`` on ``device`` and on the CPU; return the differences.
    ``device_side()`` is entered around the device's calls (:func:`kernels_on_cpu`)."""
    if getattr(codec, "has_partners", False):
        return run_partner_case(codec, case, device, seed, device_side)
    if case.group_qmax:
        return run_group_case(codec, case, device, seed, device_side)
    x_host, ref_host = make_input(case, seed)
    x_dev = lay_out(x_host, case.layout, device)
    x_cpu = lay_out(x_host, case.layout, torch.device("cpu"))
    ref_dev = None if ref_host is None else lay_out(ref_host, case.layout, device)
    ref_cpu = None if ref_host is None else lay_out(ref_host, case.layout, torch.device("cpu"))
    params = codec.resolve_params(dict(case.extra), bits=case.bits, block=case.block)
    if not codec.accepts(x_cpu):
        return []
    use_ref = codec.uses_reference(params)
    with device_side():
        enc_dev = codec.encode(x_dev, params, ref_dev if use_ref else None)
    enc_cpu = codec.encode(x_cpu, params, ref_cpu if use_ref else None)
    problems = compare_encoded(enc_dev, enc_cpu)
    if problems and problems[0].startswith("buffers "):
        return problems
    ctx = f"validate {case.label()}"
    with device_side():
        dec_dev = codec.decode(enc_dev.entry, ref_dev if use_ref else None, device, ctx)
    dec_cpu = codec.decode(enc_cpu.entry, ref_cpu if use_ref else None, CPU, ctx)
    return problems + compare_decoded(dec_dev, dec_cpu, device)


def compare_encoded(enc_dev: Any, enc_cpu: Any, what: str = "") -> list[str]:
    """The differences of two :class:`~tw_triton.codecs.Encoded`: buffers byte for byte,
    params and the unusable flag; ``what`` prefixes each."""
    problems = []
    bufs_dev, bufs_cpu = enc_dev.entry.buffers, enc_cpu.entry.buffers
    if sorted(bufs_dev) != sorted(bufs_cpu):
        return [f"{what}buffers {sorted(bufs_dev)} vs {sorted(bufs_cpu)}"]
    for name in sorted(bufs_cpu):
        d = bufs_dev[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        c = bufs_cpu[name].detach().contiguous().reshape(-1).view(torch.uint8)
        bad = same_bits(d, c)
        if bad:
            problems.append(f"{what}buffer {name!r}: {bad}")
    if enc_dev.entry.params != enc_cpu.entry.params:
        problems.append(f"{what}params {enc_dev.entry.params} vs {enc_cpu.entry.params}")
    flags = [None if e.unusable is None else bool(e.unusable.cpu()) for e in (enc_dev, enc_cpu)]
    if flags[0] != flags[1]:
        problems.append(f"{what}unusable flag {flags[0]} on the device, {flags[1]} on the CPU")
    return problems


def compare_decoded(
    dec_dev: torch.Tensor, dec_cpu: torch.Tensor, device: torch.device, what: str = ""
) -> list[str]:
    """The differences of two decoded tensors (bit for bit), and a decode off ``device``."""
    problems = []
    if dec_dev.device.type != device.type:
        problems.append(f"{what}decoded on {dec_dev.device}, expected {device}")
    bad = same_bits(dec_dev.cpu(), dec_cpu)
    if bad:
        problems.append(f"{what}decoded tensor: {bad}")
    return problems


def run_group_case(
    codec: Codec, case: Case, device: torch.device, seed: int, device_side: Callable = contextlib.nullcontext
) -> list[str]:
    """A grouped encode (and the closed-loop advance's grouped decode) of the case's input
    split into :func:`~_precompile.group_sizes` members, member ``i`` coded with
    ``case.group_qmax[i]`` levels in one launch group, each against the CPU's single
    encode and decode of that member alone."""
    x_host, ref_host = make_input(case, seed)
    ctx = f"validate {case.label()}"
    sizes = group_sizes(x_host.numel())
    xs, refs = x_host.split(sizes), [None] * len(sizes) if ref_host is None else ref_host.split(sizes)
    each = [codec.resolve_params({"qmax": q}, bits=case.bits, block=case.block) for q in case.group_qmax]
    problems = []
    on_device = [(x.to(device), None if r is None else r.to(device)) for x, r in zip(xs, refs)]
    flags = torch.zeros(len(xs), dtype=torch.int64, device=device)
    dev_refs = None if ref_host is None else [r for _, r in on_device]
    with device_side():
        encs = codec.encode_group([x for x, _ in on_device], each[0], dev_refs, flags, each=each)
        if dev_refs is not None:
            decs = codec.decode_group([e.entry for e in encs], dev_refs, device, [ctx] * len(xs))
        else:
            decs = [codec.decode(e.entry, None, device, ctx) for e in encs]
    for i, (x, r, params) in enumerate(zip(xs, refs, each)):
        what = f"group member {i} of {len(xs)} (qmax {case.group_qmax[i]}): "
        enc_cpu = codec.encode(x, params, r)
        problems += compare_encoded(encs[i], enc_cpu, what)
        problems += compare_decoded(decs[i], codec.decode(enc_cpu.entry, r, CPU, ctx), device, what)
    return problems


def run_partner_case(
    codec: Codec, case: Case, device: torch.device, seed: int, device_side: Callable = contextlib.nullcontext
) -> list[str]:
    """A partner codec's case: its single and grouped paths on ``device`` against the CPU's
    single path, member by member (see the module doc)."""
    x_host, _ = make_input(case, seed)
    v_host = make_partner(case, x_host, seed)
    params = codec.resolve_params(dict(case.extra), bits=case.bits, block=case.block)
    ctx = f"validate {case.label()}"
    sizes = group_sizes(x_host.numel(), 3 if case.layout == "transposed" else 1)
    on_cpu = (
        [(x_host, v_host)]
        if len(sizes) == 1
        else [(x_host, v_host), *zip(x_host.split(sizes), v_host.split(sizes))]
    )
    cpu_encs, cpu_decs = [], []
    for x, v in on_cpu:
        x_cpu, v_cpu = lay_out(x, case.layout, CPU), lay_out(v, case.layout, CPU)
        enc = codec.encode_with_partner(x_cpu, params, PARTNER, v_cpu, None)  # type: ignore[attr-defined]
        cpu_encs.append(enc)
        cpu_decs.append(codec.decode_with_partner(enc.entry, v_cpu, CPU, ctx))  # type: ignore[attr-defined]
    x_dev, v_dev = lay_out(x_host, case.layout, device), lay_out(v_host, case.layout, device)
    with device_side():
        enc = codec.encode_with_partner(x_dev, params, PARTNER, v_dev, None)  # type: ignore[attr-defined]
        dec = codec.decode_with_partner(enc.entry, v_dev, device, ctx)  # type: ignore[attr-defined]
    problems = compare_encoded(enc, cpu_encs[0], "alone: ") + compare_decoded(
        dec, cpu_decs[0], device, "alone: "
    )
    xs = [lay_out(x, case.layout, device) for x in x_host.split(sizes)]
    vs = [lay_out(v, case.layout, device) for v in v_host.split(sizes)]
    flags = torch.zeros(len(xs), dtype=torch.int64, device=device)
    with device_side():
        encs = codec.encode_group_with_partners(xs, params, [PARTNER] * len(xs), vs, flags)  # type: ignore[attr-defined]
        entries: list[EncodedEntry] = [e.entry for e in encs]
        decs = codec.decode_group_with_partners(entries, vs, device, [ctx] * len(xs))  # type: ignore[attr-defined]
    for i, (e, d) in enumerate(zip(encs, decs)):
        what = f"group member {i} of {len(xs)}: "
        problems += compare_encoded(e, cpu_encs[-len(xs) + i], what)
        problems += compare_decoded(d, cpu_decs[-len(xs) + i], device, what)
    return problems


# ------------------------------------------------------------------------------ plan


def accepted(case: Case) -> bool:
    """Whether the case's codec takes its dtype (``log2-temporal``: float32 only)."""
    return get_codec(case.codec).accepts(torch.empty(1, dtype=case.dtype))


def plan(codecs: list[str], dry_run: bool) -> Iterator[Case]:
    """The cases the codecs take, most important first (a budget cut loses the rarest ones):
    the partner codecs' (a few, the default preset's ``exp_avg``) before the others', their
    edge sizes (each a compile of its own on a first run) last."""
    partnered = [n for n in codecs if has_partners(n)]
    plain = [n for n in codecs if not has_partners(n)]
    cases = itertools.chain(
        _partner_plan(partnered, dry_run), _plan(plain, dry_run), _partner_sizes(partnered, dry_run)
    )
    return filter(accepted, cases)


def _partner_plan(codecs: list[str], dry_run: bool) -> Iterator[Case]:
    """A partner codec's cases at :data:`PARTNER_PARAMS` (the dry run: the first two)."""
    grid = PARTNER_PARAMS[:2] if dry_run else PARTNER_PARAMS
    variants = ("adversarial", "nonneg") if dry_run else ("finite", "adversarial", "nonneg")
    for name, (bits, block, extra), dtype in itertools.product(codecs, grid, FLOATS):
        for variant in variants:
            yield Case(name, bits, block, dtype, variant, "contiguous", None, extra=extra)
    # Misaligned and transposed tensors and partners (the group's launcher copies them).
    for name, (bits, block, extra), dtype in itertools.product(codecs, PARTNER_PARAMS[:2], FLOATS):
        for layout in ("offset", "transposed"):
            yield Case(name, bits, block, dtype, "adversarial", layout, None, extra=extra)


def _partner_sizes(codecs: list[str], dry_run: bool) -> Iterator[Case]:
    """Sizes around block and tile edges (a group of one below 100 elements), at the
    default's params; none in the dry run."""
    if dry_run:
        return
    bits, block, extra = PARTNER_PARAMS[0]
    for name, dtype in itertools.product(codecs, (torch.float32, torch.bfloat16)):
        for numel in (1, 2, 3, 5, 31, 33, 127, 129, 4095, 4097, 3 * 4096 + 1):
            yield Case(name, bits, block, dtype, "finite", "contiguous", None, numel, extra)


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
    sizes that launch whole tiles and a masked tail (a partner codec's entry: both of its
    paths, the grouped one on :func:`~_precompile.group_sizes`, as the precompile ran
    them). The same fixed grid on every device."""
    out = []
    for e in grid:
        extra = tuple((k, v) for k, v in e.params if k not in ("bits", "block", "packing"))
        dtype = getattr(torch, e.dtype)
        ref = dtype if e.has_ref else None
        for variant in ("finite", "adversarial", "nonneg"):
            out.append(Case(e.codec, e.bits, e.block, dtype, variant, "contiguous", ref, extra=extra))
        if e.codec == "blockwise" and e.has_ref and not extra and ladder_qmax(e.bits):
            # A weight delta's max_error choice (tw_triton.delta_bits) codes fewer levels in
            # this container: the same binary, qmax a runtime value (a column of the grouped
            # kernel's table), so its arithmetic is checked alone and in a group whose
            # members each have their own.
            mixed = (qmax_for(e.bits), ladder_qmax(e.bits)[0], ladder_qmax(e.bits)[-1])
            for variant in ("finite", "adversarial"):
                for q in ladder_qmax(e.bits):
                    out.append(
                        Case(
                            e.codec, e.bits, e.block, dtype, variant, "contiguous", ref, extra=(("qmax", q),)
                        )
                    )
                out.append(
                    Case(e.codec, e.bits, e.block, dtype, variant, "contiguous", ref, group_qmax=mixed)
                )
    return out


def ladder_qmax(bits: int) -> list[int]:
    """``qmax`` below the container's full range that the ``max_error`` choice codes in a
    ``bits`` container (it takes any, :data:`~tw_triton.delta_bits.QMAX_CHOICES`) and the
    grid checks: the smallest, each old width's (3 in 4 bits; 15, 31, 63 in 8), the largest
    and, in 8 bits, one between."""
    inside = [q for q in QMAX_CHOICES if container(q) == bits and q < qmax_for(bits)]
    if not inside:
        return []
    widths = [qmax_for(w) for w in range(2, WIDEST) if qmax_for(w) in inside]
    return sorted({inside[0], *widths, *([100] if 100 in inside else []), inside[-1]})


def run_identity(
    device: torch.device,
    *,
    dry_run: bool,
    budget_s: float,
    log: Callable[[str], None] = lambda _: None,
    codecs: list[str] | None = None,
    cases: list[Case] | None = None,
    device_side: Callable = contextlib.nullcontext,
) -> IdentityReport:
    """Run the plan (or ``cases``) until done or ``budget_s`` is spent; a failure never
    stops the sweep. ``device_side``: as :func:`run_case`'s."""
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
            problems = run_case(get_codec(case.codec), case, device, seed=i, device_side=device_side)
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
