"""Blockwise absmax delta codec: the tensor-level API and its plain-torch reference.

The codec class and :func:`quantize` / :func:`dequantize` check their arguments and call
the ops :func:`tw_triton.ops.quantize_blockwise` / :func:`~tw_triton.ops.dequantize_blockwise`,
which dispatch by device (plain-torch spec, compiled CPU codec, Triton kernels: the same
bytes on every one). Why this rule: docs/design.md, "The codec" and "Bit-exact across
devices"; the rule in full: docs/codecs.md.

In short: per block of ``B`` elements, ``d = fp32(x) - fp32(ref)``, ``scale = max|d| / qmax``,
codes ``q = nearest(d / scale)`` (ties to even, on the exact quotient), stored as
``q + 2**(bits-1)`` packed LSB-first; the decode ``ref + q * scale`` is rounded step by step
and saturated, so a quantizable block never decodes to +-inf. A block holding NaN/Inf has an
infinite scale, which :attr:`QuantizedTensor.nonfinite` reports without a sync.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import ops
from ..errors import CheckpointError, QuantizationError

# The spec and CPU backend under their names of this module, which benchmarks and tests use.
from ..ops.backends.cpu import dequantize_blockwise_cpu, quantize_blockwise_cpu  # noqa: F401,E402
from ..ops.layout import (  # noqa: F401 (re-exported: the codec's parameters)
    FLOAT_DTYPES,
    MAX_BLOCK,
    MIN_BLOCK,
    SUPPORTED_BITS,
    check_params,
    check_qmax,
    num_blocks,
    packed_nbytes,
    qmax_for,
)
from ..ops.reference import (  # noqa: F401,E402
    CHUNK_ELEMENTS,
    crumb_table,
    dequantize_blockwise_torch,
    nearest_integer_at_ties,
    quantize_blockwise_torch,
    release_scratch,
)
from ..ops.reference.buffers import decode_output, encode_outputs  # noqa: F401,E402
from ..qstate import EncodedEntry
from ..snapshot_pool import Allocator
from .arguments import check_dense, check_input, decode_device
from .base import (
    BatchLayout,
    Codec,
    Encoded,
    check_param_names,
    check_ref_fp,
    host_outputs,
    move_to,
    param_error,
)
from .grouped import decode_blockwise_group, encode_blockwise_group
from .packed import PACKING, check_packed_params, per_block_buffer, stored_codes


@dataclass(frozen=True)
class QuantizedTensor:
    """A tensor encoded by the blockwise codec.

    Attributes:
        codes: packed codes, ``uint8``, 1-D, ``ceil(numel * bits / 8)`` bytes.
        scales: one fp32 scale per block, 1-D, ``ceil(numel / block)`` values.
        shape: the original shape.
        dtype: the original floating dtype.
        bits: code width, 8, 4 or 2.
        block: elements per block, a power of two from 32 to 4096.
        nonfinite: a 0-dim bool tensor on the codes' device, true exactly when some block
            held a NaN or an infinity (in ``x``, in the reference, or in their difference);
            the tensor must then be stored exact. Reading it as a Python bool syncs.
        delta: whether it was encoded against a reference, which :func:`dequantize` then
            requires (and refuses otherwise); ``None`` (built by hand): not checked.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype
    bits: int
    block: int
    nonfinite: torch.Tensor
    delta: bool | None = None

    @property
    def numel(self) -> int:
        """Number of elements of the original tensor."""
        return math.prod(self.shape)

    @property
    def device(self) -> torch.device:
        """Device that holds the codes and scales."""
        return self.codes.device

    @property
    def nbytes(self) -> int:
        """Stored bytes: packed codes plus fp32 scales."""
        return self.codes.numel() + 4 * self.scales.numel()

    @classmethod
    def stored(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        bits: int,
        block: int,
        device: torch.device,
        delta: bool | None = None,
    ) -> QuantizedTensor:
        """A checked stored entry's encoding on ``device`` (it holds no NaN/Inf block)."""
        return cls(
            codes=move_to(codes.reshape(-1), device),
            scales=move_to(scales.reshape(-1), device),
            shape=shape,
            dtype=dtype,
            bits=bits,
            block=block,
            nonfinite=torch.zeros((), dtype=torch.bool, device=device),
            delta=delta,
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> QuantizedTensor:
        """A copy of this encoding on another device (the codes do not change)."""
        return QuantizedTensor(
            codes=self.codes.to(device, non_blocking=non_blocking),
            scales=self.scales.to(device, non_blocking=non_blocking),
            shape=self.shape,
            dtype=self.dtype,
            bits=self.bits,
            block=self.block,
            nonfinite=self.nonfinite.to(device, non_blocking=non_blocking),
            delta=self.delta,
        )


def stored_bytes_per_element(bits: int, block: int) -> float:
    """Asymptotic stored bytes per element: ``bits / 8 + 4 / block``."""
    return bits / 8 + 4 / block


def batchable(x: torch.Tensor, block: int, reference: torch.Tensor | None) -> bool:
    """Whether the torch path may encode ``x`` as part of a concatenation of tensors: a
    contiguous host tensor of whole blocks (so no block spans two tensors, and its codes
    end on a byte), with a contiguous reference on the same device if any."""
    return (
        x.device.type == "cpu"
        and x.is_contiguous()
        and x.numel() > 0
        and x.numel() % block == 0
        and (reference is None or (reference.device == x.device and reference.is_contiguous()))
    )


def nonfinite_flag(scales: torch.Tensor) -> torch.Tensor:
    """The device flag of blocks that held NaN or Inf: their scale is infinite."""
    return torch.isinf(scales).any()


def quantize(
    x: torch.Tensor,
    *,
    bits: int = 8,
    block: int = 128,
    reference: torch.Tensor | None = None,
    qmax: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> QuantizedTensor:
    """Quantize ``x`` (optionally as a delta from ``reference``) blockwise.

    On a CUDA tensor this launches the fused Triton encode kernel (delta, absmax, rounding
    and packing in one pass); on a CPU tensor it runs the bit-identical torch path. Nothing
    here synchronizes with the device: whether some block was NaN/Inf is reported by the
    device-side flag :attr:`QuantizedTensor.nonfinite`.

    Args:
        x: float32, float16 or bfloat16 tensor of any shape; non-contiguous tensors are
            read in their logical (row-major) order (on CPU chunk by chunk; the CUDA
            kernels take a contiguous copy).
        bits: 8, 4 or 2 bits per element.
        block: elements per scale, a power of two from 32 to 4096.
        reference: optional tensor of the same shape and device, any float dtype.
        qmax: largest code magnitude, default ``2**(bits-1) - 1``; fewer levels in the same
            container (``bits=4, qmax=3``) decode the same way (:func:`check_qmax`).
        out: ``(codes, scales)`` to write into, for a CPU ``x`` (see
            :func:`quantize_blockwise_torch`); the kernels allocate their own.

    Returns:
        A :class:`QuantizedTensor` on ``x``'s device.

    Raises:
        QuantizationError: unsupported dtype, bits or block, or a mismatched reference.
    """
    check_input(x, reference)
    check_params(bits, block)
    qmax = check_qmax(bits, qmax)
    # The op reads strided tensors as they are: the CPU paths chunk by chunk, the kernels
    # from a contiguous copy.
    codes, scales = ops.quantize_blockwise(x, reference, bits, block, qmax=qmax, out=out)
    # A block is unquantizable exactly when its scale is infinite (NaN/Inf in it). A block
    # whose qmax * scale overflows fp32 is not: the decode saturates the product, and x is
    # finite, so that only moves the value towards x. The flag stays on the device.
    nonfinite = nonfinite_flag(scales)
    return QuantizedTensor(
        codes=codes,
        scales=scales,
        shape=tuple(x.shape),
        dtype=x.dtype,
        bits=bits,
        block=block,
        nonfinite=nonfinite,
        delta=reference is not None,
    )


def dequantize(
    q: QuantizedTensor,
    *,
    reference: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Decode a :class:`QuantizedTensor`.

    On CUDA this launches the fused decode kernel (unpack, scale, add the reference, cast).

    Args:
        q: the encoding.
        reference: the tensor ``q`` was encoded against, if any (same shape); it is moved
            to ``device`` if it lives elsewhere.
        dtype: output dtype; defaults to the original dtype.
        device: where to decode; defaults to where ``q`` lives.

    Returns:
        A tensor of ``q.shape`` and ``dtype`` on ``device``.

    Raises:
        QuantizationError: bad arguments, or a ``reference`` missing for a delta (given for
            an encoding made without one).
    """
    if not isinstance(q, QuantizedTensor):
        raise QuantizationError(f"expected a QuantizedTensor, got {type(q).__name__}")
    out_dtype = q.dtype if dtype is None else dtype
    if out_dtype not in FLOAT_DTYPES:
        raise QuantizationError(f"can only decode to float32, float16 or bfloat16, got {out_dtype}")
    dev = decode_device(device, q.device)
    if dev != q.device:
        q = q.to(dev)
    rc = None
    if reference is not None:
        if not isinstance(reference, torch.Tensor) or reference.dtype not in FLOAT_DTYPES:
            got = reference.dtype if isinstance(reference, torch.Tensor) else type(reference).__name__
            raise QuantizationError(f"reference must be a float32, float16 or bfloat16 tensor, got {got}")
        check_dense(reference, "reference")
        if tuple(reference.shape) != tuple(q.shape):
            raise QuantizationError(
                f"reference shape {tuple(reference.shape)} does not match encoded shape {q.shape}"
            )
        rc = reference.to(dev).contiguous()
    if q.delta is not None and q.delta != (rc is not None) and q.numel:
        raise QuantizationError(
            "q was encoded as a delta from a reference: pass reference= (the tensor it was encoded against)"
            if q.delta
            else "q was encoded without a reference: dequantize it without reference="
        )
    flat = ops.dequantize_blockwise(q.codes, q.scales, q.numel, q.bits, q.block, rc, out_dtype)
    return flat.view(q.shape)


class BlockwiseCodec(Codec):
    """Blockwise absmax integer codec (delta from a reference when one is given)."""

    name = "blockwise"
    has_kernel = True
    _KEYS = frozenset({"bits", "block", "packing", "delta", "qmax"})
    # The params a file records: ``qmax`` only where it narrows the container, ``ref_fp``
    # (the state API's fingerprint of the reference) only on a delta.
    _STORED = frozenset({"bits", "block", "packing", "delta"})
    _STORED_OPTIONAL = frozenset({"qmax", "ref_fp"})

    def resolve_params(self, params: Mapping[str, Any], *, bits: int, block: int) -> dict[str, Any]:
        unknown = set(params) - self._KEYS
        if unknown:
            raise QuantizationError(
                f"codec 'blockwise' has no parameter(s) {sorted(unknown)}; it takes {sorted(self._KEYS)}"
            )
        out = {
            "bits": params.get("bits", bits),
            "block": params.get("block", block),
            "packing": params.get("packing", PACKING),
            "delta": params.get("delta", True),
        }
        check_params(out["bits"], out["block"])
        if out["packing"] != PACKING:
            raise QuantizationError(f"codec 'blockwise' packs {PACKING!r} only, got {out['packing']!r}")
        if not isinstance(out["delta"], bool):
            raise QuantizationError(f"'delta' must be true or false, got {out['delta']!r}")
        if params.get("qmax") is not None and check_qmax(out["bits"], params["qmax"]) != qmax_for(
            out["bits"]
        ):
            out["qmax"] = params["qmax"]  # recorded only when it narrows the container
        return out

    def accepts(self, tensor: torch.Tensor) -> bool:
        return tensor.dtype in FLOAT_DTYPES and tensor.numel() > 0

    def encode(self, x: torch.Tensor, params: Mapping[str, Any], reference: torch.Tensor | None) -> Encoded:
        return self._encoded(x, params, reference, None)

    def encode_with(
        self,
        x: torch.Tensor,
        params: Mapping[str, Any],
        reference: torch.Tensor | None,
        allocate: Allocator,
    ) -> Encoded:
        n = x.numel()
        out = host_outputs(
            x,
            allocate,
            [
                (packed_nbytes(n, params["bits"]), torch.uint8),
                (num_blocks(n, params["block"]), torch.float32),
            ],
        )
        return self._encoded(x, params, reference, out)  # type: ignore[arg-type]

    def batch_key(
        self, x: torch.Tensor, params: Mapping[str, Any], reference: torch.Tensor | None
    ) -> Hashable | None:
        if not batchable(x, params["block"], reference):
            return None
        return (x.dtype, None if reference is None else reference.dtype)

    def batch_layout(self, params: Mapping[str, Any]) -> BatchLayout:
        # Blocks never span two tensors (each is whole blocks): every block's scale and
        # codes are what the tensor alone gives, at an offset.
        bits, block = params["bits"], params["block"]
        return BatchLayout(
            lambda n: {"codes": n * bits // 8, "scales": n // block}, lambda b: nonfinite_flag(b["scales"])
        )

    # Grouped encode and decode of device tensors (tw_triton.state.grouped): the bodies
    # live in tw_triton.codecs.grouped, beside the log2 codec's.
    def group_key(
        self, x: torch.Tensor, params: Mapping[str, Any], reference: torch.Tensor | None
    ) -> Hashable | None:
        return ("delta" if reference is not None else "plain",)  # the op splits by dtypes

    # Fewer levels in a container are a column of the grouped kernel's table, not a launch.
    tensor_params = frozenset({"qmax"})

    def encode_group(self, xs, params, references, flags, each=None):  # type: ignore[no-untyped-def]
        return encode_blockwise_group(self, xs, params, references, flags, each)

    def decode_group_key(self, entry: EncodedEntry, reference: torch.Tensor | None) -> Hashable | None:
        # Deltas given their reference, or absolute codes (a reference given to those is unused).
        delta = self.uses_reference(entry.params)
        if (delta and reference is None) or entry.dtype not in FLOAT_DTYPES:
            return None
        return (entry.params.get("bits"), entry.params.get("block"), entry.dtype, delta)

    def decode_group(self, entries, references, device, contexts, outs=None, *, check=False):  # type: ignore[no-untyped-def]
        # check: every code byte decodes, so a file's codes need no check beyond their sizes.
        return decode_blockwise_group(self, entries, references, device, contexts, outs)

    def entry_of(
        self,
        x: torch.Tensor,
        params: Mapping[str, Any],
        delta: bool,
        codes: torch.Tensor,
        scales: torch.Tensor,
    ) -> EncodedEntry:
        stored = {"bits": params["bits"], "block": params["block"], "packing": PACKING, "delta": delta}
        if "qmax" in params:
            stored["qmax"] = params["qmax"]
        return EncodedEntry(
            codec=self.name,
            params=stored,
            shape=tuple(x.shape),
            dtype=x.dtype,
            buffers={"codes": codes, "scales": scales},
        )

    def _encoded(
        self,
        x: torch.Tensor,
        params: Mapping[str, Any],
        reference: torch.Tensor | None,
        out: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> Encoded:
        q = quantize(
            x,
            bits=params["bits"],
            block=params["block"],
            reference=reference,
            qmax=params.get("qmax"),
            out=out,
        )
        entry = self.entry_of(x, params, reference is not None, q.codes, q.scales)
        return Encoded(entry, unusable=q.nonfinite)

    def check_stored_params(self, params: Mapping[str, Any], context: str) -> None:
        check_param_names(params, self.name, self._STORED, self._STORED_OPTIONAL, context)
        check_packed_params(params, context)
        if not isinstance(params["delta"], bool):
            raise param_error(context, "delta", params["delta"], "true or false")
        if "qmax" in params:
            # The decode does not need it, but a value the encoder cannot have written
            # means the manifest is not what was written.
            try:
                check_qmax(params["bits"], params["qmax"])
            except QuantizationError:
                raise param_error(
                    context, "qmax", params["qmax"], f"an int from 1 to {qmax_for(params['bits'])}"
                ) from None
        check_ref_fp(params, context)

    def stored_parts(self, entry: EncodedEntry, context: str) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        """``(bits, block, codes, scales)`` of a stored entry, checked."""
        self.check_stored_params(entry.params, context)
        bits, block, codes = stored_codes(entry, context)
        scales = per_block_buffer(entry, "scales", torch.float32, block, context)
        return bits, block, codes, scales

    def decode(
        self,
        entry: EncodedEntry,
        reference: torch.Tensor | None,
        device: torch.device | None,
        context: str,
    ) -> torch.Tensor:
        bits, block, codes, scales = self.stored_parts(entry, context)
        delta = self.uses_reference(entry.params)
        if delta and reference is None:
            raise CheckpointError(f"{context}: delta entry decoded without its reference tensor")
        dev = codes.device if device is None else device
        q = QuantizedTensor.stored(codes, scales, tuple(entry.shape), entry.dtype, bits, block, dev, delta)
        ref = move_to(reference, dev) if reference is not None else None
        return dequantize(q, reference=ref if delta else None)

    def decode_over(
        self,
        entry: EncodedEntry,
        reference: torch.Tensor,
        device: torch.device | None,
        context: str,
    ) -> torch.Tensor:
        """Decode a delta into ``reference`` itself, where the torch path can (see
        :func:`dequantize_blockwise_torch`'s ``out``): a contiguous host tensor of the
        entry's dtype and shape. Anything else (a device, another dtype) allocates."""
        dev = reference.device if device is None else device
        if (
            not self.uses_reference(entry.params)
            or dev.type != "cpu"
            or reference.device != dev
            or reference.dtype != entry.dtype
            or tuple(reference.shape) != tuple(entry.shape)
            or not reference.is_contiguous()
        ):
            return self.decode(entry, reference, device, context)
        bits, block, codes, scales = self.stored_parts(entry, context)
        ops.dequantize_blockwise(
            move_to(codes.reshape(-1), dev),
            move_to(scales.reshape(-1), dev),
            reference.numel(),
            bits,
            block,
            reference,
            entry.dtype,
            out=reference,
        )
        return reference
