"""A family's memory model is its shape's declaration (models/shape.py
`ModelShape.memory_model`, issue 54): `unmask plan` prices the step with the walk the shape
names (plan/memory_models.py `MEMORY_MODELS`), so a family from another package brings its own walk
with `register_memory_model` and no edit of plan/; the built-in ones keep theirs (the
decoder's, DiffusionGemma's canvas walk)."""

from dataclasses import replace

import pytest

from unmask.config import load_config
from unmask.models import DiffusionTransformer, Family, register_family, unregister_family
from unmask.models.shape import DECODER, DIFFUSION_GEMMA
from unmask.plan import canvas_memory
from unmask.plan.devices import DEVICES
from unmask.plan.memory import decoder_memory_terms
from unmask.plan.memory_models import MEMORY_MODELS, register_memory_model
from unmask.plan.planner import make_run_plan
from unmask.plan.shards import planned_model_config

TINY = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
        "model.num_attention_heads=2", "model.num_key_value_heads=1", "model.vocab_size=128",
        "data.dataset=synthetic", "data.packing_length=32",
        "train.per_device_train_batch_size=2"]  # fmt: skip


def tiny(model_type: str):
    return planned_model_config(load_config(None, [*TINY, f"model.model_type={model_type}"]))


def test_the_built_in_families_name_their_walks():
    assert DECODER.memory_model == "decoder" and DIFFUSION_GEMMA.memory_model == "canvas"
    assert MEMORY_MODELS["decoder"] is decoder_memory_terms
    assert MEMORY_MODELS["canvas"] is canvas_memory.canvas_memory_terms
    with pytest.raises(ValueError, match="memory model 'decoder' is already registered"):
        register_memory_model("decoder", decoder_memory_terms)


@pytest.fixture
def walked_family():
    """A family of the native decoder whose shape names its own walk: the decoder's terms
    with activations doubled (say, a block that keeps a second copy of its stream)."""
    calls = []

    def doubled(model, shape):
        calls.append(model.rank)
        terms = decoder_memory_terms(model, shape)
        return replace(terms, activations=2 * terms.activations,
                       peak=terms.peak + terms.activations)  # fmt: skip

    register_memory_model("doubled_stream", doubled)
    shape = replace(DECODER, name="doubled", memory_model="doubled_stream")
    register_family(Family("walked_dllm", "native", ("walked_dllm",), "WalkedForDiffusion",
                           shape=shape), DiffusionTransformer)  # fmt: skip
    yield calls
    unregister_family("walked_dllm")
    MEMORY_MODELS.pop("doubled_stream")


def test_the_planner_calls_the_walk_the_shape_names(walked_family):
    ours = make_run_plan(tiny("walked_dllm"), 2, DEVICES["h100"])
    base = make_run_plan(tiny("qwen3_dllm"), 2, DEVICES["h100"])
    assert sorted(walked_family) == [0, 1]  # once per rank
    for mine, theirs in zip(ours.ranks, base.ranks, strict=True):
        assert theirs.memory.activations > 0
        assert mine.memory.activations == 2 * theirs.memory.activations
        assert mine.memory.peak == theirs.memory.peak + theirs.memory.activations
        assert mine.memory.parameters == theirs.memory.parameters


def test_an_unregistered_walk_is_refused_naming_the_registered_ones():
    shape = replace(DECODER, name="lost", memory_model="nowhere")
    register_family(Family("lost_dllm", "native", ("lost_dllm",), "LostForDiffusion",
                           shape=shape), DiffusionTransformer)  # fmt: skip
    try:
        with pytest.raises(ValueError, match="memory model 'nowhere' of model_type 'lost_dllm' "
                                             "is not registered; registered: decoder, canvas"):  # fmt: skip
            make_run_plan(tiny("lost_dllm"), 1, DEVICES["h100"])
    finally:
        unregister_family("lost_dllm")
