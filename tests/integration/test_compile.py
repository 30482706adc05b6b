"""train.torch_compile: per-block torch.compile gives the same training run as eager."""

import pytest
from conftest import losses

from unmask.config import load_config
from unmask.train.trainer import Trainer

pytestmark = pytest.mark.slow


def test_compiled_blocks_train_like_eager(tiny_config, tmp_path):
    extra = {"train": {"max_steps": 3, "eval_steps": 0, "save_steps": 0}}
    Trainer(load_config(tiny_config(extra))).train()
    eager = losses(tmp_path / "run")
    compiled_dir = tmp_path / "compiled"
    cfg = load_config(
        tiny_config(extra, name="c.yaml"),
        [f"train.output_dir={compiled_dir}", "train.torch_compile=true"],
    )
    trainer = Trainer(cfg)
    layers = trainer.model.model.layers
    assert all(layer._compiled_call_impl is not None for layer in layers)
    trainer.train()
    assert losses(compiled_dir) == pytest.approx(eager, rel=1e-5, abs=1e-6)
