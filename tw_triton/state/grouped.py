"""The encode of a state on a device: a fixed number of kernel launches per save.

On the CPU :func:`~tw_triton.state.quantize_state_dict` encodes entries on worker threads;
on a GPU each call is a kernel launch queued on the training stream, so this module groups
them instead: the entries whose codec has a grouped encode (:meth:`Codec.encode_group`:
blockwise, log2, log2-temporal, exact) are grouped by device, codec, params (but those
the codec takes per tensor, :attr:`Codec.tensor_params`: a blockwise code's ``qmax``) and
the codec's :meth:`Codec.group_key`, and each group is one grouped op (on CUDA a table copy and at most
two launches per pair of dtypes). Their
NaN/Inf flags and the fingerprints of every reference are written into one int64 buffer
per device (one zero-fill), and so are the sparse candidates' counts (one grouped op,
:func:`~tw_triton.ops.sparsity_counts_many`); the state API reads it with one copy and one
event (:func:`~tw_triton.state.fingerprints.read_device_scalars`). Entries of other codecs are
encoded alone, as on the CPU. Why: docs/design.md ("Launches and syncs per save").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import ops
from ..codecs import Codec, Encoded, get_codec
from ..errors import QuantizationError
from ..qstate import EncodedEntry

# (tensor, rule, codec, reference or None): one entry to encode, as quantize_state_dict plans it.
Job = tuple[torch.Tensor, Any, Codec, "torch.Tensor | None"]


def groups_launches(device: torch.device) -> bool:
    """Whether entries on ``device`` are encoded in groups (every device but the CPU, whose
    encode runs on worker threads instead)."""
    return device.type != "cpu"


def group_of(job: Job) -> Any:
    """The key of ``job``'s group, or ``None`` to encode it alone."""
    x, rule, codec, ref = job
    if ref is not None and ref.device != x.device:
        return None  # a host reference (reference_device="cpu") moves per tensor: alone
    key = codec.group_key(x, rule.params, ref)
    if key is None:
        return None
    try:  # params a codec takes per tensor (Codec.tensor_params) do not split groups
        frozen = tuple(sorted((k, v) for k, v in rule.params.items() if k not in codec.tensor_params))
        hash(frozen)
    except TypeError:  # params holding lists or dicts: encoded alone
        return None
    return (x.device, rule.codec, frozen, key)


