"""docs/troubleshooting.md quotes messages as the code writes them: every quoted part of a
table's Message column still occurs in unmask's source (a reworded message fails here)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _source() -> str:
    text = "\n".join(p.read_text() for p in (ROOT / "unmask").rglob("*.py"))
    # a message split over lines is one string after implicit concatenation: "a " "b"
    return re.sub(r'"\s*\n\s*f?"', "", text)


def quoted_messages() -> list[str]:
    rows = [line for line in (ROOT / "docs" / "troubleshooting.md").read_text().splitlines()
            if line.startswith("| `")]  # fmt: skip
    return [part for row in rows for part in re.findall(r"`([^`]+)`", row.split(" | ")[0])]


def test_every_quoted_message_occurs_in_the_code():
    source = _source()
    quoted = quoted_messages()
    assert len(quoted) >= 50
    missing = [q for q in quoted if q not in source]
    assert not missing, missing
