"""The codec ``log2-temporal``: a non-negative moment coded against its last reconstruction.

A second moment such as AdamW's ``exp_avg_sq`` (``beta2 = 0.999``) barely moves between two
saves a few steps apart, yet the ``log2`` codec codes it from scratch every time. This codec
codes, between keyframes, the change of the fp32 bit pattern (the ``log2`` codec's integer
domain) against the *reconstruction* the chain already holds, as closed-loop weight deltas
do: in steps of the ``log2`` codes' own step (taken from the reference's block, so it is
never stored, and floored at ``min_step``), one signed byte per element that the entropy
stage shrinks to a fraction of a bit, with exact zero kept apart. A block that cannot be
coded so (a value that was zero turned positive, a change beyond 127 steps) stores the
absolute ``log2`` codes instead; a keyframe stores the ``log2`` codec itself
(:meth:`Log2TemporalCodec.keyframe_spec`). A decoded value is never negative, a zero
decodes to zero and nothing else does. Spec: :mod:`tw_triton.ops.reference.log2_temporal`;
why: docs/codecs.md ("The temporal second-moment codec").
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch

from .. import ops
from ..errors import CheckpointError, QuantizationError, ReferenceMismatchError
from ..ops.layout import check_params, num_blocks
from ..ops.reference.log2_temporal import MAX_MIN_STEP, MIN_STEP, is_min_step
from ..qstate import EncodedEntry
from ..snapshot_pool import Allocator
from .base import (
    Codec,
    Encoded,
    check_param_names,
    check_ref_fp,
    entry_buffer,
    host_outputs,
    move_to,
    param_error,
)
from .grouped import fits, shaped
from .log2 import unusable_flag
from .packed import PACKING, check_bits_block

NAME = "log2-temporal"


def stored_nbytes(numel: int, block: int) -> int:
    """Bytes of the one stored buffer: two int32 bounds per block, then a code per element."""
    return 8 * num_blocks(numel, block) + numel


def split_stored(
    buf: torch.Tensor, numel: int, block: int, *, copy_bounds: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes, lo, hi)`` views of the stored ``uint8`` buffer: ``lo`` of every block
    (int32, little-endian), then ``hi``, then the codes. One buffer, not three: the bounds
    are mostly zero and would stay raw under the entropy stage's 4 KiB floor on their own.
    ``copy_bounds``: read the bounds from a copy (a file's buffer may sit at any offset,
    and an int32 view needs 4-byte alignment)."""
    nb = num_blocks(numel, block)
    bounds = buf[: 8 * nb]
    if copy_bounds:
        bounds = bounds.clone()
    elif bounds.data_ptr() % 4:
        raise QuantizationError(f"{NAME}: an output buffer must be 4-byte aligned")
    words = bounds.view(torch.int32)
    return buf[8 * nb :], words[:nb], words[nb:]


