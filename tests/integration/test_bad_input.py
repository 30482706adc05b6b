"""Bad input: one clear line on stderr, exit code 2, nothing written or deleted."""

import json
import subprocess
import sys

from unmask.cli import main


def snapshot(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else None


def run_main(argv, capsys):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


def test_unknown_key(tiny_config, tmp_path, capsys):
    code, err = run_main(["train", str(tiny_config({"train": {"max_step": 5}}))], capsys)
    assert code == 2 and len(err) == 1
    assert "unknown config key 'train.max_step'" in err[0] and "'train.max_steps'" in err[0]
    assert not (tmp_path / "run").exists()


def test_wrong_type(tiny_config, tmp_path, capsys):
    code, err = run_main(
        ["train", str(tiny_config()), "train.per_device_train_batch_size=big"], capsys
    )
    assert code == 2 and len(err) == 1
    assert "train.per_device_train_batch_size" in err[0] and "'big'" in err[0]
    assert not (tmp_path / "run").exists()


def test_missing_data_path(tiny_config, tmp_path, capsys):
    missing = tmp_path / "no_such_data.jsonl"
    code, err = run_main(["train", str(tiny_config({"data": {"dataset": str(missing)}}))], capsys)
    assert code == 2 and len(err) == 1
    assert str(missing) in err[0]
    assert not (tmp_path / "run").exists()


def test_empty_dataset(tiny_config, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, err = run_main(
        ["train", str(tiny_config({"data": {"dataset": str(empty), "packing": True}}))], capsys
    )
    assert code == 2 and len(err) == 1
    assert "empty" in err[0].lower()
    assert not (tmp_path / "run").exists()


def test_existing_output_dir_is_left_untouched(tiny_config, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    (run / "notes.txt").write_text("mine")
    before = snapshot(run)
    contents = (run / "metrics.jsonl").read_text()
    code, err = run_main(["train", str(tiny_config())], capsys)
    assert code == 2 and len(err) == 1
    assert "already holds a run" in err[0] and "resume_from_checkpoint" in err[0]
    assert "overwrite_output_dir" in err[0]
    assert snapshot(run) == before
    assert (run / "metrics.jsonl").read_text() == contents


def test_overwrite_keeps_unrelated_files(tiny_config, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    (run / "metrics.jsonl").write_text("old\n")
    assert main(["train", str(tiny_config()), "train.overwrite_output_dir=true"]) == 0
    assert (run / "notes.txt").read_text() == "mine"
    assert "old" not in (run / "metrics.jsonl").read_text()


def test_bad_resume_path(tiny_config, tmp_path, capsys):
    code, err = run_main(
        ["train", str(tiny_config()), f"train.resume_from_checkpoint={tmp_path}/nope"], capsys
    )
    assert code == 2 and "does not exist" in err[0]
    assert not (tmp_path / "run").exists()


def test_generate_missing_model(tmp_path, capsys):
    code, err = run_main(["generate", "--model", str(tmp_path / "x"), "--prompt", "a"], capsys)
    assert code == 2 and len(err) == 1 and "not a folder" in err[0]


def test_exit_code_from_a_real_process(tiny_config, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "unmask", "train", str(tiny_config({"trainn": {}}))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == ["unmask: error: unknown config key 'trainn' (did you mean 'train'?)"]
    assert not (tmp_path / "run").exists()
