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


def _store(tmp_path):
    """A tiny token store (char tokenizer ids) and its tokenizer folder."""
    import numpy as np

    from unmask.data import IndexedWriter
    from unmask.data.indexed import tokenizer_fingerprint, vocab_size
    from unmask.data.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    tok.save_pretrained(str(tmp_path / "tok"))
    with IndexedWriter(tmp_path / "store", np.uint16) as writer:
        for i in range(20):
            writer.add_document(tok(f"document {i}", add_special_tokens=False)["input_ids"])
        writer.finish({"tokenizer_fingerprint": tokenizer_fingerprint(tok),
                       "vocab_size": vocab_size(tok)})  # fmt: skip
    return tmp_path / "store", tmp_path / "tok"


def test_data_at_scale_bad_inputs(tiny_config, tmp_path, capsys):
    prefix, tok = _store(tmp_path)
    (tmp_path / "empty_shards").mkdir()
    truncated = tmp_path / "cut"
    (tmp_path / "cut.idx").write_bytes((tmp_path / "store.idx").read_bytes())
    (tmp_path / "cut.bin").write_bytes((tmp_path / "store.bin").read_bytes()[:-6])
    other = tmp_path / "other"
    (tmp_path / "other.idx").write_bytes(b"NOTANIDX" + b"\0" * 40)
    (tmp_path / "other.bin").write_bytes(b"")
    cases = [
        ({"sources": [{"path": str(prefix), "weight": 0}]}, "data.sources.0.weight"),
        ({"dataset": str(tmp_path / "empty_shards"), "streaming": True}, "holds no data files"),
        ({"dataset": str(truncated), "tokenizer": str(tok)}, "holds 414 bytes but"),
        ({"dataset": str(other), "tokenizer": str(tok)}, "MMIDIDX"),
        ({"dataset": str(prefix), "sources": [{"path": str(prefix)}]}, "not both"),
    ]
    for index, (data, message) in enumerate(cases):
        out = tmp_path / f"run{index}"
        cfg = tiny_config({"data": data, "train": {"output_dir": str(out), "max_steps": 2}},
                          name=f"bad{index}.yaml")  # fmt: skip
        code, err = run_main(["train", str(cfg)], capsys)
        assert code == 2 and len(err) == 1, (data, err)
        assert message in err[0], (message, err[0])
        assert not out.exists()


def test_lmms_engine_hub_dataset_offline_is_one_line_with_the_local_alternative(
    tmp_path, capsys, monkeypatch
):
    import yaml
    from conftest import TINY

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as on a cluster node without the hub
    tree = {
        "trainer_type": "dllm_trainer",
        "model_config": {"load_from_config": {"model_type": "qwen3_dllm",
                                              "config": TINY["model"]}},
        "dataset_config": {"dataset_type": "fineweb_edu", "dataset_format": "hf_dataset",
                           "dataset_path": "HuggingFaceFW/fineweb-edu", "packing_length": 64},
        "trainer_args": {"max_steps": 2, "output_dir": str(tmp_path / "run")},
    }  # fmt: skip
    path = tmp_path / "lmms.yaml"
    path.write_text(yaml.safe_dump(tree))
    code, err = run_main(["train", str(path)], capsys)
    assert code == 2 and len(err) == 1, err
    assert "'HuggingFaceFW/fineweb-edu' is not a local path" in err[0]
    assert "set data.dataset to that local folder" in err[0]
    assert not (tmp_path / "run").exists()


def test_a_mistyped_flag_names_the_flag_it_is_close_to(capsys):
    code, err = run_main(["generate", "--model", "x", "--prompt", "a", "--temprature", "0.5"],
                         capsys)  # fmt: skip
    assert code == 2 and len(err) == 1
    assert err[0] == (
        "unmask: error: unrecognized arguments: --temprature 0.5 (did you mean "
        "'--temperature'?); see `unmask generate --help`"
    )


def test_resuming_with_another_model_is_refused_naming_the_keys(tiny_config, tmp_path, capsys):
    config = tiny_config({"train": {"max_steps": 3, "save_steps": 3, "eval_steps": 0}})
    assert main(["train", str(config)]) == 0
    run = tmp_path / "run"
    before = snapshot(run)
    code, err = run_main(["train", str(config), "train.resume_from_checkpoint=true",
                          "train.max_steps=6", "model.hidden_size=64",
                          "model.attn_implementation=flex"], capsys)  # fmt: skip
    assert code == 2 and len(err) == 1
    assert "holds a run of another model (model.hidden_size 32 there, 64 here)" in err[0]
    assert "attn_implementation" not in err[0]  # how the model computes may change
    assert snapshot(run) == before
