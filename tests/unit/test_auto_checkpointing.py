"""train.activation_checkpointing auto (unmask/plan/checkpointing.py): the least
recomputation whose planned peak fits the device: none, else selective, else full; a
config that says (activation_checkpointing, or gradient_checkpointing) decides itself;
`unmask train` says which at start-up and trains with it."""

from dataclasses import replace

import pytest
import yaml
from conftest import TINY, deep_update

from unmask.cli import main
from unmask.config import load_config
from unmask.plan.checkpointing import (
    USABLE_MEMORY,
    checkpointing_is_auto,
    planned_peaks,
    resolve_checkpointing,
)
from unmask.plan.devices import DEVICES

pytestmark = pytest.mark.usefixtures("one_thread")


def config(tmp_path, **train):
    tree = deep_update(TINY, {"train": {"output_dir": str(tmp_path / "run"), **train},
                              "model": {"num_hidden_layers": 4}})  # fmt: skip
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    return load_config(path)


def test_auto_takes_the_least_recomputation_that_fits(tmp_path):
    cfg = config(tmp_path)
    assert checkpointing_is_auto(cfg) and cfg.train.activation_checkpointing == "auto"
    peaks = planned_peaks(cfg, 1, DEVICES["h100"])
    assert peaks["none"] > peaks["selective"] > peaks["full"] > 0  # each recomputes more
    for choice, peak in peaks.items():  # a device whose usable memory holds just that peak
        device = replace(DEVICES["h100"], memory_bytes=peak / USABLE_MEMORY * 1.0001)
        resolved, line = resolve_checkpointing(cfg, 1, device)
        assert resolved.train.activation_checkpointing == choice, (choice, line)
        assert line.startswith(f"activation checkpointing: {choice} (auto: planned peak")
    tiny = replace(DEVICES["h100"], memory_bytes=1.0)
    resolved, line = resolve_checkpointing(cfg, 1, tiny)
    assert resolved.train.activation_checkpointing == "full"
    assert "not even full fits" in line


@pytest.mark.parametrize("train", [{"activation_checkpointing": "none"},
                                   {"gradient_checkpointing": False},
                                   {"gradient_checkpointing": True}])  # fmt: skip
def test_a_config_that_says_decides_itself(tmp_path, train):
    cfg = config(tmp_path, **train)
    assert not checkpointing_is_auto(cfg)
    assert resolve_checkpointing(cfg, 1, replace(DEVICES["h100"], memory_bytes=1.0)) == (cfg, "")


def test_unmask_train_says_which_and_trains_with_it(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    tree = deep_update(TINY, {"train": {"output_dir": str(tmp_path / "run"), "max_steps": 2,
                                        "save_steps": 0, "eval_steps": 0}})  # fmt: skip
    path.write_text(yaml.safe_dump(tree))
    assert main(["train", str(path)]) == 0
    out = capsys.readouterr()
    assert "activation checkpointing: none (auto: planned peak per rank" in out.out + out.err
