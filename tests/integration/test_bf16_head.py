"""The LM head in bf16 (diffusion/loss.py, Precision) against the float32 head, over 50 steps
of the quickstart with train.bf16 (the same bf16 body, residual stream and optimizer; only
the head's three GEMMs differ).

Tolerance: the bf16 head rounds its inputs (hidden rows, head weights, the softmax
probabilities of the gradients) to 8 bits of mantissa, a relative error up to 2^-9 per
element, and on a CPU its logits too (a GPU writes them in float32); the log-sum-exp
averages those errors over the vocabulary, so a step's loss moves by far less: measured
3.5e-5 at the first step and at most 1.5e-3 over 50 steps, as the runs' parameters drift
apart. The bound is 1e-3 on the first step (one step of rounding) and 1% on every step."""

import pytest
import torch
import yaml
from conftest import read_metrics

import unmask.diffusion.loss as loss_module
from unmask.config import load_config, quickstart_yaml
from unmask.train.trainer import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def quickstart_losses(tmp_path, name: str, head_float32: bool, monkeypatch) -> list[float]:
    tree = yaml.safe_load(quickstart_yaml())
    tree["train"].update(output_dir=str(tmp_path / name), max_steps=50, logging_steps=1,
                         eval_steps=0, save_steps=0, bf16=True, disable_tqdm=True,
                         num_threads=1)  # fmt: skip
    tree["eval"]["generate_accuracy"] = False
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tree))
    with monkeypatch.context() as patch:
        if head_float32:  # the head's GEMMs in float32, everything else as the bf16 run
            patch.setattr(loss_module, "compute_dtype", lambda hidden: torch.float32)
        Trainer(load_config(path)).train()
    return [r["loss"] for r in read_metrics(tmp_path / name) if "loss" in r]


def test_the_bf16_head_trains_as_the_float32_head_within_rounding(tmp_path, monkeypatch):
    bf16 = quickstart_losses(tmp_path, "bf16", False, monkeypatch)
    float32 = quickstart_losses(tmp_path, "float32", True, monkeypatch)
    assert len(bf16) == len(float32) == 50
    assert bf16 != float32  # the heads did round differently
    relative = [abs(a - b) / b for a, b in zip(bf16, float32)]
    assert relative[0] <= 1e-3, relative[0]
    assert max(relative) <= 0.01, relative
    assert bf16[-1] < 0.5 * bf16[0]  # and both learn


def gemma_losses(tmp_path, name: str, bf16: bool) -> list[float]:
    """20 steps of recipes/diffusion_gemma_quickstart.yaml (its model, batch of 64 rows,
    Muon and `uniform` with self-conditioning), with or without train.bf16."""
    from pathlib import Path

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "diffusion_gemma_quickstart.yaml"
    tree = yaml.safe_load(recipe.read_text())
    tree["train"].update(output_dir=str(tmp_path / name), max_steps=20, logging_steps=1,
                         eval_steps=0, save_steps=0, bf16=bf16, disable_tqdm=True,
                         num_threads=1)  # fmt: skip
    tree["eval"]["generate_accuracy"] = False
    tree["data"]["synthetic_train_size"] = 2000  # 20 steps read 1,280 rows
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tree))
    Trainer(load_config(path)).train()
    return [r["loss"] for r in read_metrics(tmp_path / name) if "loss" in r]


def test_diffusion_gemma_under_bf16_trains_as_float32_within_rounding(tmp_path):
    """DiffusionGemma's whole step under bf16 autocast (every matmul in bf16, its head
    included; the soft-capping, the log-sum-exp and the optimizer in float32) against the
    same run in float32. Every bf16 GEMM rounds its inputs to 8 bits of mantissa; a step's
    loss averages those errors: measured 5.3e-4 relative at the first step and at most
    4.9e-3 over 20 steps as the runs' parameters drift apart. Bounds: 2e-3 on the first
    step, 2% on every step."""
    bf16 = gemma_losses(tmp_path, "bf16", True)
    float32 = gemma_losses(tmp_path, "float32", False)
    assert len(bf16) == len(float32) == 20
    assert bf16 != float32  # the bf16 run did round
    relative = [abs(a - b) / b for a, b in zip(bf16, float32)]
    assert relative[0] <= 2e-3, relative[0]
    assert max(relative) <= 0.02, relative
    assert bf16[-1] < 0.85 * bf16[0] and float32[-1] < 0.85 * float32[0]  # and both learn
