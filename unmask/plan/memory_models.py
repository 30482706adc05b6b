"""Which walk prices a family's training step: `MEMORY_MODELS` by the name its shape
declares (models/shape.py `ModelShape.memory_model`), "decoder" (plan/memory.py) or
"canvas" (plan/canvas_memory.py); a family from another package registers its own
(`register_memory_model`) and names it on its shape. `memory_terms` is what the planner
calls."""

from __future__ import annotations

from collections.abc import Callable

from unmask.plan.canvas_memory import canvas_memory_terms
from unmask.plan.memory import MemoryTerms, StepShape, decoder_memory_terms
from unmask.plan.shards import ShardedModel


def memory_terms(model: ShardedModel, shape: StepShape) -> MemoryTerms:
    """Every term of this rank and the peak estimate, by the walk the model's family
    declares (models/shape.py `ModelShape.memory_model`, one of `MEMORY_MODELS`)."""
    name = model.shape.memory_model
    if name not in MEMORY_MODELS:
        raise ValueError(f"memory model {name!r} of model_type "
                         f"{model.model_config.model_type!r} is not registered; registered: "
                         f"{', '.join(MEMORY_MODELS)} (plan/memory_models.py register_memory_model)")  # fmt: skip
    return MEMORY_MODELS[name](model, shape)


MemoryModel = Callable[[ShardedModel, StepShape], MemoryTerms]
MEMORY_MODELS: dict[str, MemoryModel] = {
    "decoder": decoder_memory_terms,
    "canvas": canvas_memory_terms,
}
"""A family's memory walk by the name its shape declares (models/shape.py
`ModelShape.memory_model`): `memory_terms` calls it with this rank's shards and the step."""


def register_memory_model(name: str, walk: MemoryModel) -> None:
    """Add a memory walk (`walk(model, shape) -> MemoryTerms`) that a family's shape names
    (`ModelShape(memory_model=name)`), from another package too: a family whose step is
    neither the decoder's nor the canvas decoder's brings its own with no edit of plan/
    (ValueError when the name is taken)."""
    if name in MEMORY_MODELS:
        raise ValueError(f"memory model {name!r} is already registered")
    MEMORY_MODELS[name] = walk
