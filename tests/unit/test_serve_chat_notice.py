"""The start-up warning of a model that cannot answer chat requests (serve/chat.py): no
chat template and a run that never trained on chat rows."""

import yaml
from conftest import save_tiny_model

from unmask.checkpoint import load_for_sampling
from unmask.serve.chat import chat_notice, trained_objective


def test_the_notice_names_what_the_model_was_trained_on(tmp_path):
    run = tmp_path / "run"
    folder = save_tiny_model(run / "final")
    tokenizer = load_for_sampling(folder, device="cpu").tokenizer
    assert trained_objective(folder) is None
    assert "no run config says it trained on chat rows" in chat_notice(folder, tokenizer)
    (run / "config.yaml").write_text(yaml.safe_dump({"diffusion": {"objective": "mdlm"}}))
    assert trained_objective(folder) == trained_objective(run) == "mdlm"
    notice = chat_notice(folder, tokenizer)
    assert notice.startswith("chat: this model's tokenizer has no chat template and its run "
                             "trained 'mdlm', not chat rows;")  # fmt: skip
    assert "/v1/completions" in notice and "diffusion.objective: sft" in notice
    for objective in ("sft", "preference", "grpo", "distill"):  # chat rows: no warning
        (run / "config.yaml").write_text(yaml.safe_dump({"diffusion": {"objective": objective}}))
        assert chat_notice(folder, tokenizer) is None
    (run / "config.yaml").write_bytes(b"\xff\xfe: [")  # unreadable: as if none
    assert trained_objective(folder) is None
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert chat_notice(folder, tokenizer) is None  # a template: the model's own format
