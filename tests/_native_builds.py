"""The compiled CPU codec's library files built here, for the tests that run each in turn."""

from __future__ import annotations

import importlib
from typing import Any

import pytest


def native_builds() -> list[str]:
    """The library files built here: the baseline one and, on x86-64, the AVX2 one."""
    found = []
    for name in ("tw_triton._native", "tw_triton._native_avx2"):
        try:
            found.append(importlib.import_module(name).__file__)
        except ImportError:
            pass
    return found


def build_id(path: str | None) -> str:
    """A short test id for a library file (``none`` where nothing is built)."""
    return "none" if path is None else path.rsplit("/", 1)[-1].split(".")[0]


def use_build(path: str | None, monkeypatch: Any, *modules: Any) -> Any:
    """Load library file ``path`` and make it the one ``modules`` call (their ``library``),
    for a fixture over :func:`native_builds`; skips where nothing is built or it is off."""
    from tw_triton.ops.backends import native

    if path is None or not native.enabled():
        pytest.skip("compiled codec not built or turned off")
    lib = native.load(path)
    for module in modules:
        monkeypatch.setattr(module, "library", lambda: lib)
    return lib
