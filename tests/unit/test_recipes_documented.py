"""Every recipe file is in docs/recipes.md's table with its command and the steps it ships
with, and the docs that state a recipe's steps state those."""

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def table() -> dict[str, tuple[str, int]]:
    rows = {}
    text = (REPO / "docs" / "recipes.md").read_text()
    for line in text.split("## The recipes folder", 1)[1].split("\n## ", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`") and cells[2].isdigit():
            rows[cells[0].strip("`")] = (cells[1], int(cells[2]))
    return rows


def test_every_recipe_is_in_the_table_with_its_steps_and_command():
    rows = table()
    files = sorted(path.name for path in (REPO / "recipes").glob("*.yaml"))
    assert sorted(rows) == files
    for name, (command, steps) in rows.items():
        config = yaml.safe_load((REPO / "recipes" / name).read_text())
        assert config["train"]["max_steps"] == steps, name
        assert command.startswith(f"`unmask train recipes/{name}`"), name


def test_the_docs_state_the_steps_the_recipes_ship():
    adaptation = (REPO / "docs" / "adaptation.md").read_text()
    for name in ("adapt_instant", "adapt_anneal", "adapt_blocks"):
        steps = yaml.safe_load((REPO / "recipes" / f"{name}.yaml").read_text())["train"]
        assert steps["max_steps"] == 700
    assert "trains **700 steps (0.5x)**, the steps the recipes ship" in adaptation
    assert re.search(r"each 700 steps", adaptation)
    distill = yaml.safe_load((REPO / "recipes" / "distill_quickstart.yaml").read_text())
    assert distill["train"]["max_steps"] == 200 and "entropy\nweight 1, 200 steps" in adaptation
    readme = (REPO / "README.md").read_text()
    moe = yaml.safe_load((REPO / "recipes" / "moe_quickstart.yaml").read_text())
    assert moe["train"]["max_steps"] == 1400 and "1400 steps" in (
        REPO / "docs" / "parallelism.md").read_text()  # fmt: skip
    assert "recipes/moe_quickstart.yaml" in readme
