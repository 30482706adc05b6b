"""A run's state beside its model, optimizer and schedule, collected from the parts that hold
it (as torchtitan's Stateful pieces): each part says what it saves (`state_dict()`, a dict
merged into its file's dict) and how it loads it (`load_state_dict(file's dict)`, reading its
own keys). The Checkpointer writes the collection into a checkpoint's files and hands each
part its file's dict back on restore (`Checkpointer.save_state` / `Checkpointer.restore`).

The files (checkpointer.py describes the folder): trainer_state.json (JSON values: the data
loader's position, counters, the non-finite guard, a LoRA run's records; the Checkpointer
adds `step`, and `world_size` for DCP checkpoints), rng_state.pt (generator states; read
with weights_only) and rank_state/rank-R.pt (each rank its own, written only when one of
its parts has state).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


class Stateful(Protocol):
    """torch's `state_dict` / `load_state_dict` pair: what a part saves, and loading it."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class RunState:
    """The parts of a run that have state, by the checkpoint file they go to."""

    trainer: list[Stateful]
    """trainer_state.json: JSON values only."""
    rng: list[Stateful] = field(default_factory=list)
    """rng_state.pt: tensors, ints, lists, dicts (torch.load with weights_only)."""
    rank: list[Stateful] = field(default_factory=list)
    """rank_state/rank-R.pt: this rank's own state; every rank saves and loads its file."""
    checks: list[Callable[[dict, Path], None]] = field(default_factory=list)
    """Run on trainer_state.json before anything is loaded: a checkpoint written with
    settings the run cannot take is refused before tensors are read (InputError)."""

    def collect(self) -> tuple[dict, dict, dict]:
        """(trainer_state, rng_state, rank_state) dicts: every part's state merged, in order."""
        return _merged(self.trainer), _merged(self.rng), _merged(self.rank)

    def load(self, trainer_state: dict, rng_state: dict, rank_state: dict) -> None:
        """Every part loads its keys from its file's dict, in order."""
        for parts, state in ((self.trainer, trainer_state), (self.rng, rng_state),
                             (self.rank, rank_state)):  # fmt: skip
            for part in parts:
                part.load_state_dict(state)


def _merged(parts: list[Stateful]) -> dict:
    merged: dict = {}
    for part in parts:
        state = part.state_dict()
        clash = sorted(set(state) & set(merged))
        if clash:
            raise ValueError(f"two parts of the run's state save the same keys {clash}")
        merged.update(state)
    return merged


class Under:
    """A Stateful object whose own state sits under one key of its file's dict (the data
    loader's under "loader"). required: a checkpoint without the key is damaged; otherwise
    the object loads None (checkpoints from before it was saved)."""

    def __init__(self, key: str, part, required: bool = True):
        self.key, self.part, self.required = key, part, required

    def state_dict(self) -> dict:
        return {self.key: self.part.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.part.load_state_dict(state[self.key] if self.required else state.get(self.key))
