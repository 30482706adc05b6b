"""`diffusion.objective: grpo` through the trainer: rollout metrics, exact resume (also inside
a cycle of inner iterations, on 1 and 2 ranks), LoRA with the KL to the adapter-free base,
and 2 gloo ranks against 1."""

import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from conftest import (
    by_step,
    deep_update,
    losses,
    read_metrics,
    train_in_process,
    write_run_config,
)
from launch import train_in_ranks

from unmask.checkpoint.layout import write_manifest
from unmask.config import load_config
from unmask.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

# a random tiny model never answers right: the format reward (a letter a-m anywhere) varies
# within groups, so advantages and losses are not all 0
GRPO = {
    "diffusion": {"objective": "grpo"},
    "grpo": {"group_size": 2, "log_samples": 1},
    "rewards": [
        {"fn": "format", "options": {"pattern": "[a-m]", "match": "search"}},
        {"fn": "exact_match"},
    ],  # fmt: skip
    "train": {
        "per_device_train_batch_size": 2,
        "eval_steps": 2,
        "save_steps": 2,
        "max_steps": 4,
    },  # fmt: skip
}


def write(root: Path, name: str, extra: dict) -> Path:
    return write_run_config(root, name, GRPO, extra)


def test_grpo_logs_rollouts_and_resumes_exactly(tmp_path, capsys):
    Trainer(load_config(write(tmp_path, "run", {}))).train()
    records = read_metrics(tmp_path / "run")
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    # the progress line shows the mean reward (and its std), not the policy loss (near 0 by
    # construction: advantages are centered per group)
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(printed) == 4
    for line, r in zip(printed, steps):
        assert line.startswith(
            f"step {r['step']}/4 | reward {r['reward_mean']:.3f} (std {r['reward_std']:.2f}) | "
        ), line
        assert "loss" not in line.split(" | eval_loss")[0]
    for r in steps:
        keys = {"reward_mean", "reward_std", "reward/format_mean", "reward/exact_match_std",
                "completion_length", "zero_advantage_groups", "clip_fraction",
                "generations_per_second", "samples"}  # fmt: skip
        assert keys <= set(r), set(r)
        assert 0 <= r["zero_advantage_groups"] <= 1 and r["completion_length"] > 0
        assert set(r["samples"][0]) == {"prompt", "completion", "answer", "reward"}
    # diffu-GRPO at ratio 1 on equal-length completions has loss 0, not gradient 0
    assert any(r["grad_norm"] > 0 for r in steps)
    grad_norms = {r["step"]: r["grad_norm"] for r in steps}
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4]
    full = losses(tmp_path / "run")
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    shutil.copytree(tmp_path / "run" / "checkpoint-2", stopped / "checkpoint-2")
    cfg = write(tmp_path, "stopped", {"train": {"resume_from_checkpoint": True}})
    trainer = Trainer(load_config(cfg))
    assert trainer.step == 2
    trainer.train()
    resumed = losses(stopped)
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert resumed[step] == full[step]  # exactly, on CPU
    assert by_step(stopped, "grad_norm") == {3: grad_norms[3], 4: grad_norms[4]}
    final = "final/model.safetensors"
    assert (tmp_path / "run" / final).read_bytes() == (stopped / final).read_bytes()


# mu = 2: the rollouts of steps 0, 2 serve steps 1, 3 (0-based); checkpoint-1 and -3 are
# written inside a cycle, so they carry each rank's cached rollouts (two micro-batches)
CYCLE = {"grpo": {"inner_iterations": 2},
         "train": {"max_steps": 4, "save_steps": 1, "eval_steps": 0,
                   "gradient_accumulation_steps": 2}}  # fmt: skip


def grad_norms(run_dir: Path) -> dict[int, float]:
    return by_step(run_dir, "grad_norm")


def resume_from(tmp_path: Path, name: str, checkpoint: Path, extra: dict) -> Trainer:
    """A Trainer of a run `name` continuing from `checkpoint` (a copy in its own folder)."""
    (tmp_path / name).mkdir()
    shutil.copytree(checkpoint, tmp_path / name / checkpoint.name)
    tree = deep_update(CYCLE, deep_update({"train": {"resume_from_checkpoint": True}}, extra))
    return Trainer(load_config(write(tmp_path, name, tree)))


