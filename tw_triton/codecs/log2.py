"""The second-moment codec ``log2``: blockwise codes of a non-negative tensor in a log domain.

AdamW's ``exp_avg_sq`` is non-negative and spans the square of the gradient's range (often
30 octaves and more inside one tensor). Linear codes round its small entries to zero or, as a
delta, below zero, and the resumed step ``m / (sqrt(v) + eps)`` then explodes. This codec
codes the *logarithm* instead, with exact zero kept apart, so that no decoded value is ever
negative and none is zero unless the input was:

* ``t = bits(fp32(v))``, the fp32 bit pattern as an int32. For a positive ``v``,
  ``t / 2**23 - 127`` is a piecewise-linear ``log2 v`` (exact at powers of two, within 0.086
  of it in between): monotone, integer, and the same on every device, with no
  transcendental function whose rounding differs between libraries;
* per block of ``block`` elements, ``lo`` and ``hi`` are the smallest and largest ``t`` of
  the block's positive values (``0, 0`` when there is none; ``-1, -1`` when the block holds
  a negative, NaN or infinite element, which cannot be coded: all its codes are then 0);
* ``step = fl32(fl32(hi - lo) / N)`` with ``N = 2**bits - 2`` steps between
  ``2**bits - 1`` levels;
* a positive element gets ``u = 1 + min(N, rne(fl32(fl32(t - lo) / step)))`` (``u = 1`` when
  ``step`` is 0); a zero (``+0`` or ``-0``) gets ``u = 0``: code 0 is reserved for exact zero;
* codes are packed LSB-first as in :mod:`tw_triton.codecs.blockwise`.

Decoding: ``u = 0`` gives ``+0``; otherwise ``t_hat = min(hi, lo + trunc(fl32(fl32(u - 1) *
step) + 0.5))`` and ``v_hat = cast(as_fp32(t_hat))``, a positive fp32 between the block's
smallest and largest positive input, hence (rounding being monotone) a positive value of the
original dtype. The error in ``t`` is at most ``step / 2`` plus a few units of fp32 rounding,
so the relative error of ``v`` is about ``2**(step / 2**24) - 1``: with 4 bits and a block
spanning 20 octaves, a factor of at most ``2**(20/28)``, about 1.64.

A negative, NaN or infinite element cannot be coded: its block gets bounds ``-1`` and the
encoder's flag (:attr:`Log2Tensor.unusable`, a device bool, no sync) turns true, and the
state-level code stores that tensor exact, as for the blockwise codec.

Every operation above is an integer operation or a correctly rounded fp32 one, so every
backend of the ops :func:`tw_triton.ops.quantize_log2` / :func:`~tw_triton.ops.dequantize_log2`
(the torch spec in :mod:`tw_triton.ops.reference.log2`, the compiled CPU codec, the Triton
kernels) gives the same bytes and the same decoded tensors (docs/codecs.md). Stored bytes
per element: ``bits / 8 + 8 / block`` (two int32 bounds per block).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import ops
from ..errors import QuantizationError

# The spec and CPU backend under their names of this module, which benchmarks and tests use.
from ..ops.backends.cpu import dequantize_log2_cpu, quantize_log2_cpu  # noqa: F401,E402
from ..ops.layout import FLOAT_DTYPES, check_params, num_blocks, packed_nbytes
from ..ops.reference.log2 import CHUNK_ELEMENTS, dequantize_log2_torch, levels, quantize_log2_torch  # noqa: F401,E402
from ..qstate import EncodedEntry
from ..snapshot_pool import Allocator
from .base import BatchLayout, Codec, Encoded, check_param_names, host_outputs, move_to
from .blockwise import batchable
from .grouped import fits, shaped
from .packed import PACKING, check_packed_params, per_block_buffer, stored_codes


@dataclass(frozen=True)
class Log2Tensor:
    """A non-negative tensor encoded by the ``log2`` codec.

    Attributes:
        codes: packed codes, ``uint8``, ``ceil(numel * bits / 8)`` bytes.
        lo, hi: int32, one per block: the smallest and largest fp32 bit pattern of the
            block's positive elements (both 0 for a block without one).
        shape, dtype: of the original tensor.
        bits, block: code width (8, 4 or 2) and elements per block.
        unusable: 0-dim bool on the codes' device, true when some element was negative,
            NaN or infinite: the tensor must then be stored exact.
    """

    codes: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype
    bits: int
    block: int
    unusable: torch.Tensor

    @property
    def numel(self) -> int:
        """Elements of the original tensor."""
        return math.prod(self.shape)


def check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise QuantizationError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise QuantizationError(f"log2 codes float32, float16 or bfloat16 tensors, got {x.dtype}")


def quantize_log2(
    x: torch.Tensor, *, bits: int = 4, block: int = 128, out: tuple[torch.Tensor, ...] | None = None
) -> Log2Tensor:
    """Encode a non-negative tensor with the ``log2`` codec (see the module doc).

    On a CUDA tensor one fused Triton kernel does it; on a CPU tensor the torch path gives
    the same bytes, written into ``out`` (``(codes, lo, hi)``) when given. Nothing here
    synchronizes with the device.

    Raises:
        QuantizationError: an unsupported dtype, bits or block.
    """
    check_input(x)
    check_params(bits, block)
    codes, lo, hi = ops.quantize_log2(x, bits, block, out=out)
    # The flag stays on the device: no sync here.
    unusable = unusable_flag(hi)
    return Log2Tensor(codes, lo, hi, tuple(x.shape), x.dtype, bits, block, unusable)


def unusable_flag(hi: torch.Tensor) -> torch.Tensor:
    """The device flag of a tensor with a negative, NaN or infinite element: some block's
    bounds are ``-1``."""
    return (hi < 0).any()


def dequantize_log2(q: Log2Tensor, *, device: torch.device | str | None = None) -> torch.Tensor:
    """Decode a :class:`Log2Tensor` to its shape and dtype, on ``device`` (default: where
    its codes are)."""
    if not isinstance(q, Log2Tensor):
        raise QuantizationError(f"expected a Log2Tensor, got {type(q).__name__}")
    dev = q.codes.device if device is None else torch.device(device)
    codes, lo, hi = (t.to(dev, non_blocking=t.is_pinned()) for t in (q.codes, q.lo, q.hi))
    flat = ops.dequantize_log2(codes, lo, hi, q.numel, q.bits, q.block, q.dtype)
    return flat.view(q.shape)


class Log2Codec(Codec):
    """Registry entry ``log2``: the second-moment codec (no reference; see the module doc)."""

    name = "log2"
    has_kernel = True
    _KEYS = frozenset({"bits", "block", "packing"})

    def resolve_params(self, params: Mapping[str, Any], *, bits: int, block: int) -> dict[str, Any]:
        unknown = set(params) - self._KEYS
        if unknown:
            raise QuantizationError(
                f"codec 'log2' has no parameter(s) {sorted(unknown)}; it takes {sorted(self._KEYS)}"
            )
        out = {
            "bits": params.get("bits", bits),
            "block": params.get("block", block),
            "packing": params.get("packing", PACKING),
        }
        check_params(out["bits"], out["block"])
        if out["packing"] != PACKING:
            raise QuantizationError(f"codec 'log2' packs {PACKING!r} only, got {out['packing']!r}")
        return out

    def accepts(self, tensor: torch.Tensor) -> bool:
        return tensor.dtype in FLOAT_DTYPES and tensor.numel() > 0

    def uses_reference(self, params: Mapping[str, Any]) -> bool:
        return False

    def check_stored_params(self, params: Mapping[str, Any], context: str) -> None:
        check_param_names(params, self.name, self._KEYS, frozenset(), context)
        check_packed_params(params, context)

    def encode(self, x: torch.Tensor, params: Mapping[str, Any], reference: torch.Tensor | None) -> Encoded:
        return self._encoded(x, params, None)

    def encode_with(
        self,
        x: torch.Tensor,
        params: Mapping[str, Any],
        reference: torch.Tensor | None,
        allocate: Allocator,
    ) -> Encoded:
        nblocks = num_blocks(x.numel(), params["block"])
        sizes = [
            (packed_nbytes(x.numel(), params["bits"]), torch.uint8),
            (nblocks, torch.int32),
            (nblocks, torch.int32),
        ]
        return self._encoded(x, params, host_outputs(x, allocate, sizes))

    def batch_key(
        self, x: torch.Tensor, params: Mapping[str, Any], reference: torch.Tensor | None
    ) -> Hashable | None:
        return x.dtype if batchable(x, params["block"], None) else None

    def batch_layout(self, params: Mapping[str, Any]) -> BatchLayout:
        # Blocks are coded alone, and each tensor is whole blocks.
        bits, block = params["bits"], params["block"]
        return BatchLayout(
            lambda n: {"codes": n * bits // 8, "lo": n // block, "hi": n // block},
            lambda b: unusable_flag(b["hi"]),
        )

    def group_key(
        self, x: torch.Tensor, params: Mapping[str, Any], reference: torch.Tensor | None
    ) -> Hashable | None:
        return ()  # the grouped op splits by dtype itself

    def encode_group(
        self,
        xs: Sequence[torch.Tensor],
        params: Mapping[str, Any],
        references: Sequence[torch.Tensor] | None,
        flags: torch.Tensor,
    ) -> list[Encoded]:
        for x in xs:
            check_input(x)
        check_params(params["bits"], params["block"])
        triples = ops.quantize_log2_many(list(xs), params["bits"], params["block"], flags=flags)
        return [
            Encoded(self.entry_of(x, params, buffers), unusable=flags[i])
            for i, (x, buffers) in enumerate(zip(xs, triples))
        ]

    def entry_of(
        self, x: torch.Tensor, params: Mapping[str, Any], buffers: tuple[torch.Tensor, ...]
    ) -> EncodedEntry:
        codes, lo, hi = buffers
        return EncodedEntry(
            codec=self.name,
            params={"bits": params["bits"], "block": params["block"], "packing": PACKING},
            shape=tuple(x.shape),
            dtype=x.dtype,
            buffers={"codes": codes, "lo": lo, "hi": hi},
        )

    def _encoded(
        self, x: torch.Tensor, params: Mapping[str, Any], out: tuple[torch.Tensor, ...] | None
    ) -> Encoded:
        q = quantize_log2(x, bits=params["bits"], block=params["block"], out=out)
        return Encoded(self.entry_of(x, params, (q.codes, q.lo, q.hi)), unusable=q.unusable)

    def decode(
        self,
        entry: EncodedEntry,
        reference: torch.Tensor | None,
        device: torch.device | None,
        context: str,
    ) -> torch.Tensor:
        self.check_stored_params(entry.params, context)
        bits, block, codes = stored_codes(entry, context)
        lo, hi = (per_block_buffer(entry, n, torch.int32, block, context) for n in ("lo", "hi"))
        shape = tuple(entry.shape)
        dev = codes.device if device is None else device
        q = Log2Tensor(
            codes=move_to(codes.reshape(-1), dev),
            lo=move_to(lo.reshape(-1), dev),
            hi=move_to(hi.reshape(-1), dev),
            shape=shape,
            dtype=entry.dtype,
            bits=bits,  # type: ignore[arg-type]
            block=block,  # type: ignore[arg-type]
            unusable=torch.zeros((), dtype=torch.bool, device=dev),
        )
        return dequantize_log2(q)

    def decode_group_key(self, entry: EncodedEntry, reference: torch.Tensor | None) -> Hashable | None:
        # Absolute codes (a keyframe's second moments); decodes given a reference stay alone.
        if reference is not None:
            return None
        return (entry.params.get("bits"), entry.params.get("block"), entry.dtype)

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
        """:meth:`decode` of entries of one :meth:`decode_group_key` with one grouped op,
        into ``outs[i]`` where it is a contiguous tensor of the entry's dtype and size on
        ``device``. ``check`` changes nothing: every code and bound decodes (as in
        :meth:`decode`), once their sizes are checked."""
        codes, lo, hi = [], [], []
        for entry, context in zip(entries, contexts):
            self.check_stored_params(entry.params, context)
            _, block, c = stored_codes(entry, context)
            codes.append(move_to(c.reshape(-1), device))
            for name, into in (("lo", lo), ("hi", hi)):
                into.append(
                    move_to(per_block_buffer(entry, name, torch.int32, block, context).reshape(-1), device)
                )
        bits, block, dtype = entries[0].params["bits"], entries[0].params["block"], entries[0].dtype
        numels = [math.prod(tuple(e.shape)) for e in entries]
        given = [None] * len(entries) if outs is None else list(outs)
        into = [
            o.view(-1) if o is not None and fits(o, dtype, n, device) else None for o, n in zip(given, numels)
        ]
        flat = ops.dequantize_log2_many(codes, lo, hi, numels, bits, block, dtype, out=into)
        return [shaped(t, e.shape, o, i) for t, e, o, i in zip(flat, entries, given, into)]


__all__ = [
    "Log2Tensor",
    "Log2Codec",
    "quantize_log2",
    "dequantize_log2",
    "quantize_log2_torch",
    "dequantize_log2_torch",
    "levels",
]
