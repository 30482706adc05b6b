"""End-to-end training runs on a tiny model: metrics, resume, accumulation, TensorBoard."""

import shutil
import subprocess
import sys

import pytest
import torch
from conftest import losses, read_metrics

from unmask.checkpoint import list_checkpoints
from unmask.cli import main
from unmask.config import load_config
from unmask.train.trainer import Trainer


def test_train_writes_metrics_config_checkpoints(tiny_config, tmp_path, capsys):
    assert main(["train", str(tiny_config())]) == 0
    run = tmp_path / "run"
    records = read_metrics(run)
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    for r in steps:
        assert {"loss", "learning_rate", "tokens_per_second", "elapsed_seconds"} <= set(r)
        assert r["tokens_per_second"] > 0
    elapsed = [r["elapsed_seconds"] for r in steps]
    assert 0 < elapsed[0] and elapsed == sorted(elapsed)
    assert [r["step"] for r in records if "eval_loss" in r] == [3, 6]
    # linear schedule with 2 warmup steps: lr before step 1 is 1/3 of the base lr
    assert steps[0]["learning_rate"] == pytest.approx(3e-3 / 3)
    assert [p.name for p in list_checkpoints(run)] == ["checkpoint-3", "checkpoint-6"]
    assert (run / "config.yaml").is_file() and (run / "final" / "model.safetensors").is_file()
    assert load_config(run / "config.yaml").train.max_steps == 6
    out = capsys.readouterr().out
    assert "step 6/6" in out and "tok/s" in out and "eta" in out


def test_resume_gives_the_same_losses_as_an_uninterrupted_run(tiny_config, tmp_path):
    cfg = load_config(tiny_config({"train": {"max_steps": 8, "save_steps": 4}}))
    Trainer(cfg).train()
    full = losses(tmp_path / "run")
    # a run that stopped after step 4: its dir holds only checkpoint-4
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    shutil.copytree(tmp_path / "run" / "checkpoint-4", stopped / "checkpoint-4")
    cfg2 = load_config(
        tiny_config(
            {
                "train": {
                    "max_steps": 8,
                    "save_steps": 4,
                    "output_dir": str(stopped),
                    "resume_from_checkpoint": True,
                }
            },
            name="resume.yaml",
        )
    )
    trainer = Trainer(cfg2)
    assert trainer.step == 4
    trainer.train()
    resumed = losses(stopped)
    assert sorted(resumed) == [5, 6, 7, 8]
    for step in (5, 6, 7, 8):
        assert resumed[step] == full[step]  # exactly, on CPU
    final_a = (tmp_path / "run" / "final" / "model.safetensors").read_bytes()
    final_b = (stopped / "final" / "model.safetensors").read_bytes()
    assert final_a == final_b


def _noised(trainer, batch, seed=0):
    """Precompute t and masks so different micro-batch splits see identical noise."""
    from unmask.diffusion.noise import mask_tokens, sample_t

    gen = torch.Generator().manual_seed(seed)
    t = sample_t(batch["input_ids"].shape[0], "uniform", 1e-3, gen, torch.device("cpu"))
    noisy, masked = mask_tokens(
        batch["input_ids"], t, batch["maskable"], trainer.tokenizer.mask_token_id, gen
    )
    return {**batch, "t": t, "noisy_input_ids": noisy, "masked": masked}


def test_gradient_accumulation_matches_one_big_batch(tiny_config):
    cfg = load_config(tiny_config({"optim": {"max_grad_norm": 0.0}}))
    a = Trainer(cfg)
    b = Trainer(
        cfg.model_copy(
            update={"train": cfg.train.model_copy(update={"overwrite_output_dir": True})}
        )
    )
    b.model.load_state_dict(a.model.state_dict())
    batch = _noised(
        a, {k: torch.stack([a.train_rows[i][k] for i in range(8)]) for k in a.train_rows[0]}
    )
    before = {k: v.clone() for k, v in a.model.state_dict().items()}
    stats_a = a.train_step([batch])
    micro = [{k: v[i : i + 2] for k, v in batch.items()} for i in range(0, 8, 2)]
    stats_b = b.train_step(micro)
    assert float(stats_a["loss"]) == pytest.approx(float(stats_b["loss"]), rel=1e-6)
    for name, value in a.model.state_dict().items():
        upd_a = value - before[name]
        upd_b = b.model.state_dict()[name] - before[name]
        assert torch.allclose(upd_a, upd_b, atol=1e-6, rtol=0), name
    assert any(not torch.equal(v, before[k]) for k, v in a.model.state_dict().items())


