"""The codec interface: what every codec of the registry implements.

A codec turns a tensor (and, for delta codecs, the reference tensor at the same path) into an
:class:`~tw_triton.qstate.EncodedEntry` (a codec name, JSON parameters and named buffers)
and decodes such an entry back. See :mod:`tw_triton.codecs` for the registry and
docs/codecs.md for writing a codec.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Container, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointError
from ..qstate import EncodedEntry
from ..snapshot_pool import Allocator


@dataclass
class Encoded:
    """What :meth:`Codec.encode` returns.

    Attributes:
        entry: the encoded tensor.
        unusable: ``None``, or a 0-dim bool tensor on the tensor's device that is true when
            this encoding cannot represent the tensor (a NaN/Inf block) and the tensor must
            be stored exact instead. It is a device flag so that the state API can read all
            of them with one host sync.
    """

    entry: EncodedEntry
    unusable: torch.Tensor | None = None


class Codec(ABC):
    """One way to store a tensor. Subclasses set :attr:`name` and implement the methods."""

    name: str = ""
    #: Whether encode/decode of CUDA tensors run Triton kernels that must match the torch
    #: path byte for byte (``benchmarks/gpu/validate.py`` compares every codec that says so).
    has_kernel: bool = False
    #: Whether a tensor without a tensor of its shape in the reference is coded on its own
    #: (stored ``delta: false``) instead of refused: for state that may appear after a
    #: keyframe, such as an optimizer's moments (created at its first step).
    reference_optional: bool = False
    #: Whether entries are coded with another entry's decoded tensor, their partner
    #: (:meth:`partner_path`; the state API encodes them last and decodes them last).
    has_partners: bool = False
    #: Whether a decode gives back every bit of what was encoded (``tw convert`` reports a
    #: file holding only such entries as lossless).
    lossless: bool = False
    #: Params whose value may differ between the tensors of one grouped encode (the rest
    #: are the group's): :meth:`encode_group` then also gets each tensor's params, ``each``.
    tensor_params: frozenset[str] = frozenset()

    @abstractmethod
    def resolve_params(self, params: Mapping[str, Any], *, bits: int, block: int) -> dict[str, Any]:
        """Validate rule parameters and fill defaults (``bits``/``block`` of the call).

        Raises:
            QuantizationError: unknown or invalid parameters.
        """

    @abstractmethod
    def accepts(self, tensor: torch.Tensor) -> bool:
        """Whether this codec can encode ``tensor`` (dtype, size). Rules skip it otherwise."""

    def uses_reference(self, params: Mapping[str, Any]) -> bool:
        """Whether an entry with these (resolved or stored) params is a delta."""
        return bool(params.get("delta", False))

    def keyframe_spec(self, params: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        """``(codec name, params)`` a keyframe stores a tensor with that this codec
        delta-codes (:func:`~tw_triton.rules.keyframe_rules`): exact by default, so the
        deltas after it decode against exact values. A codec that returns a lossy codec
        here is coded against that codec's reconstruction of the keyframe."""
        return "exact", {}

    @abstractmethod
    def encode(self, x: torch.Tensor, params: Mapping[str, Any], reference: torch.Tensor | None) -> Encoded:
        """Encode ``x`` on its own device. The buffers must not alias ``x`` (a snapshot).

        ``reference`` is given only when :meth:`uses_reference` is true and a reference
        state was passed; the stored params must say whether it was used.
        """

    def encode_with(
        self,
        x: torch.Tensor,
        params: Mapping[str, Any],
        reference: torch.Tensor | None,
        allocate: Allocator,
    ) -> Encoded:
        """:meth:`encode`, writing the output buffers into memory from ``allocate``.

        ``allocate(shape, dtype, device)`` returns an uninitialized contiguous tensor
        (recycled host memory from a :class:`~tw_triton.snapshot_pool.SnapshotPool`).
        The result must be the same as :meth:`encode`'s. The default ignores
        ``allocate``: a codec that cannot write into given buffers still works.
        """
        return self.encode(x, params, reference)

    def batch_key(
        self, x: torch.Tensor, params: Mapping[str, Any], reference: torch.Tensor | None
    ) -> Hashable | None:
        """A key under which the encode of ``x`` may run in one call with other tensors of
        the same codec, params and key (:meth:`encode_many`); ``None``: encode it alone
        (the default)."""
        return None

    def batch_layout(self, params: Mapping[str, Any]) -> BatchLayout | None:
        """How a batch's buffers split into its tensors' (:func:`split_encoded`), for a
        codec that can encode tensors of a :meth:`batch_key` as their flat concatenation;
        ``None`` (the default): encode them one at a time."""
        return None

    def encode_many(
        self,
        xs: Sequence[torch.Tensor],
        params: Mapping[str, Any],
        references: Sequence[torch.Tensor] | None,
        allocate: Allocator | None,
    ) -> list[Encoded]:
        """Encode tensors that share params and a :meth:`batch_key`, with the references
        at the same positions (``None``: no reference for any). Each result is what
        :meth:`encode` (``allocate`` ``None``) or :meth:`encode_with` gives for that tensor
        alone: one encode of the concatenation where :meth:`batch_layout` says how to split
        it, else one encode each."""
        refs = [None] * len(xs) if references is None else references
        layout = self.batch_layout(params) if len(xs) > 1 else None
        if layout is not None:
            # Only tensors that share one key concatenate to what each gives alone.
            keys = {self.batch_key(x, params, r) for x, r in zip(xs, refs)}
            if len(keys) != 1 or None in keys:
                layout = None
        if layout is None:
            if allocate is None:
                return [self.encode(x, params, r) for x, r in zip(xs, refs)]
            return [self.encode_with(x, params, r, allocate) for x, r in zip(xs, refs)]
        x = torch.cat([t.view(-1) for t in xs])
        ref = None if references is None else torch.cat([t.view(-1) for t in references])
        whole = (
            self.encode(x, params, ref) if allocate is None else self.encode_with(x, params, ref, allocate)
        )
        return split_encoded(whole, xs, layout)

    def group_key(
        self, x: torch.Tensor, params: Mapping[str, Any], reference: torch.Tensor | None
    ) -> Hashable | None:
        """A key under which the encode of a device tensor may share kernel launches with
        others of the same codec, params and key (:meth:`encode_group`); ``None`` (the
        default): encode it alone."""
        return None

    def encode_group(
        self,
        xs: Sequence[torch.Tensor],
        params: Mapping[str, Any],
        references: Sequence[torch.Tensor] | None,
        flags: torch.Tensor,
    ) -> list[Encoded]:
        """Encode device tensors of one :meth:`group_key` in a number of launches that does
        not grow with their count. Each result is what :meth:`encode` gives that tensor
        alone, except its ``unusable`` flag: element ``i`` of ``flags`` (int64, zero on
        entry, on the tensors' device), raised where tensor ``i`` cannot be coded. A codec
        with :attr:`tensor_params` takes a keyword ``each``, tensor ``i``'s params at ``i``.
        """
        raise NotImplementedError(f"codec {self.name!r} has no grouped encode")

    def decode_group_key(self, entry: EncodedEntry, reference: torch.Tensor | None) -> Hashable | None:
        """A key under which the decode of ``entry`` (against ``reference``) on a device
        may share launches with others of the same codec and key (:meth:`decode_group`);
        ``None`` (the default): decode it alone."""
        return None

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
        """:meth:`decode` of entries of one :meth:`decode_group_key` on ``device``, in a
        number of launches that does not grow with their count.

        ``check``: the entries were read from a file, so their codes are checked as
        :meth:`decode` checks them before anything is written, with one host read for the
        whole group; without it they are this process's own encodings (a closed-loop
        save's, advancing its reference) and the checks that only a corrupt file fails are
        skipped. ``outs[i]``, where given, is a tensor to decode entry ``i`` into (its
        reference itself, which nothing else reads): written in place where the codec can,
        so the reference is not held twice; the result is then ``outs[i]``.

        Raises:
            CheckpointError: an entry's buffers or params are not what the codec stores, or
                (``check``) its codes are not what an encoder writes; the message names
                the entry by its context.
        """
        raise NotImplementedError(f"codec {self.name!r} has no grouped decode")

    def check_stored_params(self, params: Mapping[str, Any], context: str) -> None:  # noqa: B027 - optional hook
        """Check the params an entry of this codec records in a file: every name known, each
        value of its type and in its range, so that a file edited to hold another value
        (``"delta": 1``, ``"bits": 3``) is refused instead of decoded some other way.

        Called before an entry is decoded and when a checkpoint is checked for loading. The
        default checks nothing: a plug-in codec that predates this method checks its params
        in :meth:`decode`.

        Raises:
            CheckpointError: naming ``context``, the param and what was expected.
        """

    @abstractmethod
    def decode(
        self,
        entry: EncodedEntry,
        reference: torch.Tensor | None,
        device: torch.device | None,
        context: str,
    ) -> torch.Tensor:
        """Decode ``entry`` on ``device`` (``None``: where its buffers are).

        ``context`` names the file and entry for error messages.

        Raises:
            CheckpointError: the entry's params or buffers are not what this codec writes.
        """

    # Codecs whose entries are coded with another entry's decoded tensor, their *partner*
    # in the same file (blockwise-update: exp_avg with exp_avg_sq). The state API encodes
    # them after the others and decodes them after their partners; chains never see them
    # (they are not deltas). Why: docs/design.md, "Why these choices".
    def partner_path(self, path: str, params: Mapping[str, Any], present: Container[str]) -> str | None:
        """For a codec with partners: the path of the partner of the tensor at ``path``
        among ``present`` (the state's paths), or ``None`` where it has none."""
        return None

    def partner_of(self, params: Mapping[str, Any]) -> str | None:
        """The partner path stored params record (checked ones), ``None`` if it has none."""
        return None

    def fallback_spec(self, params: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        """``(codec name, params)`` a codec with partners is replaced by where the partner
        cannot serve (missing, of another shape or dtype, itself with a partner)."""
        raise NotImplementedError(f"codec {self.name!r} has no partner")

    def encode_with_partner(
        self,
        x: torch.Tensor,
        params: Mapping[str, Any],
        partner_path: str,
        partner: torch.Tensor,
        allocate: Allocator | None,
    ) -> Encoded:
        """Encode ``x`` with ``partner``, the decoded entry at ``partner_path``."""
        raise NotImplementedError(f"codec {self.name!r} has no partner")

    def encode_group_with_partners(
        self,
        xs: Sequence[torch.Tensor],
        params: Mapping[str, Any],
        partner_paths: Sequence[str],
        partners: Sequence[torch.Tensor],
        flags: torch.Tensor,
    ) -> list[Encoded]:
        """:meth:`encode_with_partner` of device tensors of one dtype in a number of
        launches that does not grow with their count; ``flags`` as for :meth:`encode_group`."""
        raise NotImplementedError(f"codec {self.name!r} has no grouped encode with partners")

    def decode_with_partner(
        self, entry: EncodedEntry, partner: torch.Tensor, device: torch.device | None, context: str
    ) -> torch.Tensor:
        """Decode ``entry`` with its partner's decoded tensor.

        Raises:
            CheckpointError: naming ``context`` and what was expected.
        """
        raise NotImplementedError(f"codec {self.name!r} has no partner")

    def partner_group_key(self, entry: EncodedEntry) -> Hashable | None:
        """A key under which a device decode of ``entry`` with its partner may share
        launches with others of the same codec and key (:meth:`decode_group_with_partners`);
        ``None`` (the default): decode it alone."""
        return None

    def decode_group_with_partners(
        self,
        entries: Sequence[EncodedEntry],
        partners: Sequence[torch.Tensor],
        device: torch.device,
        contexts: Sequence[str],
    ) -> list[torch.Tensor]:
        """:meth:`decode_with_partner` of entries of one :meth:`partner_group_key` on
        ``device``, in a number of launches that does not grow with their count: the same
        checks (the entries may be read from a file) and the same values as each alone."""
        raise NotImplementedError(f"codec {self.name!r} has no grouped decode with partners")

    def decode_over(
        self,
        entry: EncodedEntry,
        reference: torch.Tensor,
        device: torch.device | None,
        context: str,
    ) -> torch.Tensor:
        """:meth:`decode` a delta entry, free to write the result into ``reference``.

        For a loader that owns the reference (it decoded it itself, and nothing else reads
        it): decoding in place saves a second full-size buffer per delta tensor, and the
        page faults of fresh memory. The result must be the same values as :meth:`decode`'s;
        the default allocates, as :meth:`decode` does.
        """
        return self.decode(entry, reference, device, context)


def host_outputs(
    x: torch.Tensor, allocate: Allocator, sizes: Sequence[tuple[int, torch.dtype]]
) -> tuple[torch.Tensor, ...] | None:
    """Flat output buffers of ``(numel, dtype)`` from ``allocate`` for an encode of ``x`` on
    the host (a snapshot pool's memory: no fresh pages to fault in on every save); ``None``
    on a GPU, where the kernels allocate their own."""
    if x.device.type == "cuda":
        return None
    return tuple(allocate((n,), dtype, x.device) for n, dtype in sizes)


@dataclass(frozen=True)
class BatchLayout:
    """How the buffers of a batch encode split into its tensors' entries.

    Attributes:
        sizes: ``sizes(numel)``: each buffer's length for a tensor of ``numel`` elements
            (every buffer laid out in element order, each tensor whole blocks and bytes).
        unusable: ``unusable(buffers)``: a tensor's flag from its own buffers, as the codec
            computes it for the tensor alone (a device flag: nothing is read).
    """

    sizes: Callable[[int], Mapping[str, int]]
    unusable: Callable[[Mapping[str, torch.Tensor]], torch.Tensor]


def split_encoded(whole: Encoded, xs: Sequence[torch.Tensor], layout: BatchLayout) -> list[Encoded]:
    """The entries of ``xs`` from ``whole``, the encode of their flat concatenation: views
    of ``whole``'s buffers, with its params."""
    starts = dict.fromkeys(whole.entry.buffers, 0)
    out = []
    for x in xs:
        buffers = {}
        for name, length in layout.sizes(x.numel()).items():
            buffers[name] = whole.entry.buffers[name][starts[name] : starts[name] + length]
            starts[name] += length
        entry = EncodedEntry(
            codec=whole.entry.codec,
            params=dict(whole.entry.params),
            shape=tuple(x.shape),
            dtype=x.dtype,
            buffers=buffers,
        )
        out.append(Encoded(entry, unusable=layout.unusable(buffers)))
    return out


def move_to(t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    if device is None or t.device == device:
        return t
    # From pinned host memory this copy is asynchronous; decode kernels queue behind it.
    return t.to(device, non_blocking=t.is_pinned())


def entry_buffer(entry: EncodedEntry, name: str, context: str) -> torch.Tensor:
    buf = entry.buffers.get(name)
    if not isinstance(buf, torch.Tensor):
        raise CheckpointError(
            f"{context}: codec {entry.codec!r} expects a buffer {name!r}, found {sorted(entry.buffers)}"
        )
    return buf


# A reference fingerprint as the state API records it (tw_triton.state): 16 hex digits.
_REF_FP_RE = re.compile(r"[0-9a-f]{16}")


def check_param_names(
    params: Any, codec: str, required: frozenset[str], optional: frozenset[str], context: str
) -> None:
    """Check that stored ``params`` are an object holding every ``required`` name and no
    name outside ``required | optional``.

    Raises:
        CheckpointError: naming ``context`` and the names expected.
    """
    if not isinstance(params, Mapping):
        raise CheckpointError(f"{context}: params are {type(params).__name__}, expected an object")
    missing = sorted(required - params.keys())
    if missing:
        raise CheckpointError(
            f"{context}: codec {codec!r} params lack {missing}, expected {sorted(required)}"
        )
    unknown = sorted(params.keys() - required - optional)
    if unknown:
        raise CheckpointError(
            f"{context}: codec {codec!r} has no param(s) {unknown}; it records "
            f"{sorted(required)} and optionally {sorted(optional)}"
        )


def param_error(context: str, name: str, value: Any, expected: str) -> CheckpointError:
    """The error for a stored param ``name`` that holds ``value`` instead of ``expected``."""
    text = repr(value)
    return CheckpointError(
        f"{context}: param {name!r} is {text if len(text) <= 80 else text[:77] + '...'}, expected {expected}"
    )


def check_ref_fp(params: Mapping[str, Any], context: str) -> None:
    """A recorded reference fingerprint (``ref_fp``), if any: only on a delta entry, as the
    16 hex digits the state API writes.

    Raises:
        CheckpointError: naming ``context`` and what was expected.
    """
    if "ref_fp" not in params:
        return
    value = params["ref_fp"]
    if not isinstance(value, str) or not _REF_FP_RE.fullmatch(value):
        raise param_error(context, "ref_fp", value, "16 lowercase hex digits")
    if params.get("delta") is not True:
        raise param_error(context, "ref_fp", value, "none on an entry that is not a delta")
