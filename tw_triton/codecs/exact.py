"""The exact codec: a tensor stored as it is, in its own dtype (buffer ``data``, no params).

See docs/codecs.md for when the state API stores a tensor exact.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch

from .. import ops
from ..errors import CheckpointError, QuantizationError
from ..qstate import EncodedEntry
from ..snapshot_pool import Allocator
from .base import Codec, Encoded, check_param_names, entry_buffer, move_to

# Dtypes the exact codec stores: those safetensors has a name for.
EXACT_DTYPES = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)


class ExactCodec(Codec):
    """Stores the tensor unchanged (a contiguous clone)."""

    name = "exact"
    lossless = True

    def resolve_params(self, params: Mapping[str, Any], *, bits: int, block: int) -> dict[str, Any]:
        if params:
            raise QuantizationError(f"codec 'exact' takes no parameters, got {dict(params)}")
        return {}

    def accepts(self, tensor: torch.Tensor) -> bool:
        return tensor.dtype in EXACT_DTYPES

    def uses_reference(self, params: Mapping[str, Any]) -> bool:
        return False

    def check_stored_params(self, params: Mapping[str, Any], context: str) -> None:
        check_param_names(params, self.name, frozenset(), frozenset(), context)

    def encode(self, x: torch.Tensor, params: Mapping[str, Any], reference: torch.Tensor | None) -> Encoded:
        self._check_dtype(x)
        data = x.detach().clone(memory_format=torch.contiguous_format)
        return self._entry(x, data)

    def encode_with(
        self,
        x: torch.Tensor,
        params: Mapping[str, Any],
        reference: torch.Tensor | None,
        allocate: Allocator,
    ) -> Encoded:
        self._check_dtype(x)
        data = allocate(tuple(x.shape), x.dtype, x.device)
        data.copy_(x.detach())
        return self._entry(x, data)

    def group_key(
        self, x: torch.Tensor, params: Mapping[str, Any], reference: torch.Tensor | None
    ) -> Hashable | None:
        return ()  # any dtypes: a copy is bytes

    def encode_group(
        self,
        xs: Sequence[torch.Tensor],
        params: Mapping[str, Any],
        references: Sequence[torch.Tensor] | None,
        flags: torch.Tensor,
    ) -> list[Encoded]:
        for x in xs:
            self._check_dtype(x)
        return [self._entry(x, data) for x, data in zip(xs, ops.copy_many(list(xs)))]

    def wrap(self, x: torch.Tensor) -> Encoded:
        """The entry of a contiguous ``x`` that holds ``x`` itself, not a copy.

        Only for a tensor that is already a private snapshot (nothing changes it until the
        entry is written): :meth:`encode` must copy, this does not.
        """
        self._check_dtype(x)
        if not x.is_contiguous():
            raise QuantizationError("only a contiguous tensor can be stored without a copy")
        return self._entry(x, x.detach())

    def _check_dtype(self, x: torch.Tensor) -> None:
        if x.dtype not in EXACT_DTYPES:
            raise QuantizationError(
                f"dtype {x.dtype} cannot be stored: the format holds "
                f"{', '.join(str(d).removeprefix('torch.') for d in EXACT_DTYPES)}"
            )

    def _entry(self, x: torch.Tensor, data: torch.Tensor) -> Encoded:
        entry = EncodedEntry(
            codec=self.name, params={}, shape=tuple(x.shape), dtype=x.dtype, buffers={"data": data}
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
        data = entry_buffer(entry, "data", context)
        shape = tuple(entry.shape)
        if data.dtype != entry.dtype or data.numel() != math.prod(shape):
            raise CheckpointError(
                f"{context}: exact buffer is {data.dtype} with {data.numel()} elements, "
                f"expected {entry.dtype} with shape {shape}"
            )
        # No copy on the host: the buffer read from the file is the tensor.
        return move_to(data.reshape(shape), device)
