"""The README's code examples, as the integration tests run them."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_example(subsection: str, lang: str = "python", index: int = 0) -> str:
    """The ``index``-th ```lang block under ``### subsection`` of the README's integrations section."""
    text = README.read_text()
    start = text.index("## Framework integrations")
    start = text.index(f"### {subsection}", start)
    end = text.find("\n### ", start + 1)
    blocks = re.findall(rf"```{lang}\n(.*?)```", text[start:end], re.S)
    assert len(blocks) > index, f"no {lang} block {index} under ### {subsection}"
    return blocks[index]
