"""The kernel variant grid the defaults use, and its parallel precompile (GPU validation).

Triton compiles one binary per specialization of a kernel: its ``constexpr`` arguments
(``BITS``, ``BLOCK``, ``ROWS``, ``HAS_REF``, ``MASKED``; not the encode's ``qmax``, a
runtime value), its pointer dtypes and alignment, and whether ``n`` is a multiple of 16.
On a cold cache each costs about a second or more, one after the other in the process that launches; the grid the defaults use is
compiled here first, by a pool of processes (one per core) that each run a share of it on
the device and so fill the shared on-disk cache (``TRITON_CACHE_DIR``), before anything is
timed. Running each variant through the codec (instead of triton's AOT API) makes the
specialization exactly the one a save or a load launches.

The grid is derived, not listed: the rules of every preset in ``tw_triton.rules.PRESETS``
(``Checkpointer``'s default ``bits`` and ``block``), resolved on an LM-shaped state; each
rule whose codec has a kernel gives an entry per float dtype, with and without a reference
if the codec codes deltas. A codec coded with a partner (``blockwise-update``: Adam's
``exp_avg`` in the update's domain, with its ``exp_avg_sq``) gives an entry per float dtype
too: its device ops are kernels (the grouped encode and decode with partners, the
blockwise kernels of one tensor at a time). Each entry runs encode and decode at three
sizes: whole tiles only, and with a masked tail at an ``n`` that is and is not a multiple of
16; an entry without a reference also runs the grouped sparsity count of its tensor, and a
blockwise entry the grouped statistics of the ``max_error`` bits choice. A partner entry
runs both of its paths at each size: one tensor alone, and the tensor split into the group
of :func:`group_sizes` (the grouped kernels specialize on a group's table, so the identity
sweep's groups are split the same way).

Under ``TRITON_INTERPRET=1`` or without CUDA nothing compiles: :func:`precompile` lists the
grid and its shares and returns (the pool itself is tested on the CPU by running the CPU
codec in it).
"""

from __future__ import annotations

import inspect
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from tw_triton import Checkpointer, ops
from tw_triton.codecs import get_codec
from tw_triton.rules import PRESETS, resolve_rules

DTYPES = ("bfloat16", "float32", "float16")
# Rule params that select no kernel variant: ``delta`` only decides whether a reference is
# passed, which ``Entry.has_ref`` records (a delta rule codes its keyframe without one).
NOT_KERNEL_PARAMS = ("delta",)
TILE = 4096  # elements per program (kernels/tiles.py TILE_ELEMENTS)


@dataclass(frozen=True)
class Entry:
    """One codec configuration on one dtype: what a save or load with the defaults codes."""

    codec: str
    params: tuple[tuple[str, Any], ...]  # resolved codec params, sorted
    dtype: str
    has_ref: bool

    @property
    def bits(self) -> int:
        return dict(self.params)["bits"]

    @property
    def block(self) -> int:
        return dict(self.params)["block"]

    def label(self) -> str:
        extra = {k: v for k, v in self.params if k not in ("bits", "block", "packing")}
        more = "".join(f" {k}={v}" for k, v in sorted(extra.items()))
        return (
            f"{self.codec} bits={self.bits} block={self.block}{more} {self.dtype} "
            f"{'ref' if self.has_ref else 'noref'}"
        )


def launches_kernels(codec: Any) -> bool:
    """Whether ``codec`` runs kernels on a device: it declares ``has_kernel``, or it is
    coded with a partner (its grouped ops and its inner codec's are kernels)."""
    return bool(getattr(codec, "has_kernel", False) or getattr(codec, "has_partners", False))


def default_bits_block() -> tuple[int, int]:
    """``Checkpointer``'s default ``bits`` and ``block`` (read from its signature)."""
    sig = inspect.signature(Checkpointer.__init__).parameters
    return sig["bits"].default, sig["block"].default


def _lm_state() -> dict[str, Any]:
    """An LM-shaped state (a model and AdamW moments) for resolving the presets' rules."""
    w = torch.zeros(64, 64)
    return {
        "model": {"layer.weight": w},
        "optimizer": {
            "state": {0: {"step": torch.tensor(1.0), "exp_avg": w, "exp_avg_sq": w}},
            "param_groups": [{"params": [0], "lr": 1e-3}],
        },
    }


def preset_rules() -> dict[str, list]:
    """Every preset's resolved rules at the default bits and block."""
    bits, block = default_bits_block()
    return {p: resolve_rules(p, _lm_state(), bits=bits, block=block) for p in PRESETS}


def default_grid() -> list[Entry]:
    """The distinct kernel configurations of every preset's rules, in a stable order."""
    seen: dict[Entry, None] = {}
    for rules in preset_rules().values():
        for rule in rules:
            codec = get_codec(rule.codec)
            if not launches_kernels(codec):
                continue
            params = tuple(sorted((k, v) for k, v in rule.params.items() if k not in NOT_KERNEL_PARAMS))
            refs = (False, True) if codec.uses_reference(rule.params) else (False,)
            for dtype in DTYPES:
                if not codec.accepts(torch.empty(1, dtype=getattr(torch, dtype))):
                    continue  # log2-temporal: float32 only
                for has_ref in refs:
                    seen.setdefault(Entry(rule.codec, params, dtype, has_ref), None)
    return list(seen)


