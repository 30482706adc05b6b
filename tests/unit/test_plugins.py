"""Plug-ins registered from outside the package (docs/architecture.md, Where to add): a toy
objective trains through the real Trainer; and the objective registry, the config's choices
and the docs name the same objectives."""

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, deep_update, read_metrics

from unmask.config import load_config, validate_tree
from unmask.diffusion import Objective, ObjectiveOutput, ObjectiveSpec, register_objective
from unmask.diffusion.registry import OBJECTIVES, objective_names
from unmask.errors import InputError
from unmask.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[2]


def toy_loss_terms(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The toy's formula: cross-entropy of every maskable token predicted from the clean row
    (no noise at all), summed; count = the maskable tokens."""
    ids, maskable = batch["input_ids"], batch["maskable"].bool()
    logits = model(ids, doc_ids=batch.get("doc_ids"), position_ids=batch.get("position_ids"))
    ce = F.cross_entropy(logits.float().flatten(0, 1), ids.flatten(), reduction="none")
    return (ce * maskable.flatten()).sum(), maskable.sum().float()


class ToyObjective(Objective):
    """An objective written outside unmask: the Objective base class gives it every hook
    the trainer calls; it records the loss of each call."""

    def __init__(self, mask_id: int):
        self.mask_id, self.calls = mask_id, []

    def __call__(self, model, batch, generator=None) -> ObjectiveOutput:
        loss_sum, count = toy_loss_terms(model, batch)
        self.calls.append(float(loss_sum.detach() / count))
        return ObjectiveOutput(loss_sum, count)


@pytest.fixture
def toy():
    """`diffusion.objective: toy`, registered as an outside package would (and removed
    after the test, so the registry lists the built-in objectives again)."""
    register_objective(ObjectiveSpec("toy", lambda context: ToyObjective(context.mask_id)))
    yield
    OBJECTIVES.pop("toy")


def test_a_toy_objective_registered_from_outside_trains(toy, tmp_path):
    tree = deep_update(TINY, {"diffusion": {"objective": "toy"},
                              "train": {"output_dir": str(tmp_path / "run"), "max_steps": 3,
                                        "eval_steps": 0, "save_steps": 0}})  # fmt: skip
    trainer = Trainer(validate_tree(tree))
    assert isinstance(trainer.objective, ToyObjective)
    # one step by hand: the trainer's loss is the toy's sum over its count
    batch = next(trainer.loader)
    with torch.no_grad():
        loss_sum, count = toy_loss_terms(trainer.model, batch)
    stats = trainer.train_step([batch])
    trainer.step += 1
    assert float(stats["loss"]) == pytest.approx(float(loss_sum / count), rel=1e-6)
    assert trainer.objective.calls == [pytest.approx(float(loss_sum / count), rel=1e-6)]
    # the rest of the run through the loop: the logged losses are the toy's, step by step,
    # and the eval loss at the end is its call on the eval rows (one batch)
    trainer.train()
    records = read_metrics(tmp_path / "run")
    logged = [r["loss"] for r in records if "loss" in r]
    calls = trainer.objective.calls
    assert len(calls) == 4 and logged == pytest.approx(calls[1:3], rel=1e-6)
    assert [r["eval_loss"] for r in records if "eval_loss" in r] == [pytest.approx(calls[3])]
    assert (tmp_path / "run" / "final").is_dir()
    assert "objective: toy" in (tmp_path / "run" / "config.yaml").read_text()


def test_a_registered_objective_gets_the_default_capabilities(toy, tmp_path):
    """What the toy did not declare it is refused, with the objectives that take it."""
    config = tmp_path / "run.yaml"
    config.write_text("diffusion:\n  objective: toy\n")
    assert load_config(config).diffusion.objective == "toy"
    with pytest.raises(InputError, match=r"needs objective mdlm, llada, bert, sft or grpo; "
                                         r"'toy' normalizes its own way"):  # fmt: skip
        load_config(config, ["diffusion.loss_normalization=token"])
    with pytest.raises(InputError, match=r"Input should be .*'preference' or 'toy' \(got 'toi'\)"):
        load_config(config, ["diffusion.objective=toi"])


def test_the_config_the_registry_and_the_docs_name_the_same_objectives():
    registered = set(objective_names())
    assert registered == {"mdlm", "llada", "bert", "ar", "sft", "dream", "bd3lm", "fastdllm_v2",
                          "uniform", "grpo", "preference", "distill"}  # fmt: skip
    # the choices docs/configuration.md lists (generated from the config's field)
    table = (REPO / "docs" / "configuration.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| `objective` |"))
    assert set(re.findall(r"`([a-z0-9_]+)`", row.split("|")[3])) == registered
    # docs/diffusion.md's table of objectives
    text = (REPO / "docs" / "diffusion.md").read_text()
    section = text.split("## Objectives (`diffusion.objective`)", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^\| `([a-z0-9_]+)` \|", section, flags=re.MULTILINE)
    assert set(documented) == registered and len(documented) == len(registered)
