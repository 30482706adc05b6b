"""docs/architecture.md stays true to the code: every module of unmask/ is named in its
package's paragraph (or by its path), and the layer diagram lists every package of the
import-linter layers contract, in the contract's order."""

import re
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]
DOC = (REPO / "docs" / "architecture.md").read_text()


def package_paragraphs() -> dict[str, str]:
    """{package: the text of its "**package**." paragraphs}."""
    paragraphs: dict[str, str] = {}
    for found in re.finditer(r"^\*\*([a-z_]+)\*\*[^\n]*(?:\n(?!\n)[^\n]*)*", DOC, re.M):
        paragraphs[found.group(1)] = paragraphs.get(found.group(1), "") + found.group(0)
    return paragraphs


def test_every_module_is_named_in_its_packages_paragraph():
    paragraphs = package_paragraphs()
    missing = []
    for path in sorted((REPO / "unmask").rglob("*.py")):
        rel = path.relative_to(REPO / "unmask")
        if path.name in ("__init__.py", "__main__.py"):
            continue  # a package is named by its paragraph; the root's in "The packages"
        if len(rel.parts) == 1:  # the root's modules: a paragraph of their own
            if f"(`{path.name}`)" not in DOC:
                missing.append(str(rel))
            continue
        package, inside = rel.parts[0], "/".join(rel.parts[1:])
        text = paragraphs.get(package, "")
        if f"`{inside}`" in text or f"`{path.name}`" in text or f"{package}/{inside}" in DOC:
            continue
        missing.append(str(rel))
    assert missing == [], f"modules docs/architecture.md does not name: {missing}"


def test_the_layer_diagram_is_the_contracts():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c["layers"] for c in config["contracts"] if c["type"] == "layers"]
    contract = [[name.strip().removeprefix("unmask.") for name in layer.split("|")]
                for layer in layers if layer != "unmask.__main__"]  # fmt: skip
    diagram = DOC.split("```text\n", 1)[1].split("```", 1)[0]
    drawn = [re.split(r"\s{3,}", line.strip())[0] for line in diagram.splitlines()]
    drawn = [[name.strip() for name in first.split("|")] for first in drawn]
    assert drawn == contract
