"""The Trainer's parts (step.py `TrainStep`, evaluation.py `Evaluation`, state.py
`CheckpointedState`) declare every Trainer attribute they read, as class annotations: a
reader of one part sees what it depends on, and a new read that is not declared fails
here. A built Trainer that has run sets every declared attribute."""

import ast
import inspect
import typing
from pathlib import Path

import pytest
from conftest import TINY, deep_update

from unmask.config import validate_tree
from unmask.train.evaluation import Evaluation
from unmask.train.state import CheckpointedState
from unmask.train.step import TrainStep
from unmask.train.trainer import Trainer

PARTS = (TrainStep, Evaluation, CheckpointedState)


def self_reads(cls: type) -> set[str]:
    """The attributes `self.NAME` the class body's methods read."""
    tree = ast.parse(inspect.getsource(cls))
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "self" and isinstance(node.ctx, ast.Load)}  # fmt: skip


def declared(cls: type) -> set[str]:
    return set(cls.__dict__.get("__annotations__", {}))


@pytest.mark.parametrize("part", PARTS, ids=lambda c: c.__name__)
def test_each_part_reads_only_what_it_declares(part):
    own = {name for name, value in vars(part).items() if callable(value) or
           isinstance(value, (property, staticmethod, classmethod))}  # fmt: skip
    undeclared = self_reads(part) - own - declared(part)
    assert undeclared == set(), f"{part.__name__} reads undeclared attributes {undeclared}"
    assert declared(part), part.__name__


def test_a_trainer_sets_every_declared_attribute(tmp_path):
    tree = deep_update(TINY, {"train": {"output_dir": str(tmp_path / "run"), "max_steps": 1,
                                        "eval_steps": 0, "save_steps": 0}})  # fmt: skip
    trainer = Trainer(validate_tree(tree))
    trainer.train()
    for part in PARTS:
        missing = [name for name in declared(part) if not hasattr(trainer, name)]
        assert missing == [], f"{part.__name__} declares {missing}, which the Trainer does not set"
    # the declared types name real things (resolvable in the module's namespace)
    for part in PARTS:
        hints = typing.get_type_hints(part, localns=_type_namespace())
        assert set(hints) >= declared(part)


def _type_namespace() -> dict:
    import torch
    from transformers import PreTrainedTokenizerBase

    from unmask.checkpoint import Checkpointer
    from unmask.config import RunConfig
    from unmask.data import RowStore
    from unmask.diffusion import Objective
    from unmask.parallel.context import ContextShard
    from unmask.parallel.distributed import DistState
    from unmask.parallel.pipeline import PipelineRunner
    from unmask.train.guard import NonFiniteGuard
    from unmask.train.metrics import MetricsLogger
    from unmask.train.mfu import CallFlops, DeviceTimer
    from unmask.train.qk_clip import QKClip
    from unmask.train.signals import StopSignals

    return {"torch": torch, "Path": Path, **{c.__name__: c for c in (
        PreTrainedTokenizerBase, Checkpointer, RunConfig, RowStore, ContextShard, DistState,
        PipelineRunner, Objective, NonFiniteGuard, MetricsLogger, CallFlops, DeviceTimer, StopSignals,
        QKClip)}}  # fmt: skip
