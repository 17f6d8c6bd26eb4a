"""``python -m tw_triton.cli``: the ``tw`` command (same arguments, same exit codes)."""

from __future__ import annotations

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
