"""Records the specialization of every Triton kernel launch: a context manager, and a pytest
plugin (``-p _kernel_launches``) that writes a session's launches as JSON to the path in
``TW_TRITON_LAUNCHES_OUT``.

A launch's key is what makes Triton compile a binary of its own: the kernel, the dtypes of
its tensor arguments and its constexprs (``BITS``, ``BLOCK``, ``ROWS``, ``HAS_REF``,
``MASKED``; the encode's ``qmax`` is a runtime fp32 value, which Triton does not specialize
on). The launch itself still runs, unless ``run=False``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
from collections.abc import Iterator
from typing import Any

import torch

KERNELS = {
    "tw_triton.kernels.quantize_blockwise": "quantize_blockwise_kernel",
    "tw_triton.kernels.dequantize_blockwise": "dequantize_blockwise_kernel",
    "tw_triton.kernels.quantize_log2": "quantize_log2_kernel",
    "tw_triton.kernels.dequantize_log2": "dequantize_log2_kernel",
}
# Launch options that are not specializations of the kernel's code.
NOT_KEYS = ("num_warps", "num_stages", "enable_fp_fusion")

LaunchKey = tuple[str, tuple[str, ...], tuple[tuple[str, Any], ...]]


def launch_key(name: str, args: tuple, meta: dict[str, Any]) -> LaunchKey:
    dtypes = tuple(str(a.dtype).removeprefix("torch.") for a in args if isinstance(a, torch.Tensor))
    return name, dtypes, tuple(sorted((k, v) for k, v in meta.items() if k not in NOT_KEYS))


class _Recording:
    def __init__(self, name: str, kernel: Any, seen: set[LaunchKey], run: bool) -> None:
        self.name, self.kernel, self.seen, self.run = name, kernel, seen, run

    def __getitem__(self, grid: Any):
        def launch(*args: Any, **meta: Any) -> Any:
            self.seen.add(launch_key(self.name, args, meta))
            return self.kernel[grid](*args, **meta) if self.run else None

        return launch


@contextlib.contextmanager
def recording(run: bool = True) -> Iterator[set[LaunchKey]]:
    """Record the launches of the four kernels while the block runs (``run``: launch them
    too; without, their outputs are left as allocated)."""
    seen: set[LaunchKey] = set()
    modules = {m: importlib.import_module(m) for m in KERNELS}
    real = {m: getattr(mod, KERNELS[m]) for m, mod in modules.items()}
    try:
        for m, mod in modules.items():
            setattr(mod, KERNELS[m], _Recording(KERNELS[m], real[m], seen, run))
        yield seen
    finally:
        for m, mod in modules.items():
            setattr(mod, KERNELS[m], real[m])


def to_json(keys: set[LaunchKey]) -> list:
    return sorted([name, list(dtypes), [list(kv) for kv in meta]] for name, dtypes, meta in keys)


def from_json(rows: list) -> set[LaunchKey]:
    return {(name, tuple(dtypes), tuple((k, v) for k, v in meta)) for name, dtypes, meta in rows}


_session: contextlib.ExitStack | None = None
_seen: set[LaunchKey] = set()


def pytest_configure(config) -> None:  # type: ignore[no-untyped-def]
    global _session, _seen
    if os.environ.get("TW_TRITON_LAUNCHES_OUT"):
        _session = contextlib.ExitStack()
        _seen = _session.enter_context(recording())


def pytest_unconfigure(config) -> None:  # type: ignore[no-untyped-def]
    if _session is None:
        return
    _session.close()
    with open(os.environ["TW_TRITON_LAUNCHES_OUT"], "w") as f:
        json.dump(to_json(_seen), f)