def test_grpo_resumes_exactly_inside_a_rollout_cycle(tmp_path):
    """Resumed from checkpoint-1 (mid-cycle), step 2 uses the saved rollouts, advantages,
    seeds and old log-likelihoods: losses, grad norms and final weights equal the
    uninterrupted run's; without the saved rollouts step 2's loss is another."""
    Trainer(load_config(write(tmp_path, "run", CYCLE))).train()
    run = tmp_path / "run"
    saved = {n: (run / f"checkpoint-{n}" / "rank_state" / "rank-0.pt").is_file()
             for n in (1, 2, 3, 4)}  # fmt: skip
    assert saved == {1: True, 2: False, 3: True, 4: False}
    state = torch.load(run / "checkpoint-1" / "rank_state" / "rank-0.pt", weights_only=True)
    assert (state["world_size"], state["micro_batches"], state["rows"]) == (1, 2, 2)
    assert state["objective"]["cycle_start"] == 0
    assert [r["micro"] for r in state["objective"]["rollouts"]] == [0, 1]
    full, norms = losses(run), grad_norms(run)
    # ratio 1 at a cycle's first step; after an update the second step's loss is not 0
    assert sorted(norms) == [1, 2, 3, 4] and min(norms.values()) > 0
    assert full[2] != 0 and full[4] != 0

    trainer = resume_from(tmp_path, "resumed", run / "checkpoint-1", {})
    assert trainer.step == 1
    trainer.train()
    resumed = tmp_path / "resumed"
    assert losses(resumed) == {s: full[s] for s in (2, 3, 4)}  # exactly, on CPU
    assert grad_norms(resumed) == {s: norms[s] for s in (2, 3, 4)}
    final = "final/model.safetensors"
    assert (run / final).read_bytes() == (resumed / final).read_bytes()

    # SIGTERM during the first step: the stop saves checkpoint-1 with the rollouts; resumed,
    # the run ends like the uninterrupted one
    stopped = Trainer(load_config(write(tmp_path, "stopped", CYCLE)))
    begin = stopped.objective.begin_step

    def signal_at_the_first_step(step: int) -> None:
        if step == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        begin(step)

    stopped.objective.begin_step = signal_at_the_first_step
    stopped.train()
    assert stopped.stopped_by == "SIGTERM" and stopped.step == 1
    assert (tmp_path / "stopped" / "checkpoint-1" / "rank_state" / "rank-0.pt").is_file()
    cfg = write(
        tmp_path, "stopped", deep_update(CYCLE, {"train": {"resume_from_checkpoint": True}})
    )
    Trainer(load_config(cfg)).train()
    assert losses(tmp_path / "stopped") == full
    assert (run / final).read_bytes() == (tmp_path / "stopped" / final).read_bytes()

    # the same checkpoint without its rollouts (as before they were saved): step 2 differs
    bare = tmp_path / "bare" / "checkpoint-1"
    shutil.copytree(run / "checkpoint-1", bare)
    shutil.rmtree(bare / "rank_state")
    write_manifest(bare)
    trainer = resume_from(tmp_path, "fresh", bare, {})
    trainer.train()
    assert losses(tmp_path / "fresh")[2] != full[2]


@pytest.mark.parametrize(
    ("other", "why"),
    [
        ({"grpo": {"inner_iterations": 3}},
         "they were drawn with grpo.inner_iterations 2, this run has 3"),
        ({"grpo": {"group_size": 4}}, "they were drawn with grpo.group_size 2, this run has 4"),
        ({"train": {"gradient_accumulation_steps": 1, "per_device_train_batch_size": 4}},
         "2 micro-batches per step there, 1 here; 2 rows per micro-batch and process there, 4 "
         "here"),
    ],
)  # fmt: skip
def test_grpo_mid_cycle_checkpoint_resumed_with_other_settings(tmp_path, capsys, other, why):
    """The saved rollouts do not fit a run with another mu, group size or batch layout: a
    notice names the difference and the run goes on with fresh rollouts."""
    two_steps = {"train": {"max_steps": 2}}
    Trainer(load_config(write(tmp_path, "run", deep_update(CYCLE, two_steps)))).train()
    capsys.readouterr()
    extra = deep_update(two_steps, other)
    trainer = resume_from(tmp_path, "other", tmp_path / "run" / "checkpoint-1", extra)
    assert trainer.objective._cache == {}
    trainer.train()
    assert (
        f"checkpoint-1 holds cached rollouts this run cannot reuse ({why}): the next step draws "
        "fresh ones, so the run differs from an uninterrupted one; resume with the settings it "
        "was written with to reuse them"
    ) in capsys.readouterr().out
    assert sorted(losses(tmp_path / "other")) == [2]


