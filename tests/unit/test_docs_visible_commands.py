"""Commands the docs want readers to run are in the rendered page, not only inside the
HTML comments that steer the docs test (`<!-- docs-test: ... -->`, which a browser hides):
the short DiffusionGemma run is a visible command block."""

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"
SHORT_GEMMA = ("unmask train recipes/diffusion_gemma_quickstart.yaml train.max_steps=20 "
               "train.eval_steps=0 data.synthetic_train_size=2000")  # fmt: skip


def rendered(text: str) -> str:
    """The text a reader sees: HTML comments removed."""
    return re.sub(r"<!--.*?-->", "", text, flags=re.S)


def test_the_short_diffusion_gemma_run_is_visible():
    page = (DOCS / "recipes.md").read_text()
    assert f"```bash\n{SHORT_GEMMA}\n```" in rendered(page)
    assert "diffusion_gemma_quickstart.yaml train.max_steps=20" not in "".join(
        re.findall(r"<!--.*?-->", page, flags=re.S))  # fmt: skip
