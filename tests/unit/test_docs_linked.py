"""Every page under docs/ is linked from the README or from another page (a page no link
reaches is a page no reader finds)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_docs_page_is_linked():
    pages = sorted((REPO / "docs").glob("*.md"))
    texts = {p: p.read_text() for p in [REPO / "README.md", *pages]}
    unlinked = [page.name for page in pages
                if not any(f"]({'docs/' if other.name == 'README.md' else ''}{page.name}"
                           in text for other, text in texts.items() if other != page)]  # fmt: skip
    assert unlinked == []
