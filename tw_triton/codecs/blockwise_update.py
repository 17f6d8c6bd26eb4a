"""Adam's first moment coded in the update's domain: ``u = m / (sqrt(v_hat) + eps)``.

An entry of this codec depends on another entry of the same file, its *partner* (the
second moment ``exp_avg_sq``, or ``max_exp_avg_sq`` with amsgrad): ``v_hat`` is the
partner as a loader decodes it, ``u`` is coded by the blockwise codec without a reference,
and the decode is ``m_hat = u_hat * (sqrt(v_hat) + eps)``. All of it is correctly rounded
fp32 torch ops (``sqrt``, ``+``, ``/``, ``*``, each rounded on its own) around the
blockwise op, so a CPU and a GPU give the same bytes and values. The state API encodes such
entries after the others, and decodes them after their partners (:mod:`tw_triton.state`).
Why and what it measured: docs/codecs.md, "The first moment in the update's domain".
"""

from __future__ import annotations

import math
from collections.abc import Container, Hashable, Mapping, Sequence
from typing import Any

import torch

from .. import ops
from ..errors import CheckpointError, QuantizationError
from ..ops.layout import FLOAT_DTYPES, check_params, check_qmax, qmax_for
from ..qstate import EncodedEntry
from ..snapshot_pool import Allocator
from .arguments import check_input
from .base import Codec, Encoded, check_param_names, move_to, param_error
from .blockwise import BlockwiseCodec, QuantizedTensor, dequantize
from .packed import PACKING, check_packed_params, per_block_buffer, stored_codes

DEFAULT_EPS = 1e-8
# The sibling keys tried, in order, when a rule names none: amsgrad divides by the maximum.
PARTNER_KEYS = ("max_exp_avg_sq", "exp_avg_sq")

_blockwise = BlockwiseCodec()


def _check_eps(eps: Any) -> float | None:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return None
    eps = float(eps)
    return eps if math.isfinite(eps) and eps > 0 else None


def denominator(v_hat: torch.Tensor, eps: float) -> torch.Tensor:
    """``sqrt(v_hat) + eps`` in fp32, each op correctly rounded on its own (``eps``
    rounded to fp32): :func:`tw_triton.ops.update_root`."""
    return ops.update_root(v_hat.float().contiguous(), eps)


def _inner(params: Mapping[str, Any]) -> dict[str, Any]:
    """The blockwise params that code ``u``."""
    out = {"bits": params["bits"], "block": params["block"], "packing": PACKING, "delta": False}
    if "qmax" in params:
        out["qmax"] = params["qmax"]
    return out


