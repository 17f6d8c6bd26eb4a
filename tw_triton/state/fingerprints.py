"""Fingerprints of reference tensors, and the one batched host read of device scalars.

A fingerprint (:func:`fingerprint`) is a cheap, deterministic digest of a reference tensor
recorded per delta entry (``ref_fp``): it detects a wrong reference, it is not a checksum.
Every NaN/Inf flag, fingerprint and sparsity count of a state is read with
:func:`read_device_scalars`:
one copy per device into pinned memory and one CUDA event waited on. Why: docs/design.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..cuda_threads import wait_event
from ..ops.reference import FINGERPRINT_SAMPLES, fingerprint_torch
from ..pinned_memory import pinned_empty

FINGERPRINT_PREFIX = "fp-"


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim int64 on ``t``'s device (:func:`~tw_triton.ops.reference.fingerprint_torch`):
    position-weighted sum of sampled fp32 bit patterns, the same on every device."""
    return fingerprint_torch(t)


def fp_hex(value: int) -> str:
    return format(value & 0xFFFFFFFFFFFFFFFF, "016x")


def to_host(buf: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start copying the 1-D ``buf`` to the host: ``(host tensor, event)``, the event (CUDA
    only) recorded on the current stream after the copy; wait on it before reading. Only
    the work queued before the copy is waited for, never the whole device."""
    if buf.device.type == "cpu":
        return buf, None
    if buf.device.type != "cuda":
        return buf.cpu(), None
    host, _ = pinned_empty(tuple(buf.shape), buf.dtype)
    host.copy_(buf, non_blocking=True)
    done = torch.cuda.Event(blocking=True)
    done.record(torch.cuda.current_stream(buf.device))
    return host, done


def read_host(host: torch.Tensor, done: torch.cuda.Event | None) -> list[int]:
    """The values :func:`to_host` copied, once its event has fired."""
    if done is not None:
        wait_event(done)
    return [int(v) for v in host.tolist()]


def read_device_scalars(scalars: list[torch.Tensor], buffers: Sequence[torch.Tensor] = ()) -> list[int]:
    """Read 0-dim device scalars to Python ints with one transfer per device.

    A scalar that is an element of one of ``buffers`` (1-D int64, e.g. the flags and
    fingerprints of a save's grouped launches) is read with its whole buffer; the others
    of a device are stacked behind it, so each device costs one copy and one event wait.
    """
    by_device: dict[torch.device, tuple[list[torch.Tensor], list[int]]] = {}
    where: list[tuple[torch.device, int]] = []
    for buf in buffers:
        by_device.setdefault(buf.device, ([], []))[0].append(buf)
    for s in scalars:
        parts, extra = by_device.setdefault(s.device, ([], []))
        index = element_of(s, parts)
        if index is None:
            extra.append(len(where))
        where.append((s.device, -1 if index is None else index))
    out = [0] * len(scalars)
    pending = []
    for device, (parts, extra) in by_device.items():
        pieces = list(parts)
        if extra:
            pieces.append(torch.stack([scalars[i].to(torch.int64) for i in extra]))
        if pieces:
            flat = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            pending.append((device, extra, to_host(flat)))
    for device, extra, (host, done) in pending:
        values = read_host(host, done)
        parts = by_device[device][0]
        n_parts = sum(p.numel() for p in parts)
        for k, i in enumerate(extra):
            out[i] = values[n_parts + k]
        for i, (dev, index) in enumerate(where):
            if dev == device and index >= 0:
                out[i] = values[index]
    return out


def element_of(s: torch.Tensor, parts: list[torch.Tensor]) -> int | None:
    """The position of the 0-dim ``s`` in the concatenation of ``parts`` (1-D int64,
    contiguous), if it is a view of one of their elements; else ``None``."""
    if s.dim() != 0 or s.dtype != torch.int64:
        return None
    start = 0
    for p in parts:
        if s.untyped_storage().data_ptr() == p.untyped_storage().data_ptr():
            k = s.storage_offset() - p.storage_offset()
            if 0 <= k < p.numel():
                return start + k
        start += p.numel()
    return None


__all__ = ["FINGERPRINT_PREFIX", "FINGERPRINT_SAMPLES", "fingerprint", "fp_hex", "read_device_scalars"]
