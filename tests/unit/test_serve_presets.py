"""What the playground offers per model (serve/presets.py) and the runs view's metric
names (serve/runs_view.py metric_label): every preset offered validates for the model, the
options hidden for a decoder are ones it refuses, labels read as words."""

import pytest

from unmask.errors import InputError
from unmask.sampling.config import SamplingConfig, resolve_sampling
from unmask.serve.presets import playground, refused_options
from unmask.serve.protocol import sampling_options
from unmask.serve.runs_view import metric_label

OPTIONS = sampling_options({})
NAMES = [option["name"] for option in OPTIONS]


def offered(saved: dict, family: str, uniform: bool = False) -> list[str]:
    return [p["name"] for p in playground(saved, family, uniform, NAMES)["presets"]]


def test_presets_follow_the_family_and_the_decoder():
    masked = ["", "llada", "dream", "fastdllm", "mdlm", "random"]
    assert offered({}, "qwen3_dllm") == masked
    assert offered({}, "llada2_moe") == ["", "speedy", "quality", *masked[1:]]
    assert offered({}, "diffusion_gemma", uniform=True) == ["", "entropy_bound",
                                                            "entropy_bound_careful"]  # fmt: skip
    # a folder that decodes with joint_threshold: its presets too (each preset names its
    # decoder: a masked one runs the masked decoder there)
    joint = {"decoder": "joint_threshold"}
    assert offered(joint, "qwen3_dllm") == ["", "speedy", "quality", *masked[1:]]
    info = playground({}, "diffusion_gemma", True, NAMES)
    assert (info["decoder"], info["decoders"]) == ("entropy_bound", ["entropy_bound"])
    assert info["top_row"]["entropy_bound"] == ["max_tokens", "max_denoising_steps",
                                                "temperature_start", "temperature_end"]  # fmt: skip
    assert "temperature" not in info["accepted"]["entropy_bound"]


@pytest.mark.parametrize("family,uniform", [("qwen3_dllm", False), ("llada2_moe", False),
                                            ("diffusion_gemma", True)])  # fmt: skip
def test_every_preset_offered_is_a_config_the_model_takes(family, uniform):
    for preset in playground({}, family, uniform, NAMES)["presets"]:
        options = {**preset["options"], **({"uniform_canvas": True} if uniform else {})}
        resolve_sampling(options, strict=True)  # raises when refused


def probe(option: dict):
    """A value of the option other than its default."""
    if option["kind"] == "choice":
        return next(c for c in option["choices"] if c != option["value"])
    if option["kind"] == "bool":
        return not option["value"]
    if option["kind"] == "float":
        return 0.5 if option["value"] in (None, 0.5) else option["value"] + 0.25
    return 3 if option["value"] in (None, 3) else option["value"] + 1


@pytest.mark.parametrize("decoder", ["entropy_bound", "joint_threshold", "masked"])
def test_each_option_hidden_for_a_decoder_is_one_it_refuses(decoder):
    base = {"decoder": decoder, "gen_length": 16}
    if decoder == "entropy_bound":
        base["uniform_canvas"] = True
    for option in OPTIONS:
        name = "gen_length" if option["name"] == "max_tokens" else option["name"]
        if option["name"] not in refused_options(decoder):
            continue
        with pytest.raises((InputError, ValueError), match=name):
            SamplingConfig.model_validate({**base, name: probe(option)})


def test_metric_labels_are_words():
    assert metric_label("tokens_seen") == "tokens seen"
    assert metric_label("mfu_model_only") == "MFU (model only)"
    assert metric_label("save_stall_seconds") == "checkpoint save stall (s)"
    assert metric_label("data_wait_seconds") == "data wait (s)"
    assert metric_label("moe_load_max_over_mean/layer_3") == "expert load (max / mean) (layer_3)"
    assert metric_label("samples_per_second") == "samples/s"