class DeviceEncode:
    """The grouped encode of a state's entries on devices.

    Args:
        jobs: the entries, as planned by the state API.
        encode_alone: encodes entry ``i`` by itself (the path of ungrouped codecs).
        alone: whether entry ``i`` must be encoded by itself (e.g. kept as it is).
        counted: entries whose sparsity counts join the buffer (the sparse candidates,
            decided after the host read): :attr:`counts` holds them after :meth:`run`.
    """

    def __init__(
        self,
        jobs: Sequence[Job],
        encode_alone: Callable[[int], Encoded],
        alone: Callable[[int], bool] = lambda i: False,
        counted: Sequence[int] = (),
    ) -> None:
        self.jobs, self.encode_alone = jobs, encode_alone
        groups: dict[Any, list[int]] = {}
        self.alone: list[int] = []
        for i, job in enumerate(jobs):
            key = None if alone(i) else group_of(job)
            if key is None:
                self.alone.append(i)
            else:
                groups.setdefault(key, []).append(i)
        self.groups = list(groups.values())
        # Slots of one int64 buffer per device: the grouped entries' flags, then the
        # references' fingerprints.
        self.sizes: dict[torch.device, int] = {}
        self.flag_at: dict[int, int] = {}
        for members in self.groups:
            for i in members:
                self.flag_at[i] = self.slot(jobs[i][0].device)
        self.fp_at: dict[int, int] = {}
        for i, (_, _, _, ref) in enumerate(jobs):
            if ref is not None:
                self.fp_at[i] = self.slot(ref.device)
        # Then two slots (nnz, runs) per counted entry, a device's consecutive.
        self.count_at = {i: (self.slot(jobs[i][0].device), self.slot(jobs[i][0].device)) for i in counted}
        self.counts: list[torch.Tensor] = []
        self.buffers = {d: torch.zeros(n, dtype=torch.int64, device=d) for d, n in self.sizes.items()}

    def slot(self, device: torch.device) -> int:
        n = self.sizes.get(device, 0)
        self.sizes[device] = n + 1
        return n

    def run(self) -> tuple[list[Encoded], dict[int, torch.Tensor]]:
        """Encode every entry; returns the encodings in the jobs' order and each
        fingerprinted entry's fingerprint (a 0-dim view of its device's buffer)."""
        encoded: list[Encoded] = [None] * len(self.jobs)  # type: ignore[list-item]
        for members in self.groups:
            x0, rule, codec, ref0 = self.jobs[members[0]]
            first = self.flag_at[members[0]]
            # A group's slots are consecutive: they were handed out group by group.
            flags = self.buffers[x0.device][first : first + len(members)]
            xs = [self.jobs[i][0] for i in members]
            refs = None if ref0 is None else [self.jobs[i][3] for i in members]
            each = {"each": [self.jobs[i][1].params for i in members]} if codec.tensor_params else {}
            try:
                encs = codec.encode_group(xs, rule.params, refs, flags, **each)
            except QuantizationError:
                # One at a time, so that the error names the entry it is about.
                encs = [self.encode_alone(i) for i in members]
            for i, enc in zip(members, encs):
                encoded[i] = enc
        for i in self.alone:
            encoded[i] = self.encode_alone(i)
        fps: dict[int, torch.Tensor] = {}
        by_device: dict[torch.device, list[int]] = {}
        for i in self.fp_at:
            by_device.setdefault(self.jobs[i][3].device, []).append(i)  # type: ignore[union-attr]
        for device, members in by_device.items():
            first = self.fp_at[members[0]]
            out = self.buffers[device][first : first + len(members)]
            ops.fingerprints([self.jobs[i][3] for i in members], out=out)  # type: ignore[misc]
            for k, i in enumerate(members):
                fps[i] = out[k]
        self.count_sparsity()
        return encoded, fps

    def count_sparsity(self) -> None:
        """The counted entries' ``(nnz, runs)`` into their slots, one grouped op per
        device; :attr:`counts` gets them as 0-dim views, in the order of ``counted``."""
        by_device: dict[torch.device, list[int]] = {}
        for i in self.count_at:
            by_device.setdefault(self.jobs[i][0].device, []).append(i)
        for device, members in by_device.items():
            first = self.count_at[members[0]][0]
            out = self.buffers[device][first : first + 2 * len(members)]
            ops.sparsity_counts_many([self.jobs[i][0] for i in members], out=out)
        self.counts = [
            self.buffers[self.jobs[i][0].device][s] for i in self.count_at for s in self.count_at[i]
        ]


def decode_grouped(
    items: Sequence[tuple[EncodedEntry, torch.Tensor | None, torch.device, str]],
    decode_alone: Callable[[int], torch.Tensor],
    outs: Sequence[torch.Tensor | None] | None = None,
    *,
    check: bool = False,
) -> list[torch.Tensor]:
    """Decode ``(entry, reference, device, context)`` items on devices: those whose codec
    has a grouped decode (:meth:`Codec.decode_group`) in one grouped op per codec, key and
    device, the others with ``decode_alone(i)``. Results in the items' order.

    ``check``: the entries were read from a file, and the grouped decodes check their
    codes (:meth:`Codec.decode_group`); without it they must be this process's own
    encodings. ``outs[i]``: a tensor item ``i`` may be decoded into (its reference, which
    nothing else reads; ``None``: a fresh one). A group whose decode raises before writing
    anything (its entries' params, buffers and codes are checked first) is decoded again
    one item at a time, so that the error is the one ``decode_alone`` raises for the
    entry at fault."""
    groups: dict[Any, list[int]] = {}
    out: list[torch.Tensor] = [None] * len(items)  # type: ignore[list-item]
    for i, (entry, ref, device, _) in enumerate(items):
        codec = get_codec(entry.codec)
        key = None if codec is None else codec.decode_group_key(entry, ref)
        if key is None:
            out[i] = decode_alone(i)
        else:
            groups.setdefault((entry.codec, key, device), []).append(i)
    for (name, _, device), members in groups.items():
        codec = get_codec(name)
        try:
            decoded = codec.decode_group(  # type: ignore[union-attr]
                [items[i][0] for i in members],
                [items[i][1] for i in members],
                device,
                [items[i][3] for i in members],
                None if outs is None else [outs[i] for i in members],
                check=check,
            )
        except (MemoryError, torch.OutOfMemoryError):
            raise
        except Exception:
            # Raised before anything was written (the checks come first); one at a time,
            # the error is the entry's own (decode_alone wraps what a crafted file causes).
            decoded = [decode_alone(i) for i in members]
        for i, t in zip(members, decoded):
            out[i] = t
    return out


__all__ = ["DeviceEncode", "decode_grouped", "group_of", "groups_launches"]
