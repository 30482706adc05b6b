"""One resolved model (models/build.py `resolve_model`, issue 54): the checks read the family
a pretrained folder holds, not the run section's `model_type` (which a folder does not set),
and the keep-list of run fields is one (`ResolvedModel.planned`)."""

from dataclasses import replace

import pytest
from conftest import save_tiny_model

from unmask.errors import InputError
from unmask.models import ModelConfig, resolve_model
from unmask.models.families import FAMILIES
from unmask.parallel.tensor import check_tensor_parallel
from unmask.train.setup import check_family_trains


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("qwen3") / "model")


def with_shape(monkeypatch, name: str, **changes) -> None:
    """The registry's `name` family with its shape changed, for this test."""
    family = FAMILIES[name]
    monkeypatch.setitem(FAMILIES, name, replace(family, shape=replace(family.shape, **changes)))


def test_a_folder_resolves_to_its_own_family(qwen3_folder):
    section = ModelConfig(model_type="llama_dllm", pretrained=str(qwen3_folder), lora=True,
                          lora_r=4, attn_implementation="sdpa")  # fmt: skip
    model = resolve_model(section)
    assert model.family.name == "qwen3_dllm" and model.arch.model_type == "qwen3_dllm"
    assert model.shape is FAMILIES["qwen3_dllm"].shape and not model.wrapped
    planned = model.planned()  # the folder's architecture, the section's run fields
    assert planned.pretrained is None and planned.model_type == "qwen3_dllm"
    assert (planned.lora, planned.lora_r, planned.attn_implementation) == (True, 4, "sdpa")
    assert planned.hidden_size == model.arch.hidden_size


def test_check_family_trains_reads_the_folders_family(qwen3_folder, monkeypatch):
    """The section says llama_dllm (which trains); the folder is a qwen3_dllm, here declared
    untrainable: the folder's family is refused (it used to check the section's)."""
    with_shape(monkeypatch, "qwen3_dllm", trains=False)
    section = ModelConfig(model_type="llama_dllm", pretrained=str(qwen3_folder))
    with pytest.raises(InputError, match=r"^model.model_type 'qwen3_dllm': unmask reads and "
                                         r"writes its folders"):  # fmt: skip
        check_family_trains(resolve_model(section))
    check_family_trains(resolve_model(section.model_copy(update={"pretrained": None})))


def test_tensor_parallel_on_a_folder_without_a_tensor_plan_is_one_line(qwen3_folder, monkeypatch):
    """A folder whose family declares no tensor plan, under a section whose family does: one
    line naming the folder's family (it used to pass the first check and fail with
    AttributeError on the folder's missing plan)."""
    with_shape(monkeypatch, "qwen3_dllm", tensor=None)
    section = ModelConfig(model_type="llama_dllm", pretrained=str(qwen3_folder))
    with pytest.raises(InputError) as err:
        check_tensor_parallel(resolve_model(section), 2)
    assert str(err.value).startswith("parallel.tensor_parallel=2 needs a native decoder, or a "
                                     "family that declares how its layers split")  # fmt: skip
    assert "model.model_type 'qwen3_dllm' declares no tensor-parallel plan" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_missing_folder_is_one_line(tmp_path):
    with pytest.raises(InputError, match="does not exist; set model.pretrained"):
        resolve_model(ModelConfig(pretrained=str(tmp_path / "nothing")))


def test_planned_drops_vision_lora_targets_and_lora_with_none_left(qwen3_folder):
    """The planner's text model has no vision tower (plan/vision.py counts it): vision LoRA
    targets leave the list, and a list of vision targets only plans the text model without
    LoRA (peft refuses an adapter list that matches nothing)."""

    def planned(targets):
        section = ModelConfig(pretrained=str(qwen3_folder), lora=True,
                              lora_target_modules=targets)  # fmt: skip
        return resolve_model(section).planned()

    assert (planned(["vision_tower", "q_proj"]).lora, planned(["q_proj", "embed_vision"])
            .lora_target_modules) == (True, ["q_proj"])  # fmt: skip
    assert planned(["vision_tower", "q_proj"]).lora_target_modules == ["q_proj"]
    assert not planned(["vision_tower"]).lora and not planned(["vision_tower", "embed_vision"]).lora
