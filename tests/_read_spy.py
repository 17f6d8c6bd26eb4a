"""Which files a load reads, and which of their entries: a spy on ``tw_triton.format.read_file``."""

from __future__ import annotations

import os

import tw_triton.format as fmt


def spy_on_reads(monkeypatch) -> list[tuple[str, list[str] | None]]:
    """Record ``(file name, entries asked for)`` of every ``read_file`` call from now on."""
    asked: list[tuple[str, list[str] | None]] = []
    real = fmt.read_file

    def spy(path, **kwargs):
        asked.append((os.path.basename(path), kwargs.get("entries")))
        return real(path, **kwargs)

    monkeypatch.setattr(fmt, "read_file", spy)
    return asked
