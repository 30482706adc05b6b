"""train.activation_checkpointing auto (unmask/plan/checkpointing.py): the least
recomputation whose planned peak fits the device: none, else selective, else full; a
config that says (activation_checkpointing, or gradient_checkpointing) decides itself; the
trainer decides from its own built model (the rank's real shards) and says which at
start-up, `unmask plan` from its meta build, and the two agree."""

from dataclasses import replace

import pytest
import yaml
from conftest import TINY, deep_update

import unmask.plan.checkpointing as auto
from unmask.cli import main
from unmask.config import load_config
from unmask.plan.checkpointing import (
    CHOICES,
    USABLE_MEMORY,
    planned_peaks,
    resolve_checkpointing,
)
from unmask.plan.devices import DEVICES
from unmask.train.setup import checkpointing_is_auto
from unmask.train.trainer import UNDECIDED_CHECKPOINTING, Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def config(tmp_path, **train):
    tree = deep_update(TINY, {"train": {"output_dir": str(tmp_path / "run"), **train},
                              "model": {"num_hidden_layers": 4}})  # fmt: skip
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    return load_config(path)


def fitting(peak: float):
    """An H100 whose usable memory holds just `peak` bytes."""
    return replace(DEVICES["h100"], memory_bytes=peak / USABLE_MEMORY * 1.0001)


def test_auto_takes_the_least_recomputation_that_fits(tmp_path):
    cfg = config(tmp_path)
    assert checkpointing_is_auto(cfg.train) and cfg.train.activation_checkpointing == "auto"
    peaks = planned_peaks(cfg, 1, DEVICES["h100"])
    assert peaks["none"] > peaks["selective"] > peaks["full"] > 0  # each recomputes more
    for choice, peak in peaks.items():
        resolved, line = resolve_checkpointing(cfg, 1, fitting(peak))
        assert resolved.train.activation_checkpointing == choice, (choice, line)
        assert line.startswith(f"activation checkpointing: {choice} (auto: planned peak")
    resolved, line = resolve_checkpointing(cfg, 1, replace(DEVICES["h100"], memory_bytes=1.0))
    assert resolved.train.activation_checkpointing == "full"
    assert "not even full fits" in line


@pytest.mark.parametrize("train", [{"activation_checkpointing": "none"},
                                   {"gradient_checkpointing": False},
                                   {"gradient_checkpointing": True}])  # fmt: skip
def test_a_config_that_says_decides_itself(tmp_path, train):
    cfg = config(tmp_path, **train)
    assert not checkpointing_is_auto(cfg.train)
    assert resolve_checkpointing(cfg, 1, replace(DEVICES["h100"], memory_bytes=1.0)) == (cfg, "")


def test_the_trainer_decides_from_its_built_model_as_the_plan_does(tmp_path, monkeypatch):
    """The trainer's walk over its real shards gives the planner's peaks; on a device that
    holds only the selective peak the model is built checkpointing every other layer."""
    cfg = config(tmp_path)
    peaks = planned_peaks(cfg, 1, DEVICES["h100"])
    monkeypatch.setattr(auto, "training_device", lambda device: fitting(peaks["selective"]))
    trainer = Trainer(cfg, decide_checkpointing=auto.choose_for_trainer)
    line = next(n for n in trainer.notices if n.startswith("activation checkpointing"))
    assert line.startswith("activation checkpointing: selective (auto: planned peak per rank")
    shown = {c: f"{c} {peaks[c] / 2**30:.1f}" for c in CHOICES}
    assert all(text in line for text in shown.values()), (line, shown)
    assert trainer.model.gradient_checkpointing == cfg.train.activation_checkpointing_every
    trainer.loader.close()


def test_a_trainer_without_the_decider_says_auto_was_not_decided(tmp_path):
    """No registry filled by importing the planner: a Trainer built without the decider
    (the planner sits a layer above it) checkpoints nothing and says so at start-up."""
    trainer = Trainer(config(tmp_path))
    assert UNDECIDED_CHECKPOINTING in trainer.notices
    assert trainer.model.gradient_checkpointing is False
    trainer.loader.close()


def test_unmask_train_says_which(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    tree = deep_update(TINY, {"train": {"output_dir": str(tmp_path / "run"), "max_steps": 2,
                                        "save_steps": 0, "eval_steps": 0}})  # fmt: skip
    path.write_text(yaml.safe_dump(tree))
    assert main(["train", str(path)]) == 0
    out = capsys.readouterr()
    assert "activation checkpointing: none (auto: planned peak per rank" in out.out + out.err
