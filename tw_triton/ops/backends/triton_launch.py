"""What every Triton launcher of the "cuda" backend shares: the kernels module, imported on
first use behind the triton version check, and the helpers that hand tensors to it.

Importing this module imports neither triton nor the kernels, so that ``import tw_triton``
and every CPU path work where triton is not installed.
"""

from __future__ import annotations

import re
import types

import torch

from ...errors import CheckpointError

# The oldest triton whose kernels are proven bit-exact with the CPU path: before 3.6,
# ``tl.div_rn`` lowered to a flush-to-zero division (``div.rn.ftz.f32``), so a block with
# subnormal values would encode differently from the CPU (tests/ops/test_ptx.py checks the
# installed triton's PTX for ``.ftz``).
MIN_TRITON = (3, 6)


def check_triton_version(version: str) -> None:
    """Raise :class:`CheckpointError` unless ``version`` (``triton.__version__``) is at
    least :data:`MIN_TRITON`.

    Raises:
        CheckpointError: an older or unparseable version; the message names both.
    """
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None or (int(m.group(1)), int(m.group(2))) < MIN_TRITON:
        need = ".".join(map(str, MIN_TRITON))
        raise CheckpointError(
            f"coding a CUDA tensor needs triton>={need} (older versions flush subnormals to "
            f"zero in the kernels' division, so the bytes would differ from the CPU path); "
            f"triton {version} is installed: pip install 'triton>={need}'"
        )


_version_checked: list[bool] = []  # non-empty once the installed triton passed


def kernels() -> types.ModuleType:
    """The module :mod:`tw_triton.kernels`, imported on first use.

    Raises:
        CheckpointError: triton is not installed (a CUDA tensor cannot be coded without it),
            or is older than :data:`MIN_TRITON`.
    """
    try:
        from ... import kernels as module
    except ImportError as exc:
        if exc.name is None or not (exc.name == "triton" or exc.name.startswith("triton.")):
            raise
        raise CheckpointError(
            "coding a CUDA tensor needs triton, which is not installed here "
            "(pip install 'triton>=3.6'; CPU tensors need no triton)"
        ) from exc
    if not _version_checked:
        import triton  # imported by the kernels already

        check_triton_version(triton.__version__)
        _version_checked.append(True)
    return module


def write_out(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    # The kernels allocate; a caller's buffer receives a copy (no caller passes one today).
    if out is None:
        return result
    out.view(-1).copy_(result)
    return out


KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def readable(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the grouped kernels read it: contiguous and 16-byte aligned (a copy of a
    view that is not; fresh allocations always are)."""
    if kernels().aligned(t):
        return t
    return t.contiguous() if not t.is_contiguous() else t.clone()


__all__ = ["KERNEL_DTYPES", "MIN_TRITON", "check_triton_version", "kernels", "readable", "write_out"]
