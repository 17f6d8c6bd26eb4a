"""Which files a load reads, and which of their entries: a spy on
``tw_triton.format.OpenCheckpoint``, which every read of a checkpoint's buffers opens
(``read_file`` and ``load`` alike)."""

from __future__ import annotations

import os

import tw_triton.format as fmt


def spy_on_reads(monkeypatch) -> list[tuple[str, list[str] | None]]:
    """Record ``(file name, entries asked for)`` of every checkpoint opened from now on."""
    asked: list[tuple[str, list[str] | None]] = []
    real = fmt.OpenCheckpoint.__init__

    def spy(self, path, **kwargs):
        asked.append((os.path.basename(path), kwargs.get("entries")))
        real(self, path, **kwargs)

    monkeypatch.setattr(fmt.OpenCheckpoint, "__init__", spy)
    return asked
