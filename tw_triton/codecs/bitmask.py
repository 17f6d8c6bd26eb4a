"""The sparse codec ``bitmask``: a mask of the non-zero elements and their values, lossless.

For tensors with many exact zeros (unstructured pruning, 2:4 sparsity, unused embedding
rows): buffer ``mask`` holds one bit per element, LSB first, set where the element's bit
pattern is not all zero; buffer ``values`` the elements whose bit is set, in row-major
order, in the tensor's dtype. ``-0.0`` and NaN are values, so the decode gives back every
bit. Param ``packing`` (``"lsb-first"``). Stored bytes: ``ceil(n / 8) + nnz * itemsize``,
against ``n * itemsize`` exact. The numeric work is the ops
:func:`tw_triton.ops.bitmask_encode` / :func:`~tw_triton.ops.bitmask_decode` (Triton on
CUDA, the torch spec elsewhere; :func:`~tw_triton.ops.bitmask_encode_many` encodes a device
save's chosen tensors together). When the state API picks it by itself: docs/codecs.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from .. import ops
from ..errors import CheckpointError, QuantizationError
from ..ops.layout import FLOAT_DTYPES
from ..ops.reference.bitmask import mask_nbytes, nonzero_count
from ..qstate import EncodedEntry
from ..snapshot_pool import Allocator
from .base import Codec, Encoded, check_param_names, entry_buffer, host_outputs, move_to, param_error
from .packed import PACKING

# The state API stores a float tensor it would store exact with this codec instead when it
# has at least SPARSE_MIN_NUMEL elements, the bitmask's raw bytes are at most
# SPARSE_MAX_RATIO of the exact ones (at least 9.4 % zeros in fp32, 12.5 % in 16 bits), and
# its zeros are scattered: their runs are on average less than CLUSTERED_FACTOR times as
# long as those of zeros placed at random (``numel / nnz``). Fewer zeros, or zeros that
# cluster (whole rows), the entropy stage stores about as well in the exact bytes
# (docs/codecs.md, "The sparse codec").
SPARSE_MIN_NUMEL = 4096
SPARSE_MAX_RATIO = 15 / 16
CLUSTERED_FACTOR = 2


def bitmask_nbytes(numel: int, nnz: int, itemsize: int) -> int:
    """Bytes of a bitmask entry of ``numel`` elements, ``nnz`` of them not zero."""
    return mask_nbytes(numel) + nnz * itemsize


def sparse_candidate(x: torch.Tensor) -> bool:
    """Whether the state API checks ``x`` (a tensor its rules store exact) for sparsity."""
    return x.dtype in FLOAT_DTYPES and x.numel() >= SPARSE_MIN_NUMEL


def sparsity_counts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(nnz, runs)`` of ``x``: see :func:`tw_triton.ops.sparsity_counts`."""
    return ops.sparsity_counts(x)


def sparse_pays(numel: int, nnz: int, itemsize: int, runs: int) -> bool:
    """Whether a tensor of ``numel`` elements, ``nnz`` of them not zero in ``runs`` runs of
    zeros, is stored by this codec rather than exact (see :data:`SPARSE_MAX_RATIO`)."""
    # Mean run ``zeros / runs`` against ``CLUSTERED_FACTOR * numel / nnz``, in integers.
    scattered = (numel - nnz) * nnz < CLUSTERED_FACTOR * numel * runs
    return scattered and bitmask_nbytes(numel, nnz, itemsize) <= SPARSE_MAX_RATIO * numel * itemsize


def mask_popcount(mask: torch.Tensor, numel: int) -> tuple[int, bool]:
    """``(set bits among the first numel, whether a padding bit past numel is set)`` of a
    mask on any device (one read back to the host)."""
    count, padded = ops.mask_popcount(mask.reshape(-1), numel).tolist()
    return count, bool(padded)


