"""Training states for the tests, and a deep equality that also checks types."""

from __future__ import annotations

import math

import numpy as np
import torch


def make_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w1": torch.randn(64, 128, generator=g),
            "w2": torch.randn(96, 64, generator=g).bfloat16(),
            "b": torch.randn(64, generator=g),
        },
        "optimizer": {
            "state": {0: {"exp_avg": torch.randn(64, 128, generator=g)}},
            "param_groups": [{"params": [0], "betas": (0.9, 0.99)}],
        },
        "step": 12,
        "loss": float("nan"),
    }


def perturbed(state, scale=1e-3, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = {k: v for k, v in state.items()}
    out["model"] = {
        k: (v.float() + scale * torch.randn(v.shape, generator=g)).to(v.dtype)
        for k, v in state["model"].items()
    }
    return out


def assert_same(a, b, path="<root>"):
    """Deep equality that also checks types: tuple vs list, int vs float, key types,
    tensor dtype/shape/bits, ndarray dtype, NaN == NaN, -0.0 vs 0.0."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{path}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        )
        assert (
            torch.equal(
                a.cpu().contiguous().view(-1).view(torch.uint8),
                b.cpu().contiguous().view(-1).view(torch.uint8),
            )
            if a.numel() and a.dtype != torch.bool
            else torch.equal(a.cpu(), b.cpu())
        ), f"{path}: tensor bytes differ"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        assert a.tobytes() == b.tobytes(), f"{path}: array bytes differ"
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{path}: keys {list(a)} != {list(b)}"
        for (ka, va), kb in zip(a.items(), b.keys()):
            assert type(ka) is type(kb), f"{path}: key {ka!r} type {type(ka).__name__} != {type(kb).__name__}"
            assert_same(va, b[kb], f"{path}/{ka}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}/{i}")
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b)), (
            f"{path}: {a!r} != {b!r}"
        )
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and (a == b or (np.isnan(a) and np.isnan(b))), f"{path}: {a!r} != {b!r}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