def test_grpo_with_lora_and_kl_to_the_base(tmp_path):
    """Under LoRA the reference is the model with its adapters disabled: at step 1 the
    adapters are still 0 (peft's init), so the KL is exactly 0; then it grows."""
    extra = {"model": {"lora": True, "lora_r": 4}, "grpo": {"kl_beta": 0.1},
             "optim": {"learning_rate": 0.05}, "train": {"max_steps": 3, "eval_steps": 0,
                                                         "save_steps": 0}}  # fmt: skip
    Trainer(load_config(write(tmp_path, "lora", extra))).train()
    kl = by_step(tmp_path / "lora", "kl")
    assert sorted(kl) == [1, 2, 3]
    assert kl[1] == 0.0
    assert kl[3] > 0.0
    assert (tmp_path / "lora" / "final").is_dir()


@pytest.mark.slow
def test_grpo_two_ranks_match_one(tmp_path):
    """Prompt groups draw rollouts and estimator masks from their own seeds (drawn for the
    global batch): the 2-rank FSDP2 run's losses equal the 1-rank run's."""
    extra = {"train": {"split_batches": True, "per_device_train_batch_size": 4, "max_steps": 3,
                       "eval_steps": 0, "save_steps": 0},
             "grpo": {"estimator": "coupled", "loss": "spg"}}  # fmt: skip
    cfg = write(tmp_path, "two", extra)
    assert train_in_ranks(2, tmp_path / "results.json", cfg)["two"]["rc"] == 0
    train_in_process(cfg, tmp_path / "one")
    single, double = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(single) == sorted(double) == [1, 2, 3]
    assert any(v != 0 for v in single.values())
    for step in single:
        assert double[step] == pytest.approx(single[step], abs=1e-5), step


@pytest.mark.slow
def test_grpo_two_ranks_resume_exactly_inside_a_rollout_cycle(tmp_path, capsys):
    """2 gloo ranks, each with its own rows: checkpoint-1 holds one rollout file per rank and
    the resumed run (one torchrun launch with the uninterrupted one) matches it exactly.
    Resumed in one process, the 2 ranks' rollouts do not fit: a notice, fresh rollouts."""
    full = write(tmp_path, "full", CYCLE)
    checkpoint = tmp_path / "full" / "checkpoint-1"
    resumed = write(tmp_path, "resumed",
                    deep_update(CYCLE, {"train": {"resume_from_checkpoint": str(checkpoint)}}))  # fmt: skip
    results = train_in_ranks(2, tmp_path / "results.json", full, resumed)
    assert {k: v["rc"] for k, v in results.items()} == {"full": 0, "resumed": 0}
    files = sorted(p.name for p in (checkpoint / "rank_state").iterdir())
    assert files == ["rank-0.pt", "rank-1.pt"]
    saved = [torch.load(checkpoint / "rank_state" / name, weights_only=True) for name in files]
    assert [state["rank"] for state in saved] == [0, 1]
    rows = [state["objective"]["rollouts"][0]["rows"]["ids"] for state in saved]
    assert not torch.equal(rows[0], rows[1])  # each rank's own completions
    run, again = tmp_path / "full", tmp_path / "resumed"
    assert losses(again) == {s: losses(run)[s] for s in (2, 3, 4)}
    assert grad_norms(again) == {s: grad_norms(run)[s] for s in (2, 3, 4)}
    assert min(grad_norms(run).values()) > 0 and losses(run)[2] != 0
    final = "final/model.safetensors"
    assert (run / final).read_bytes() == (again / final).read_bytes()

    capsys.readouterr()
    trainer = resume_from(tmp_path, "one", checkpoint, {})
    trainer.train()
    assert (
        "checkpoint-1 holds cached rollouts this run cannot reuse (2 processes there, 1 here): "
        "the next step draws fresh ones"
    ) in capsys.readouterr().out
    assert sorted(losses(tmp_path / "one")) == [2, 3, 4]
