"""Whether the served model can answer chat requests: a model whose tokenizer has no chat
template and that was never trained on chat rows (prompt/answer pairs in unmask's
`role: content` format: the `sft`, `preference`, `grpo` and `distill` objectives) gets
/v1/chat/completions' messages in a format it never saw, and mostly answers with nothing.
`unmask serve` says so in one line at start-up and in /api/info (docs/serving.md, Chat)."""

from __future__ import annotations

from pathlib import Path

import yaml

from unmask.data.sft import has_chat_template

#: objectives that train on prompt/answer rows (unmask's chat format without a template)
CHAT_OBJECTIVES = ("sft", "preference", "grpo", "distill")


def trained_objective(model_dir: str | Path) -> str | None:
    """The diffusion.objective of the run that made a model folder: its own config.yaml
    (a run's output_dir) or its parent's (final/, checkpoint-N/). None when neither holds
    a readable run config (an exported or a downloaded folder)."""
    folder = Path(model_dir)
    for candidate in (folder / "config.yaml", folder.parent / "config.yaml"):
        try:
            tree = yaml.safe_load(candidate.read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue
        section = tree.get("diffusion") if isinstance(tree, dict) else None
        if isinstance(section, dict):
            objective = section.get("objective", "mdlm")
            return objective if isinstance(objective, str) else None
    return None


def chat_notice(model_dir: str | Path, tokenizer) -> str | None:
    """A one-line warning when chat requests are unlikely to get answers (module doc),
    else None."""
    if has_chat_template(tokenizer):
        return None
    objective = trained_objective(model_dir)
    if objective in CHAT_OBJECTIVES:
        return None
    made = (f"its run trained {objective!r}, not chat rows" if objective is not None
            else "no run config says it trained on chat rows")  # fmt: skip
    return (
        f"chat: this model's tokenizer has no chat template and {made}; "
        "/v1/chat/completions sends it 'role: content' lines it never saw and its answers "
        "may be empty: use /v1/completions with the prompts it was trained on, or train "
        "on chat data (diffusion.objective: sft; docs/serving.md, Chat)"
    )
