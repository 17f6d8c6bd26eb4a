"""The RNG states a checkpoint holds: torch (CPU, and CUDA once initialized), numpy and
Python's ``random``, so that a resumed run draws what the saved one would have
(docs/training-loop.md, "What is saved")."""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

from .errors import CheckpointError

logger = logging.getLogger(__name__)


def capture_rng_state() -> dict[str, Any]:
    """The RNG states of torch (CPU; CUDA if initialized), numpy and Python ``random``."""
    rng: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    # Asking for CUDA RNG states would initialize CUDA in a CPU-only run; a run that uses
    # CUDA has initialized it by the time it saves.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng_state(rng: dict[str, Any], *, source: str = "checkpoint") -> None:
    """Put back RNG states recorded by :func:`capture_rng_state`.

    Raises:
        CheckpointError: the recorded states are missing or malformed (names ``source``).
    """
    try:
        torch.set_rng_state(rng["torch"].detach().to("cpu", torch.uint8))
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{source}: cannot restore the RNG states: {type(e).__name__}: {e}") from e
    cuda = rng.get("cuda")
    if cuda is not None:
        if torch.cuda.is_available() and torch.cuda.device_count() >= len(cuda):
            torch.cuda.set_rng_state_all([t.detach().to("cpu", torch.uint8) for t in cuda])
        else:
            logger.warning(
                "%s: recorded CUDA RNG states for %d device(s) but %d are available; "
                "CUDA RNG states not restored",
                source,
                len(cuda),
                torch.cuda.device_count() if torch.cuda.is_available() else 0,
            )


__all__ = ["capture_rng_state", "restore_rng_state"]
