"""The kernel variants a state's first saves launch, and running them ahead of time.

Triton compiles one binary per specialization of a kernel: its ``constexpr`` arguments
(bits, block, rows, whether a reference is added, the largest code, whether the tile is
masked), its pointers' dtypes, and whether integer arguments (the length, the first row of
the tail) are multiples of 16. On a cold cache each costs about a second, on the thread
that launches: the first keyframe and delta of a CUDA state would compile 8-16 of them in
``save()``. :func:`save_variants` derives from the state and the rules what the first
keyframe (its quantized moments), the first delta (the rules' codes, against a reference)
and, in closed loop, its advance (decoding the deltas) launch; :func:`compile_variant`
runs one through its codec on a small tensor of the same specialization, so the binary is
compiled (or loaded from Triton's disk cache) once, before the first save.
:meth:`Checkpointer.prepare <tw_triton.checkpointer.Checkpointer.prepare>` does both. Why:
docs/training-loop.md ("The first save").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .codecs import get_codec
from .delta_bits import WIDER_BITS
from .rules import keyframe_rules, resolve_rules, select_rule
from .tree import Flattened

# Elements per program of the row-tiled kernels (kernels/tiles.py TILE_ELEMENTS).
TILE_ELEMENTS = 4096
# The device type whose tensors the kernels code.
KERNEL_DEVICE_TYPE = "cuda"
# Rule params that select no kernel variant: ``delta`` only decides whether a reference is
# passed, which ``Variant.has_ref`` records.
NOT_KERNEL_PARAMS = ("delta",)


@dataclass(frozen=True)
class Variant:
    """One codec configuration on one dtype at one size class: encoded (and, with
    ``decode``, decoded) it launches the kernels a save of such a tensor launches."""

    codec: str
    params: tuple[tuple[str, Any], ...]  # resolved codec params, sorted, without NOT_KERNEL_PARAMS
    dtype: torch.dtype
    has_ref: bool
    numel: int  # a small length that specializes like the tensor's (representative_numel)
    decode: bool = False  # also decoded against the reference (a closed-loop advance)


def representative_numel(n: int, block: int) -> int:
    """A length of at most 32 tiles whose launches specialize as ``n``'s: the same whole
    tiles or none, the same tail or none, ``n`` and the tail's first row alike modulo 16
    (and 0 or 1 alike)."""
    rows = max(1, TILE_ELEMENTS // block)
    tile = rows * block
    full, tail = divmod(n, tile)
    if full >= 32:
        full = 16 + full % 16  # full * rows stays the same modulo 16, and above 1
    return full * tile + tail


def save_variants(
    state: Any, rules: Any, *, bits: int, block: int, delta_mode: str, device_type: str | None = None
) -> list[Variant]:
    """The kernel variants the first keyframe and the first delta of ``state`` launch, in
    a stable order (each once).

    Args:
        state: the saved state (nested, or :class:`~tw_triton.tree.Flattened`).
        rules, bits, block: how it is coded (as :func:`~tw_triton.rules.resolve_rules`).
        delta_mode: ``"open"``, ``"closed"`` or ``"none"``.
        device_type: only tensors on devices of this type count (default
            :data:`KERNEL_DEVICE_TYPE`: the kernels are theirs).
    """
    device_type = device_type or KERNEL_DEVICE_TYPE
    flat = Flattened.of(state)
    rule_list = resolve_rules(rules, state, bits=bits, block=block)
    key_rules = keyframe_rules(rule_list)
    seen: dict[Variant, None] = {}
    for path, t in flat.tensors.items():
        if t.device.type != device_type:
            continue
        for rule, keyframe in (
            (select_rule(key_rules, path, t), True),
            (select_rule(rule_list, path, t), False),
        ):
            codec = get_codec(rule.codec)
            if codec is None or not getattr(codec, "has_kernel", False):
                continue
            # A keyframe codes without a reference; "none" codes every save so.
            has_ref = not keyframe and delta_mode != "none" and codec.uses_reference(rule.params)
            n = representative_numel(t.numel(), rule.params["block"])
            # A rule with max_error picks the bits from the values (delta_bits.py): every
            # candidate may be launched.
            bits_options = [rule.params.get("bits")]
            if not keyframe and getattr(rule, "max_error", None) is not None:
                bits_options += [b for b in WIDER_BITS if b > rule.params["bits"]]
            for b in bits_options:
                chosen = rule.params if b == rule.params.get("bits") else {**rule.params, "bits": b}
                params = tuple(sorted((k, v) for k, v in chosen.items() if k not in NOT_KERNEL_PARAMS))
                variant = Variant(rule.codec, params, t.dtype, has_ref, n, has_ref and delta_mode == "closed")
                seen.setdefault(variant, None)
    return list(seen)


def compile_variant(variant: Variant, device: torch.device) -> None:
    """Launch ``variant``'s kernels on ``device`` once (compiling them, or loading them
    from the disk cache): an encode of a tensor of its length, and its decode if the
    saves decode it."""
    codec = get_codec(variant.codec)
    params = dict(variant.params)
    resolved = codec.resolve_params(params, bits=params["bits"], block=params["block"])
    if variant.has_ref:
        resolved = {**resolved, "delta": True}
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(variant.numel, generator=gen).to(variant.dtype).to(device)
    ref = (x * 0.5).contiguous() if variant.has_ref else None
    enc = codec.encode(x, resolved, ref)
    if variant.decode:
        codec.decode(enc.entry, ref, device, f"precompile {variant.codec}")


def precompile(variants: list[Variant], device: torch.device) -> int:
    """Run :func:`compile_variant` of each of ``variants``; returns how many ran."""
    for variant in variants:
        compile_variant(variant, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return len(variants)


def kernel_device(tensors: Any) -> torch.device | None:
    """The first device of ``tensors`` whose type the kernels code, or ``None``."""
    return next((t.device for t in tensors if t.device.type == KERNEL_DEVICE_TYPE), None)


__all__ = [
    "KERNEL_DEVICE_TYPE",
    "Variant",
    "kernel_device",
    "compile_variant",
    "precompile",
    "representative_numel",
    "save_variants",
]