def sizes(block: int) -> tuple[int, ...]:
    """Element counts that launch every specialization of an entry: whole tiles only, then
    a masked tail with ``n`` a multiple of 16 and not."""
    return (2 * TILE, 2 * TILE + block // 2, 2 * TILE + block // 2 + 3)


def group_sizes(n: int, multiple_of: int = 1) -> list[int]:
    """The members a partner entry of ``n`` elements is split into for its grouped path:
    two of about ``n / 2`` (a whole tile and a tail each, at the default sizes) and one of
    33 (a tail only); each a multiple of ``multiple_of``; ``[n]`` when ``n`` is small."""
    if n < 100:
        return [n]
    first = (n - 33) // (2 * multiple_of) * multiple_of
    if multiple_of == 1:
        first += 1  # odd: the members' lengths differ modulo 16
    return [first, n - 33 - first, 33]


def shares(grid: list[Entry], workers: int) -> list[list[Entry]]:
    """``grid`` split round-robin over at most ``workers`` (no empty share)."""
    n = max(1, min(workers, len(grid)))
    return [grid[i::n] for i in range(n)]


def entry_params(entry: Entry) -> dict[str, Any]:
    """The entry's codec params, resolved as a rule does: ``bits`` and ``block`` are the
    call's, passed apart (a codec such as ``bitmask`` takes neither as a parameter)."""
    rest = {k: v for k, v in entry.params if k not in ("bits", "block")}
    return get_codec(entry.codec).resolve_params(rest, bits=entry.bits, block=entry.block)


def run_entry(entry: Entry, device: torch.device) -> None:
    """Encode and decode through the codec at each of :func:`sizes`: every launch of the
    entry, so every specialization it needs is compiled (or loaded from the cache)."""
    codec = get_codec(entry.codec)
    params = entry_params(entry)
    dtype = getattr(torch, entry.dtype)
    gen = torch.Generator().manual_seed(0)
    if codec.has_partners:
        for n in sizes(entry.block):
            run_partner_entry(codec, params, torch.randn(n, generator=gen).to(dtype).to(device), device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return
    for n in sizes(entry.block):
        x = torch.randn(n, generator=gen).to(dtype).to(device)
        ref = (x * 0.99).contiguous() if entry.has_ref else None
        enc = codec.encode(x, params, ref)
        codec.decode(enc.entry, ref, device, f"precompile {entry.label()}")
        if codec.decode_group_key(enc.entry, ref) is not None:
            # A load's grouped decode, its check of codes read from a file included.
            codec.decode_group([enc.entry], [ref], device, [f"precompile {entry.label()}"], check=True)
        if not entry.has_ref:
            # The grouped count and encode of a save's sparse candidates (exact float
            # tensors of this dtype), for one tensor; larger groups specialize on their
            # table's size: Checkpointer.prepare runs those.
            ops.sparsity_counts_many([x], out=torch.zeros(2, dtype=torch.int64, device=device))
            ops.bitmask_encode_many([x], [int(torch.count_nonzero(x))])
        if entry.codec == "blockwise":
            # The grouped statistics of a rule's max_error bits choice, for one tensor.
            out = torch.zeros(4, dtype=torch.int64, device=device)
            ops.delta_statistics_many([x], [ref], entry.block, out=out)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_partner_entry(codec: Any, params: dict[str, Any], x: torch.Tensor, device: torch.device) -> None:
    """A partner codec's launches for ``x``: encode and decode with a partner alone, then
    as the group of :func:`group_sizes`."""
    context = f"precompile {codec.name}"
    v = (x.float() * x.float()).contiguous()
    enc = codec.encode_with_partner(x, params, "partner", v, None)
    codec.decode_with_partner(enc.entry, v, device, context)
    sizes_ = group_sizes(x.numel())
    xs, vs = [t.clone() for t in x.split(sizes_)], [t.clone() for t in v.split(sizes_)]
    flags = torch.zeros(len(xs), dtype=torch.int64, device=device)
    encs = codec.encode_group_with_partners(xs, params, ["partner"] * len(xs), vs, flags)
    codec.decode_group_with_partners([e.entry for e in encs], vs, device, [context] * len(xs))


def _run_share(entries: list[Entry], device: str, deadline: float) -> list[tuple[str, float]]:
    dev = torch.device(device)
    out = []
    for e in entries:
        if time.time() > deadline:
            break
        t0 = time.perf_counter()
        run_entry(e, dev)
        out.append((e.label(), round(time.perf_counter() - t0, 3)))
    return out


def compiling(device: torch.device) -> bool:
    """Whether launches compile here (a CUDA device, not the interpreter)."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def precompile(
    grid: list[Entry],
    device: torch.device,
    *,
    workers: int | None = None,
    budget_s: float = 600.0,
    force_pool: bool = False,
) -> dict[str, Any]:
    """Run ``grid`` in a pool of ``workers`` processes (default: one per core) that share
    ``TRITON_CACHE_DIR``, each starting no entry after ``budget_s``; a no-op that lists the
    grid and its shares where nothing compiles (``force_pool`` runs the pool anyway, on
    ``device``: the CPU test of the mechanism). ``seconds`` has the entries run."""
    workers = workers or os.cpu_count() or 1
    parts = shares(grid, workers)
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".triton", "cache"))
    result: dict[str, Any] = {
        "grid": [e.label() for e in grid],
        "workers": len(parts),
        "shares": [[e.label() for e in p] for p in parts],
        "cache_dir": os.environ["TRITON_CACHE_DIR"],
        "ran": False,
        "seconds": {},
    }
    if not (compiling(device) or force_pool):
        result["note"] = "nothing compiles here (interpreter or no CUDA): grid listed, not run"
        return result
    t0 = time.perf_counter()
    deadline = time.time() + budget_s
    # spawn: a forked child cannot use CUDA once the parent has initialized it.
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=len(parts), mp_context=ctx) as pool:
        futures = [pool.submit(_run_share, p, str(device), deadline) for p in parts]
        for f in futures:
            result["seconds"].update(dict(f.result()))
    # The launching process loads each binary from the disk cache on its first use.
    result["ran"] = True
    result["wall_s"] = round(time.perf_counter() - t0, 2)
    return result
