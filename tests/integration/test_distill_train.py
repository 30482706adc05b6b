"""`diffusion.objective: distill` end to end on a tiny teacher run, and its bad input."""

import json

import pytest
from conftest import losses, write_run_config

from unmask.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    root = tmp_path_factory.mktemp("teacher")
    assert main(["train", str(write_run_config(root, "t", {}, {}))]) == 0
    return root / "t" / "final"


@pytest.mark.parametrize("method", ["certainty_forcing", "trajectory"])
def test_distill_run_trains_a_threshold_student(teacher, tmp_path, method):
    extra = {"model": {"pretrained": str(teacher)}, "diffusion": {"objective": "distill"},
             "distill": {"teacher": str(teacher), "method": method},
             "train": {"max_steps": 3, "save_steps": 3, "eval_steps": 0}}  # fmt: skip
    assert main(["train", str(write_run_config(tmp_path, "s", {}, extra))]) == 0
    saved = json.loads((tmp_path / "s" / "final" / "generation_config.json").read_text())
    assert saved["unmask"]["threshold"] == 0.9
    assert sorted(losses(tmp_path / "s")) == [1, 2, 3]


def test_a_teacher_with_another_tokenizer_is_one_line(teacher, tmp_path, capsys):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(teacher, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["added_tokens"].append({**tok["added_tokens"][-1], "id": 500, "content": "<extra>"})
    (other / "tokenizer.json").write_text(json.dumps(tok))
    extra = {"diffusion": {"objective": "distill"}, "distill": {"teacher": str(other)}}
    assert main(["train", str(write_run_config(tmp_path, "bad", {}, extra))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has a different tokenizer from the run's" in err[0], err
    assert not (tmp_path / "bad").exists()


def test_a_missing_teacher_is_one_line(tmp_path, capsys):
    extra = {"diffusion": {"objective": "distill"}, "distill": {"teacher": str(tmp_path / "no")}}
    assert main(["train", str(write_run_config(tmp_path, "bad", {}, extra))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a model folder (no config.json)" in err[0], err


def _shifted_copy(teacher, folder):
    import shutil

    shutil.copytree(teacher, folder)
    path = folder / "generation_config.json"
    config = json.loads(path.read_text())
    config["unmask"]["shift_logits"] = True
    path.write_text(json.dumps(config))
    return folder


def test_a_shifted_teacher_trains_and_records_a_shifted_student(teacher, tmp_path, capsys):
    shifted = _shifted_copy(teacher, tmp_path / "shifted")
    extra = {"model": {"pretrained": str(shifted)}, "diffusion": {"objective": "distill"},
             "distill": {"teacher": str(shifted)}, "train": {"max_steps": 2, "save_steps": 2,
                                                              "eval_steps": 0}}  # fmt: skip
    assert main(["train", str(write_run_config(tmp_path, "plain", {}, extra))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "samples with the logit shift" in err[0], err
    extra["diffusion"]["logit_shift"] = True
    assert main(["train", str(write_run_config(tmp_path, "s", {}, extra))]) == 0
    saved = json.loads((tmp_path / "s" / "final" / "generation_config.json").read_text())
    assert saved["unmask"]["shift_logits"] is True and saved["unmask"]["threshold"] == 0.9
