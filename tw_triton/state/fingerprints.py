"""Fingerprints of reference tensors, and the one batched host read of device scalars.

A fingerprint (:func:`fingerprint`) is a cheap, deterministic digest of a reference tensor
recorded per delta entry (``ref_fp``): it detects a wrong reference, it is not a checksum.
Every NaN/Inf flag and fingerprint of a state is read with :func:`read_device_scalars`,
one transfer per device. Why: docs/design.md.
"""

from __future__ import annotations

import torch

FINGERPRINT_SAMPLES = 2048
FINGERPRINT_PREFIX = "fp-"


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim int64 on ``t``'s device: position-weighted sum of sampled fp32 bit patterns.

    Integer arithmetic only (no overflow: |bits| < 2**31, weights <= 2048, 2048 terms), so
    every device gives the same value without a sync.
    """
    flat = t.detach().reshape(-1)
    step = max(1, flat.numel() // FINGERPRINT_SAMPLES)
    sample = flat[::step][:FINGERPRINT_SAMPLES].to(torch.float32)
    bits = sample.view(torch.int32).to(torch.int64)
    weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device)
    return (bits * weights).sum() + flat.numel()


def fp_hex(value: int) -> str:
    return format(value & 0xFFFFFFFFFFFFFFFF, "016x")


def read_device_scalars(scalars: list[torch.Tensor]) -> list[int]:
    """Read 0-dim device scalars to Python ints with one transfer per device."""
    by_device: dict[torch.device, list[int]] = {}
    for i, s in enumerate(scalars):
        by_device.setdefault(s.device, []).append(i)
    out = [0] * len(scalars)
    for idx in by_device.values():
        host = torch.stack([scalars[i].to(torch.int64) for i in idx]).cpu().tolist()
        for i, v in zip(idx, host):
            out[i] = int(v)
    return out