def test_tensorboard_events_hold_the_loss_curve(tiny_config, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert main(["train", str(tiny_config({"train": {"report_to": ["tensorboard"]}}))]) == 0
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("train/loss")
    assert [e.step for e in events] == [1, 2, 3, 4, 5, 6]
    expected = losses(tmp_path / "run")
    for event in events:
        assert event.value == pytest.approx(expected[event.step], rel=1e-6)
    assert [e.step for e in acc.Scalars("eval/loss")] == [3, 6]


def test_crash_mid_save_leaves_no_complete_looking_checkpoint(tiny_config, tmp_path, monkeypatch):
    cfg = load_config(tiny_config({"train": {"max_steps": 2, "save_steps": 1}}))
    trainer = Trainer(cfg)
    real_save = torch.save

    def failing_save(obj, path, *args, **kwargs):
        if str(path).endswith("optimizer.pt") and "checkpoint-2" in str(path):
            raise OSError("disk full")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        trainer.train()
    run = tmp_path / "run"
    assert [p.name for p in list_checkpoints(run)] == ["checkpoint-1"]
    assert not (run / "checkpoint-2").exists()
    monkeypatch.setattr(torch, "save", real_save)
    resumed = Trainer(
        load_config(
            tiny_config(
                {"train": {"max_steps": 2, "save_steps": 1, "resume_from_checkpoint": True}}
            )
        )
    )
    assert resumed.step == 1


def test_save_total_limit_keeps_newest(tiny_config, tmp_path):
    assert (
        main(["train", str(tiny_config({"train": {"save_steps": 1, "save_total_limit": 2}}))]) == 0
    )
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["checkpoint-5", "checkpoint-6"]


@pytest.mark.slow
def test_module_entry_point_and_generate_cli(tiny_config, tmp_path):
    cfg = tiny_config()
    for argv in (["train", str(cfg)], ["train", "--config", str(cfg)]):
        run = subprocess.run(
            [sys.executable, "-m", "unmask", *argv, "train.overwrite_output_dir=true"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr
    gen = subprocess.run(
        [
            sys.executable,
            "-m",
            "unmask",
            "generate",
            "--model",
            str(tmp_path / "run" / "checkpoint-6"),
            "--prompt",
            "rev 123=",
            "--gen-length",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("rev 123=")


def test_muon_trains_through_the_config_and_prints_its_split(tiny_config, tmp_path, capsys):
    cfg = tiny_config({"optim": {"use_muon": True, "ns_dtype": "float32"}})
    assert main(["train", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "MuonAdamW parameter split:" in out and "muon" in out
    assert "Muon Newton-Schulz in float32 (optim.ns_dtype)" in out
    records = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert all(r["loss"] == r["loss"] and r["loss"] < 20 for r in records)  # finite
    assert records[-1]["loss"] < records[0]["loss"]


def test_resume_with_a_longer_run_says_what_changed_and_warmup_notice(tiny_config, tmp_path,
                                                                       capsys):  # fmt: skip
    cfg = tiny_config({"train": {"max_steps": 4, "save_steps": 2},
                       "optim": {"warmup_steps": 10}})  # fmt: skip
    assert main(["train", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "warmup takes 10 steps of the run's 4: the learning rate never reaches" in out
    assert main(["train", str(cfg), "train.max_steps=6", "train.resume_from_checkpoint=true"]) == 0
    out = capsys.readouterr().out
    assert "resuming with changed settings" in out and "train.max_steps: 4 -> 6" in out
    history = tmp_path / "run" / "config_history" / "step-4.yaml"
    assert "max_steps: 4" in history.read_text()
