"""Framework integrations, each an optional extra that the core never imports.

``tw_triton.integrations.transformers``
    :class:`TwTrainer` / :class:`TwCheckpointMixin`: a Hugging Face ``Trainer`` whose
    checkpoints are tw_triton files (keyframes and deltas); ``pip install 'tw-triton[hf]'``.
``tw_triton.integrations.lightning``
    :class:`TwCheckpointIO`: a Lightning ``CheckpointIO`` plugin that writes each checkpoint
    as one tw_triton file; ``pip install 'tw-triton[lightning]'``.
``tw_triton.integrations.accelerate``
    why ``save_state``/``load_state`` hooks cannot carry the optimizer, and the
    :class:`~tw_triton.Checkpointer` route for accelerate loops; ``pip install 'tw-triton[hf]'``.

Importing a submodule without its framework raises an ``ImportError`` that names the extra.
The why: docs/integrations.md.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str) -> ModuleType:
    """Import ``module`` or raise an ``ImportError`` that says which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"this tw_triton integration needs {module!r}, which is not installed: "
            f"pip install 'tw-triton[{extra}]'"
        ) from e


__all__ = ["require"]
