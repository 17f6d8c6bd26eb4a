"""The integration examples of docs/integrations.md, as the integration tests run them."""

from __future__ import annotations

import re
from pathlib import Path

INTEGRATIONS = Path(__file__).resolve().parent.parent / "docs" / "integrations.md"


def readme_example(subsection: str, lang: str = "python", index: int = 0) -> str:
    """The ``index``-th ```lang block under ``## subsection`` of docs/integrations.md."""
    text = INTEGRATIONS.read_text()
    start = text.index(f"## {subsection}\n")
    end = text.find("\n## ", start + 1)
    blocks = re.findall(rf"```{lang}\n(.*?)```", text[start : end if end != -1 else len(text)], re.S)
    assert len(blocks) > index, f"no {lang} block {index} under ## {subsection} in {INTEGRATIONS}"
    return blocks[index]
