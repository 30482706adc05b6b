"""train.trim_host_memory: a CPU trainer sets glibc's trim threshold once, at start-up.

Its effect on a training step's peak RSS is measured in benchmarks/train_step.py (the
`trim_host_memory` rows); here: it is applied where it should be and nowhere else.
"""

import pytest

from unmask.config import load_config
from unmask.train import trainer as trainer_module
from unmask.train.host_memory import _libc, trim_host_memory


@pytest.mark.skipif(_libc() is None, reason="glibc's mallopt is not available here")
def test_glibc_accepts_the_setting():
    assert trim_host_memory() is True


@pytest.mark.parametrize("on", [True, False])
def test_cpu_trainer_trims_when_asked(tiny_config, tmp_path, monkeypatch, on):
    calls = []
    monkeypatch.setattr(trainer_module, "trim_host_memory", lambda: calls.append(1) or True)
    tree = {"train": {"device": "cpu", "trim_host_memory": on, "output_dir": str(tmp_path / "r")}}
    trainer_module.Trainer(load_config(tiny_config(tree, name="trim.yaml")))
    assert calls == ([1] if on else [])