class BlockwiseUpdateCodec(Codec):
    """``exp_avg / (sqrt(v_hat) + eps)`` coded blockwise, ``v_hat`` its partner's decode."""

    name = "blockwise-update"
    has_partners = True
    _KEYS = frozenset({"bits", "block", "qmax", "eps", "partner_key", "fallback_bits"})
    _STORED = frozenset({"bits", "block", "packing", "eps", "partner"})
    _STORED_OPTIONAL = frozenset({"qmax"})

    def resolve_params(self, params: Mapping[str, Any], *, bits: int, block: int) -> dict[str, Any]:
        unknown = set(params) - self._KEYS
        if unknown:
            raise QuantizationError(
                f"codec {self.name!r} has no parameter(s) {sorted(unknown)}; it takes {sorted(self._KEYS)}"
            )
        out: dict[str, Any] = {"bits": params.get("bits", bits), "block": params.get("block", block)}
        qmax = params.get("qmax")
        if out["bits"] == 3:  # int3: seven levels in 4 bits
            out["bits"], qmax = 4, 3 if qmax is None else qmax
        check_params(out["bits"], out["block"])
        if qmax is not None and check_qmax(out["bits"], qmax) != qmax_for(out["bits"]):
            out["qmax"] = qmax
        fallback = params.get("fallback_bits")
        if fallback is not None:
            # The blockwise bits of an entry without a partner (and of DCP's chunks): a preset
            # keeps there the bits its moments had before the update's domain.
            if isinstance(fallback, bool) or fallback not in (2, 3, 4, 8):
                raise QuantizationError(
                    f"codec {self.name!r}: fallback_bits must be 2, 3 (int3), 4 or 8, got {fallback!r}"
                )
            out["fallback_bits"] = fallback
        eps = _check_eps(params.get("eps", DEFAULT_EPS))
        if eps is None:
            raise QuantizationError(f"codec {self.name!r}: eps must be a positive finite number")
        out["eps"] = eps
        key = params.get("partner_key")
        if key is not None:
            if not isinstance(key, str) or not key or "/" in key:
                raise QuantizationError(f"codec {self.name!r}: partner_key must be a key name, got {key!r}")
            out["partner_key"] = key
        return out

    def accepts(self, tensor: torch.Tensor) -> bool:
        return tensor.dtype in FLOAT_DTYPES and tensor.numel() > 0

    def partner_path(self, path: str, params: Mapping[str, Any], present: Container[str]) -> str | None:
        """The sibling of ``path`` named by the rule's ``partner_key``, else the first of
        :data:`PARTNER_KEYS` in ``present``; ``None`` where there is none."""
        parent = path.rpartition("/")[0]
        keys = [params["partner_key"]] if "partner_key" in params else PARTNER_KEYS
        found = [f"{parent}/{k}" if parent else k for k in keys]
        return next((p for p in found if p in present and p != path), None)

    def partner_of(self, params: Mapping[str, Any]) -> str | None:
        return params.get("partner") if isinstance(params, Mapping) else None

    def inner_spec(self, params: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        """The codec and params that code ``u`` (the kernels an entry launches)."""
        return "blockwise", _inner(params)

    def fallback_spec(self, params: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        fallback = params.get("fallback_bits")
        if fallback is None:
            return "blockwise", _inner(params)
        bits = {"bits": 4, "qmax": 3} if fallback == 3 else {"bits": fallback}  # 3: int3
        return "blockwise", _inner({"block": params["block"], **bits})

    def encode(self, x: torch.Tensor, params: Mapping[str, Any], reference: torch.Tensor | None) -> Encoded:
        raise QuantizationError(
            f"codec {self.name!r} codes a tensor with its partner's decoded values "
            "(quantize_state_dict passes them); it cannot encode a tensor alone"
        )

    def encode_with_partner(
        self,
        x: torch.Tensor,
        params: Mapping[str, Any],
        partner_path: str,
        partner: torch.Tensor,
        allocate: Allocator | None,
    ) -> Encoded:
        v = move_to(partner, x.device).float().contiguous()
        u = ops.update_divide(x.float().contiguous(), v, params["eps"])
        inner = _inner(params)
        if allocate is None:
            enc = _blockwise.encode(u, inner, None)
        else:
            enc = _blockwise.encode_with(u, inner, None, allocate)
        # An infinite partner gives u = 0 that decodes to 0 * inf: stored exact, as NaN/Inf.
        # amax (one read, NaN propagating) rather than isfinite (a mask written): 90x faster
        # on a CPU; a -inf partner gives a NaN u, which the blockwise encode flags.
        unusable = torch.logical_or(enc.unusable, ~torch.isfinite(torch.amax(v)))  # type: ignore[arg-type]
        return Encoded(self._entry(x, params, partner_path, enc.entry), unusable=unusable)

    def _entry(self, x: torch.Tensor, params: Mapping[str, Any], partner_path: str, inner: EncodedEntry):
        stored = {k: v for k, v in inner.params.items() if k != "delta"}
        return EncodedEntry(
            codec=self.name,
            params={**stored, "eps": params["eps"], "partner": partner_path},
            shape=tuple(x.shape),
            dtype=x.dtype,
            buffers=inner.buffers,
        )

    def encode_group_with_partners(
        self,
        xs: Sequence[torch.Tensor],
        params: Mapping[str, Any],
        partner_paths: Sequence[str],
        partners: Sequence[torch.Tensor],
        flags: torch.Tensor,
    ) -> list[Encoded]:
        """:meth:`encode_with_partner` of device tensors with one grouped op
        (:func:`~tw_triton.ops.quantize_blockwise_update_many`): the same bytes each alone;
        tensor ``i``'s flag is ``flags[i]`` (int64, zero on entry)."""
        for x in xs:
            check_input(x, None)
        inner = _inner(params)
        bits, block = inner["bits"], inner["block"]
        pairs = ops.quantize_blockwise_update_many(
            list(xs),
            [move_to(p, x.device) for p, x in zip(partners, xs)],
            params["eps"],
            bits,
            block,
            flags=flags,
            qmax=check_qmax(bits, inner.get("qmax")),
        )
        return [
            Encoded(
                self._entry(x, params, path, _blockwise.entry_of(x, inner, False, c, s)), unusable=flags[i]
            )
            for i, (x, path, (c, s)) in enumerate(zip(xs, partner_paths, pairs))
        ]

    def check_stored_params(self, params: Mapping[str, Any], context: str) -> None:
        check_param_names(params, self.name, self._STORED, self._STORED_OPTIONAL, context)
        check_packed_params(params, context)
        if "qmax" in params:
            try:
                check_qmax(params["bits"], params["qmax"])
            except QuantizationError:
                raise param_error(
                    context, "qmax", params["qmax"], f"an int from 1 to {qmax_for(params['bits'])}"
                ) from None
        if _check_eps(params["eps"]) is None:
            raise param_error(context, "eps", params["eps"], "a positive finite number")
        if not isinstance(params["partner"], str) or not params["partner"]:
            raise param_error(context, "partner", params["partner"], "the path of an entry of the file")

    def decode(
        self,
        entry: EncodedEntry,
        reference: torch.Tensor | None,
        device: torch.device | None,
        context: str,
    ) -> torch.Tensor:
        raise CheckpointError(
            f"{context}: decoded without its partner entry {self.partner_of(entry.params)!r} "
            "(the state API decodes it after its partner)"
        )

    def checked_parts(
        self, entry: EncodedEntry, partner: torch.Tensor, context: str
    ) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        """``(bits, block, codes, scales)`` of a stored entry, its params, buffers and
        partner (float32 of its shape) checked.

        Raises:
            CheckpointError: naming ``context`` and what was expected.
        """
        self.check_stored_params(entry.params, context)
        bits, block, codes = stored_codes(entry, context)
        scales = per_block_buffer(entry, "scales", torch.float32, block, context)
        if partner.dtype != torch.float32 or tuple(partner.shape) != tuple(entry.shape):
            raise CheckpointError(
                f"{context}: partner {entry.params['partner']!r} decodes to {partner.dtype} of shape "
                f"{tuple(partner.shape)}, expected float32 of shape {tuple(entry.shape)}"
            )
        return bits, block, codes, scales

    def decode_with_partner(
        self, entry: EncodedEntry, partner: torch.Tensor, device: torch.device | None, context: str
    ) -> torch.Tensor:
        bits, block, codes, scales = self.checked_parts(entry, partner, context)
        dev = codes.device if device is None else device
        q = QuantizedTensor.stored(codes, scales, tuple(entry.shape), torch.float32, bits, block, dev)
        # Saturated as the blockwise decode is: a finite tensor never decodes to +-inf.
        big = torch.finfo(entry.dtype).max
        v = move_to(partner, dev).float().contiguous()
        return ops.update_multiply(dequantize(q), v, entry.params["eps"], big).to(entry.dtype)

    def partner_group_key(self, entry: EncodedEntry) -> Hashable | None:
        params = entry.params
        key = (params.get("bits"), params.get("block"), params.get("eps"), entry.dtype)
        try:
            hash(key)
        except TypeError:  # params no encoder writes: decoded alone, which says what is wrong
            return None
        return key if entry.dtype in FLOAT_DTYPES else None

    def decode_group_with_partners(
        self,
        entries: Sequence[EncodedEntry],
        partners: Sequence[torch.Tensor],
        device: torch.device,
        contexts: Sequence[str],
    ) -> list[torch.Tensor]:
        """:meth:`decode_with_partner` of each entry (one bits, block, eps and dtype) with
        one grouped op (:func:`~tw_triton.ops.dequantize_blockwise_update_many`), after
        every entry's checks: the same values each alone."""
        parts = [self.checked_parts(e, p, c) for e, p, c in zip(entries, partners, contexts)]
        flat = ops.dequantize_blockwise_update_many(
            [move_to(codes.reshape(-1), device) for _, _, codes, _ in parts],
            [move_to(scales.reshape(-1), device) for _, _, _, scales in parts],
            [math.prod(e.shape) for e in entries],
            [move_to(p, device).reshape(-1) for p in partners],
            entries[0].params["eps"],
            parts[0][0],
            parts[0][1],
            entries[0].dtype,
        )
        return [t.view(tuple(e.shape)) for t, e in zip(flat, entries)]
