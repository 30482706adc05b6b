"""A tiny DiffusionGemma trained by `unmask train` with the `uniform` objective on the
synthetic quickstart tasks: its loss falls over 30 steps; 2 processes (FSDP2, the router
trained and frozen) give the losses of 1 within 1e-5; a run resumed from a checkpoint gives
the uninterrupted run's losses and weights bit for bit."""

import shutil

import pytest
from conftest import (
    TINY_GEMMA,
    deep_update,
    losses,
    read_metrics,
    train_in_process,
    write_run_config,
)
from launch import train_in_ranks

from unmask.cli import main

pytestmark = pytest.mark.slow

GEMMA = TINY_GEMMA


def test_30_steps_on_the_quickstart_tasks_lower_the_loss(tmp_path):
    path = write_run_config(tmp_path, "run", GEMMA, {"train": {"max_steps": 30}})
    assert main(["train", str(path)]) == 0
    run = tmp_path / "run"
    curve = losses(run)
    assert sorted(curve) == list(range(1, 31))
    first = sum(curve[s] for s in range(1, 6)) / 5
    last = sum(curve[s] for s in range(26, 31)) / 5
    assert last < 0.85 * first, (first, last)
    final = [r for r in read_metrics(run) if "eval_loss" in r][-1]["eval_loss"]
    assert final < 0.85 * first
    assert (run / "final" / "model.safetensors").is_file()


def test_two_processes_give_the_one_process_losses(tmp_path):
    base = deep_update(GEMMA, {"train": {"split_batches": True, "max_steps": 5}})
    frozen = {"diffusion": {"freeze_router": True}}
    configs = {
        "trained": write_run_config(tmp_path, "trained", base, {}),
        "frozen": write_run_config(tmp_path, "frozen", base, frozen),
    }
    results = train_in_ranks(2, tmp_path / "results.json", *configs.values())
    for name, path in configs.items():
        assert results[name]["rc"] == 0, results[name]["stderr"][-2000:]
        single = losses(train_in_process(path, tmp_path / f"{name}-1"))
        double = losses(tmp_path / name)
        assert sorted(single) == sorted(double) == [1, 2, 3, 4, 5]
        for step in single:
            assert double[step] == pytest.approx(single[step], abs=1e-5), (name, step)


def test_a_resumed_run_gives_the_same_losses_bit_for_bit(tmp_path):
    full = write_run_config(tmp_path, "full", GEMMA, {"train": {"max_steps": 8, "save_steps": 4}})
    assert main(["train", str(full)]) == 0
    stopped = tmp_path / "stopped"  # a run killed after step 4: only checkpoint-4 on disk
    stopped.mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-4", stopped / "checkpoint-4")
    resume = {"train": {"max_steps": 8, "save_steps": 4, "resume_from_checkpoint": True}}
    assert main(["train", str(write_run_config(tmp_path, "stopped", GEMMA, resume))]) == 0
    before, after = losses(tmp_path / "full"), losses(stopped)
    assert sorted(after) == [5, 6, 7, 8]
    for step in after:
        assert after[step] == before[step], step  # exactly, on CPU
    weights = [(run / "final" / "model.safetensors").read_bytes()
               for run in (tmp_path / "full", stopped)]  # fmt: skip
    assert weights[0] == weights[1]


@pytest.mark.parametrize("self_conditioning", [0.0, 0.5])
def test_the_mfu_flop_count_of_a_uniform_step_equals_flop_counter_mode(tmp_path, self_conditioning):
    """The family's own count (models/shape.py DiffusionGemmaShape.call_flops: the encoder
    over the prompt, the decoder over the canvas, the whole-vocabulary head, the
    self-conditioning pass) against torch's FlopCounterMode over one step (AdamW: no
    matmuls in the optimizer; sdpa's math kernel, whose matmuls the counter sees; the
    experts one matmul each: the counter has no formula for grouped GEMMs)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from unmask.config import load_config
    from unmask.train.trainer import Trainer

    extra = {"optim": {"name": "adamw"},
             "model": {"attn_implementation": "sdpa", "moe_implementation": "loop"},
             "diffusion": {"self_conditioning_prob": self_conditioning}}  # fmt: skip
    trainer = Trainer(load_config(write_run_config(tmp_path, "run", GEMMA, extra)))
    trainer.train_step([next(trainer.loader)])
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        stats = trainer.train_step([next(trainer.loader)])
    counted = counter.get_total_flops()
    assert counted > 0
    assert float(stats["flops"]) == pytest.approx(counted, rel=0.02)
