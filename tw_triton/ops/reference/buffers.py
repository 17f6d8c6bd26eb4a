"""Working memory of the plain-torch ops: chunking, per-thread scratch, output buffers.

The reference ops work through a tensor a chunk at a time in scratch buffers that each
thread keeps between calls, and read strided tensors chunk by chunk instead of copying
them whole. Why chunks and kept scratch: docs/performance.md ("The CPU path").
"""

from __future__ import annotations

import math
import threading

import torch

from ...errors import QuantizationError

# Elements per chunk of the torch path: temporaries of about three fp32 chunks (6 MiB; four
# at 4 bits, where the fp64 quotients take two). Each worker thread keeps its scratch, which
# counts in a load's peak memory, so larger chunks buy little speed for more memory.
CHUNK_ELEMENTS = 1 << 19

# Scratch buffers of the torch path, one set per thread, kept between calls.
_SCRATCH = threading.local()


def scratch(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized 1-D ``dtype`` buffer of ``numel`` elements, reused across calls.

    Why: a chunk's temporaries are megabytes, and glibc serves blocks that large with new
    ``mmap()`` pages, which fault in on first touch and are unmapped again on free, so every
    call would pay for fresh pages again. The buffers stay per thread (the writer thread and
    the training loop may run the codec at once; a thread's set goes when the thread ends),
    at most six of them, about 10 MiB at the default chunk. Other devices allocate.
    """
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    bufs = getattr(_SCRATCH, "bufs", None)
    if bufs is None:
        bufs = _SCRATCH.bufs = {}
    nbytes = numel * dtype.itemsize
    buf = bufs.get(name)
    if buf is None or buf.numel() < nbytes:
        buf = bufs[name] = torch.empty(nbytes, dtype=torch.uint8)
    return buf[:nbytes].view(dtype)


def scratch_buffers() -> dict[str, torch.Tensor]:
    """The calling thread's scratch buffers by name (empty before the first use)."""
    return getattr(_SCRATCH, "bufs", None) or {}


def release_scratch() -> None:
    """Free the calling thread's scratch buffers of the torch path (they come back on use)."""
    _SCRATCH.__dict__.pop("bufs", None)


def chunk_elements(block: int, chunk: int | None = None) -> int:
    """Elements per chunk of the torch path: a whole number of blocks (``chunk`` default:
    :data:`CHUNK_ELEMENTS`, read at call time so a test can shrink it)."""
    chunk = CHUNK_ELEMENTS if chunk is None else chunk
    return max(block, chunk // block * block)


def copy_flat_range(src: torch.Tensor, start: int, dst: torch.Tensor) -> None:
    """Copy elements ``start : start + dst.numel()`` of ``src`` in row-major order into ``dst``
    (1-D, converting the dtype), without materializing a contiguous copy of ``src``.

    A strided tensor's flat range is a run of whole sub-tensors along dim 0 (one strided
    ``copy_``) between two partial ones, handled the same way one dimension down.
    """
    m = dst.numel()
    if src.is_contiguous():
        dst.copy_(src.reshape(-1)[start : start + m])
        return
    if src.dim() == 1:
        dst.copy_(src[start : start + m])
        return
    inner = math.prod(src.shape[1:])
    pos = 0
    while pos < m:
        i, off = divmod(start + pos, inner)
        if off == 0 and m - pos >= inner:
            rows = (m - pos) // inner
            dst[pos : pos + rows * inner].view(rows, *src.shape[1:]).copy_(src[i : i + rows])
            pos += rows * inner
        else:
            take = min(inner - off, m - pos)
            copy_flat_range(src[i], off, dst[pos : pos + take])
            pos += take


def checked_out(
    t: torch.Tensor, numel: int, dtype: torch.dtype, device: torch.device, name: str
) -> torch.Tensor:
    """``t`` flattened, if it is a contiguous ``dtype`` tensor of ``numel`` elements on
    ``device``; else :class:`QuantizationError`."""
    if (
        not isinstance(t, torch.Tensor)
        or t.dtype != dtype
        or t.numel() != numel
        or t.device != device
        or not t.is_contiguous()
    ):
        got = f"{t.dtype} x {t.numel()} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise QuantizationError(
            f"{name} must be a contiguous {dtype} tensor of {numel} elements on {device}, got {got}"
            + ("" if not isinstance(t, torch.Tensor) or t.is_contiguous() else " (not contiguous)")
        )
    return t.view(-1)


def encode_outputs(
    out: tuple[torch.Tensor, ...] | None, device: torch.device, specs: list[tuple[str, int, torch.dtype]]
) -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]:
    """An encoder's outputs: ``out`` checked against ``specs`` (name, elements, dtype; see
    :func:`checked_out`), or new tensors of those sizes; with their flat views."""
    if out is None:
        out = tuple(torch.empty(n, dtype=dtype, device=device) for _, n, dtype in specs)
    return out, [checked_out(t, n, dtype, device, name) for t, (name, n, dtype) in zip(out, specs)]


def decode_output(
    out: torch.Tensor | None, numel: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder's output: ``out`` checked to hold ``numel`` elements of ``dtype`` on
    ``device`` (see :func:`checked_out`), or a new tensor; with its flat view."""
    if out is None:
        out = torch.empty(numel, dtype=dtype, device=device)
    return out, checked_out(out, numel, dtype, device, "out")
