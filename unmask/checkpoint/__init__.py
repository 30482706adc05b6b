"""Model and run folders on disk: checkpoints written, found, restored and exported, and
saved models (every kind unmask writes: saved.py) opened for sampling."""

from unmask.checkpoint.checkpointer import Checkpointer
from unmask.checkpoint.export import export_distributed_checkpoint, export_model
from unmask.checkpoint.layout import (
    STATE_FILE,
    is_distributed_checkpoint,
    list_checkpoints,
    resolve_model_folder,
    resolve_resume,
)
from unmask.checkpoint.open import load_for_sampling
from unmask.checkpoint.saved import gather_distributed_checkpoint, saved_kind
from unmask.checkpoint.state import RunState, Stateful, Under

__all__ = [
    "STATE_FILE",
    "Checkpointer",
    "RunState",
    "Stateful",
    "Under",
    "export_distributed_checkpoint",
    "export_model",
    "gather_distributed_checkpoint",
    "is_distributed_checkpoint",
    "list_checkpoints",
    "load_for_sampling",
    "resolve_model_folder",
    "resolve_resume",
    "saved_kind",
]