def group_stored(numels: Sequence[int], block: int, device: torch.device) -> list[torch.Tensor]:
    """The stored buffers of a group of tensors of ``numels`` elements: views of one
    ``uint8`` buffer, each tensor's codes 16-byte aligned (the grouped kernel stores them
    in 16-byte vectors), its bounds right before them. At most 15 bytes lie between two."""
    offsets, end = [], 0
    for n in numels:
        bounds = 8 * num_blocks(n, block)
        codes = -(-(end + bounds) // 16) * 16
        offsets.append(codes - bounds)
        end = codes + n
    buf = torch.empty(end, dtype=torch.uint8, device=device)
    return [buf[o : o + stored_nbytes(n, block)] for o, n in zip(offsets, numels)]


def _check_input(x: torch.Tensor, reference: torch.Tensor | None) -> None:
    if x.dtype != torch.float32:
        raise QuantizationError(f"codec {NAME!r} codes float32 tensors, got {x.dtype}")
    if reference is not None and tuple(reference.shape) != tuple(x.shape):
        raise QuantizationError(
            f"reference shape {tuple(reference.shape)} does not match tensor shape {tuple(x.shape)}"
        )


class Log2TemporalCodec(Codec):
    """Registry entry ``log2-temporal`` (see the module doc). Params: ``bits`` (of the
    absolute codes, which also sets the step), ``block``, ``min_step`` (bit-pattern units),
    ``delta`` (default true: coded against the reference when one is given)."""

    name = NAME
    has_kernel = True
    reference_optional = True  # moments created after the keyframe: coded against zero
    _KEYS = frozenset({"bits", "block", "min_step", "delta"})  # given, and stored

    def resolve_params(self, params: Mapping[str, Any], *, bits: int, block: int) -> dict[str, Any]:
        unknown = set(params) - self._KEYS
        if unknown:
            raise QuantizationError(
                f"codec {NAME!r} has no parameter(s) {sorted(unknown)}; it takes {sorted(self._KEYS)}"
            )
        out = {
            "bits": params.get("bits", bits),
            "block": params.get("block", block),
            "min_step": params.get("min_step", MIN_STEP),
            "delta": params.get("delta", True),
        }
        check_params(out["bits"], out["block"])
        if not is_min_step(out["min_step"]):
            raise QuantizationError(
                f"'min_step' must be an int from 1 to {MAX_MIN_STEP}, got {out['min_step']!r}"
            )
        if not isinstance(out["delta"], bool):
            raise QuantizationError(f"'delta' must be true or false, got {out['delta']!r}")
        return out

    def accepts(self, tensor: torch.Tensor) -> bool:
        # float32 only: a reconstruction rounded to bf16/fp16 could reach zero or infinity.
        return tensor.dtype == torch.float32 and tensor.numel() > 0

    def uses_reference(self, params: Mapping[str, Any]) -> bool:
        return params.get("delta", True) is True

    def keyframe_spec(self, params: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        """A keyframe stores the absolute ``log2`` codes; the chain then starts from their
        reconstruction (:func:`tw_triton.deltas.keyframe_values`)."""
        return "log2", {"bits": params["bits"], "block": params["block"], "packing": PACKING}

    def check_stored_params(self, params: Mapping[str, Any], context: str) -> None:
        check_param_names(params, self.name, self._KEYS, frozenset({"ref_fp"}), context)
        check_bits_block(params, context)
        if not is_min_step(params["min_step"]):
            raise param_error(context, "min_step", params["min_step"], f"an int from 1 to {MAX_MIN_STEP}")
        if not isinstance(params["delta"], bool):
            raise param_error(context, "delta", params["delta"], "true or false")
        check_ref_fp(params, context)

    def encode(self, x: torch.Tensor, params: Mapping[str, Any], reference: torch.Tensor | None) -> Encoded:
        return self._encoded(x, params, reference, None)

    def encode_with(
        self, x: torch.Tensor, params: Mapping[str, Any], reference: torch.Tensor | None, allocate: Allocator
    ) -> Encoded:
        out = host_outputs(x, allocate, [(stored_nbytes(x.numel(), params["block"]), torch.uint8)])
        return self._encoded(x, params, reference, None if out is None else out[0])

    def group_key(
        self, x: torch.Tensor, params: Mapping[str, Any], reference: torch.Tensor | None
    ) -> Hashable | None:
        # Coded against a float32 reference of its shape: grouped. Without one (a moment
        # the reference lacks) it is coded against zeros, alone.
        grouped = (
            reference is not None
            and x.dtype == reference.dtype == torch.float32
            and tuple(reference.shape) == tuple(x.shape)
        )
        return () if grouped else None

    def encode_group(
        self,
        xs: Sequence[torch.Tensor],
        params: Mapping[str, Any],
        references: Sequence[torch.Tensor] | None,
        flags: torch.Tensor,
    ) -> list[Encoded]:
        if references is None:
            raise QuantizationError(f"codec {NAME!r} groups only tensors coded against a reference")
        for x, r in zip(xs, references):
            _check_input(x, r)
        bits, block, min_step = params["bits"], params["block"], params["min_step"]
        stored = group_stored([x.numel() for x in xs], block, xs[0].device)
        views = [split_stored(s, x.numel(), block) for s, x in zip(stored, xs)]
        ops.quantize_log2_temporal_many(
            list(xs), list(references), bits, block, min_step, flags=flags, out=views
        )
        return [
            Encoded(self._entry(x, params, True, s), unusable=flags[i])
            for i, (x, s) in enumerate(zip(xs, stored))
        ]

    def _entry(
        self, x: torch.Tensor, params: Mapping[str, Any], delta: bool, out: torch.Tensor
    ) -> EncodedEntry:
        return EncodedEntry(
            codec=self.name,
            params={
                "bits": params["bits"],
                "block": params["block"],
                "min_step": params["min_step"],
                "delta": delta,
            },
            shape=tuple(x.shape),
            dtype=x.dtype,
            buffers={"codes": out},
        )

    def _encoded(
        self,
        x: torch.Tensor,
        params: Mapping[str, Any],
        reference: torch.Tensor | None,
        out: torch.Tensor | None,
    ) -> Encoded:
        _check_input(x, reference)
        # Without a reference every block is coded against zero: zeros stay temporal, the
        # rest are absolute log2 blocks.
        ref = torch.zeros_like(x) if reference is None else reference.to(x.device, torch.float32)
        bits, block, min_step = params["bits"], params["block"], params["min_step"]
        n = x.numel()
        if out is None:
            out = torch.empty(stored_nbytes(n, block), dtype=torch.uint8, device=x.device)
        views = split_stored(out, n, block)
        got = ops.quantize_log2_temporal(x, ref, bits, block, min_step, out=views)
        for view, t in zip(views, got):
            if t.data_ptr() != view.data_ptr():  # a backend that allocates its own (the kernels)
                view.copy_(t)
        return Encoded(self._entry(x, params, reference is not None, out), unusable=unusable_flag(views[2]))

    def decode_group_key(self, entry: EncodedEntry, reference: torch.Tensor | None) -> Hashable | None:
        # Deltas over a float32 reference of their shape (the closed-loop advance).
        if (
            not self.uses_reference(entry.params)
            or reference is None
            or entry.dtype != torch.float32
            or reference.dtype != torch.float32
            or tuple(reference.shape) != tuple(entry.shape)
        ):
            return None
        return tuple(entry.params.get(k) for k in ("bits", "block", "min_step"))

    def decode_group(
        self,
        entries: Sequence[EncodedEntry],
        references: Sequence[torch.Tensor | None],
        device: torch.device,
        contexts: Sequence[str],
        outs: Sequence[torch.Tensor | None] | None = None,
        *,
        check: bool = False,
    ) -> list[torch.Tensor]:
        """:meth:`decode` of delta entries of one :meth:`decode_group_key` with one grouped
        op, into ``outs[i]`` where it is a contiguous float32 tensor of the entry's size on
        ``device`` (the reference itself: no second copy of it). ``check``: the codes of
        every entry are checked first (:func:`~tw_triton.ops.log2_temporal_code_flags_many`),
        with one host read for the group."""
        parts = [self._stored(e, c, copy_bounds=False) for e, c in zip(entries, contexts)]
        bits, block, min_step = parts[0][:3]
        codes = [move_to(p[3], device) for p in parts]
        given = [None] * len(entries) if outs is None else list(outs)
        into = [
            o.view(-1) if o is not None and fits(o, torch.float32, c.numel(), device) else None
            for o, c in zip(given, codes)
        ]
        lo = [move_to(p[4], device) for p in parts]
        hi = [move_to(p[5], device) for p in parts]
        refs = [move_to(r, device).reshape(-1) for r in references]  # type: ignore[union-attr]
        # Without check the codes are the encoder's own, from this very save, so nothing
        # can have corrupted them. With it, every tensor's flag is read in one transfer
        # (one sync on a GPU, not one per tensor), before anything is written.
        if check:
            from ..state.fingerprints import read_device_scalars

            found = ops.log2_temporal_code_flags_many(codes, lo, hi, refs, bits, block)
            for i, bad in enumerate(read_device_scalars(list(found), [found])):
                if bad:
                    why = ops.log2_temporal_code_errors(codes[i], lo[i], hi[i], refs[i], bits, block)
                    raise CheckpointError(f"{contexts[i]}: corrupt {NAME} codes: {why}")
        flat = ops.dequantize_log2_temporal_many(
            codes,
            lo,
            hi,
            refs,
            bits,
            block,
            min_step,
            out=into,
        )
        return [shaped(t, e.shape, o, i) for t, e, o, i in zip(flat, entries, given, into)]

    def _stored(
        self, entry: EncodedEntry, context: str, copy_bounds: bool = True
    ) -> tuple[int, int, int, torch.Tensor, ...]:
        """The entry's params, codes and bounds, checked. ``copy_bounds``: read the bounds
        from a copy (a file's buffer may sit at any offset); else only where the buffer is
        not 4-byte aligned (an encoder's own buffer is)."""
        self.check_stored_params(entry.params, context)
        p = entry.params
        if entry.dtype != torch.float32:
            raise CheckpointError(f"{context}: {NAME} entry has dtype {entry.dtype}, expected float32")
        numel = math.prod(tuple(entry.shape))
        stored = entry_buffer(entry, "codes", context)
        want = stored_nbytes(numel, p["block"])
        if stored.dtype != torch.uint8 or stored.numel() != want:
            raise CheckpointError(
                f"{context}: codes are {stored.dtype} x {stored.numel()}, expected uint8 x {want} "
                f"(two int32 bounds per block of {p['block']}, then one byte per element of shape "
                f"{tuple(entry.shape)})"
            )
        flat = stored.reshape(-1)
        copy = copy_bounds or flat.data_ptr() % 4 != 0
        codes, lo, hi = split_stored(flat, numel, p["block"], copy_bounds=copy)
        return p["bits"], p["block"], p["min_step"], codes, lo, hi

    def decode(
        self, entry: EncodedEntry, reference: torch.Tensor | None, device: torch.device | None, context: str
    ) -> torch.Tensor:
        return self._decode(entry, reference, device, context, over=False)

    def decode_over(
        self, entry: EncodedEntry, reference: torch.Tensor, device: torch.device | None, context: str
    ) -> torch.Tensor:
        """Decode into ``reference`` itself where it is a contiguous float32 tensor of the
        entry's shape on the decode's device (each chunk is read before it is written)."""
        return self._decode(entry, reference, device, context, over=True)

    def _decode(
        self,
        entry: EncodedEntry,
        reference: torch.Tensor | None,
        device: torch.device | None,
        context: str,
        over: bool,
    ) -> torch.Tensor:
        bits, block, min_step, codes, lo, hi = self._stored(entry, context)
        delta = self.uses_reference(entry.params)
        if delta and reference is None:
            raise CheckpointError(f"{context}: delta entry decoded without its reference tensor")
        dev = codes.device if device is None else device
        codes, lo, hi = (move_to(t, dev) for t in (codes, lo, hi))
        numel = codes.numel()
        if delta:
            assert reference is not None
            if tuple(reference.shape) != tuple(entry.shape):
                raise ReferenceMismatchError(
                    f"{context}: reference has shape {tuple(reference.shape)}, expected {tuple(entry.shape)}"
                )
            ref = move_to(reference, dev)
        else:
            ref = torch.zeros(numel, dtype=torch.float32, device=dev)
        in_place = (
            over
            and delta
            and ref is reference
            and ref.dtype == torch.float32
            and ref.is_contiguous()
            and dev.type == "cpu"
        )
        ref32 = ref if ref.dtype == torch.float32 else ref.float()
        why = ops.log2_temporal_code_errors(codes, lo, hi, ref32, bits, block)
        if why is not None:
            raise CheckpointError(f"{context}: corrupt {NAME} codes: {why}")
        flat = ops.dequantize_log2_temporal(
            codes, lo, hi, ref32, numel, bits, block, min_step, out=ref.view(-1) if in_place else None
        )
        return ref if in_place else flat.view(tuple(entry.shape))


__all__ = ["Log2TemporalCodec", "NAME"]
