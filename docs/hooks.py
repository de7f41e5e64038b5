"""mkdocs hooks (mkdocs.yml): the site's home page is the repository's README.md and its
changelog page CHANGELOG.md, so neither is copied; links are made relative to docs/."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# site page → the repository file it shows
PAGES = {"index.md": "README.md", "changelog.md": "CHANGELOG.md"}


def relinked(markdown: str, from_root: bool) -> str:
    """Links as the site sees them: the README's `docs/x.md` is the site's `x.md`, and
    `CHANGELOG.md` / `README.md` (`../` from docs/) are the pages that show them."""
    up = "" if from_root else r"\.\./"
    if from_root:
        markdown = re.sub(r"\]\(docs/", "](", markdown)
    markdown = re.sub(rf"\]\({up}CHANGELOG\.md", "](changelog.md", markdown)
    return re.sub(rf"\]\({up}README\.md", "](index.md", markdown)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    source = PAGES.get(page.file.src_uri)
    if source is not None:
        return relinked((ROOT / source).read_text(encoding="utf-8"), from_root=True)
    return relinked(markdown, from_root=False)