class BitmaskCodec(Codec):
    """Registry entry ``bitmask``: the lossless sparse codec (no reference; see the module
    doc)."""

    name = "bitmask"
    lossless = True
    has_kernel = True
    _KEYS = frozenset({"packing"})

    def resolve_params(self, params: Mapping[str, Any], *, bits: int, block: int) -> dict[str, Any]:
        unknown = set(params) - self._KEYS
        if unknown:
            raise QuantizationError(
                f"codec 'bitmask' has no parameter(s) {sorted(unknown)}; it takes {sorted(self._KEYS)}"
            )
        if params.get("packing", PACKING) != PACKING:
            raise QuantizationError(f"codec 'bitmask' packs {PACKING!r} only, got {params['packing']!r}")
        return {"packing": PACKING}

    def accepts(self, tensor: torch.Tensor) -> bool:
        return tensor.dtype in FLOAT_DTYPES

    def uses_reference(self, params: Mapping[str, Any]) -> bool:
        return False

    def check_stored_params(self, params: Mapping[str, Any], context: str) -> None:
        check_param_names(params, self.name, self._KEYS, frozenset(), context)
        if not isinstance(params["packing"], str) or params["packing"] != PACKING:
            raise param_error(context, "packing", params["packing"], repr(PACKING))

    def encode(self, x: torch.Tensor, params: Mapping[str, Any], reference: torch.Tensor | None) -> Encoded:
        """Encode ``x``; on a GPU the count of its non-zero elements is read back (a host
        sync): :meth:`encode_counted` with a count read earlier has none."""
        return self.encode_counted(x, None)

    def encode_with(
        self,
        x: torch.Tensor,
        params: Mapping[str, Any],
        reference: torch.Tensor | None,
        allocate: Allocator,
    ) -> Encoded:
        return self.encode_counted(x, None, allocate)

    def encode_counted(self, x: torch.Tensor, nnz: int | None, allocate: Allocator | None = None) -> Encoded:
        """The entry of ``x`` whose count of non-zero bit patterns is ``nnz``
        (``nonzero_count``; ``None``: count here). With ``allocate``, a tensor on the host
        is encoded into its buffers.

        Raises:
            QuantizationError: ``x``'s dtype is not float32, float16 or bfloat16.
        """
        if x.dtype not in FLOAT_DTYPES:
            raise QuantizationError(f"bitmask codes float32, float16 or bfloat16 tensors, got {x.dtype}")
        out = None
        if allocate is not None and x.device.type != "cuda":
            nnz = int(nonzero_count(x)) if nnz is None else nnz
            out = host_outputs(x, allocate, [(mask_nbytes(x.numel()), torch.uint8), (nnz, x.dtype)])
        return self._encoded(x, *ops.bitmask_encode(x, nnz=nnz, out=out))

    def encode_counted_many(
        self, xs: list[torch.Tensor], nnzs: list[int], allocate: Allocator | None = None
    ) -> list[Encoded]:
        """:meth:`encode_counted` of each of ``xs`` with its count ``nnzs[i]``, in one
        grouped encode per device (:func:`tw_triton.ops.bitmask_encode_many`): the same
        entries, in launches that do not grow with the number of tensors.

        Raises:
            QuantizationError: a tensor's dtype is not float32, float16 or bfloat16.
        """
        by_device: dict[torch.device, list[int]] = {}
        outs: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for i, (x, nnz) in enumerate(zip(xs, nnzs)):
            if x.dtype not in FLOAT_DTYPES:
                raise QuantizationError(f"bitmask codes float32, float16 or bfloat16 tensors, got {x.dtype}")
            by_device.setdefault(x.device, []).append(i)
            out = None
            if allocate is not None and x.device.type != "cuda":
                out = host_outputs(x, allocate, [(mask_nbytes(x.numel()), torch.uint8), (nnz, x.dtype)])
            outs.append(out)
        encoded: list[Encoded] = [None] * len(xs)  # type: ignore[list-item]
        for members in by_device.values():
            got = ops.bitmask_encode_many(
                [xs[i] for i in members], [nnzs[i] for i in members], out=[outs[i] for i in members]
            )
            for i, (mask, values) in zip(members, got):
                encoded[i] = self._encoded(xs[i], mask, values)
        return encoded

    def _encoded(self, x: torch.Tensor, mask: torch.Tensor, values: torch.Tensor) -> Encoded:
        entry = EncodedEntry(
            codec=self.name,
            params={"packing": PACKING},
            shape=tuple(x.shape),
            dtype=x.dtype,
            buffers={"mask": mask.view(-1), "values": values.view(-1)},
        )
        return Encoded(entry)

    def decode(
        self,
        entry: EncodedEntry,
        reference: torch.Tensor | None,
        device: torch.device | None,
        context: str,
    ) -> torch.Tensor:
        self.check_stored_params(entry.params, context)
        shape = tuple(entry.shape)
        numel = math.prod(shape)
        if entry.dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"{context}: bitmask entry has dtype {entry.dtype}, expected one of float32, float16, bfloat16"
            )
        mask = entry_buffer(entry, "mask", context)
        values = entry_buffer(entry, "values", context)
        if mask.dtype != torch.uint8 or mask.numel() != mask_nbytes(numel):
            raise CheckpointError(
                f"{context}: mask is {mask.dtype} x {mask.numel()}, expected uint8 x "
                f"{mask_nbytes(numel)} for shape {shape}"
            )
        if values.dtype != entry.dtype or values.numel() > numel:
            raise CheckpointError(
                f"{context}: values are {values.dtype} x {values.numel()}, expected {entry.dtype} "
                f"x at most {numel} for shape {shape}"
            )
        # Checked wherever the buffers are: a file read to a GPU (read_file(device=...))
        # reaches here with its buffers already there.
        count, padded = mask_popcount(mask, numel)
        if count != values.numel() or padded:
            raise CheckpointError(
                f"{context}: bitmask mask has {count} set bits"
                f"{' and padding bits set' if padded else ''}, expected {values.numel()} "
                "(one per stored value) and clear padding"
            )
        dev = mask.device if device is None else device
        mask, values = move_to(mask.reshape(-1), dev), move_to(values.reshape(-1), dev)
        return ops.bitmask_decode(mask, values, numel).view(shape)


__all__ = [
    "CLUSTERED_FACTOR",
    "SPARSE_MAX_RATIO",
    "SPARSE_MIN_NUMEL",
    "BitmaskCodec",
    "bitmask_nbytes",
    "mask_popcount",
    "nonzero_count",
    "sparse_candidate",
    "sparse_pays",
    "sparsity_counts",
]
