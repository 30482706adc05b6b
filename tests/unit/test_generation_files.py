"""generation_config.json of the folders unmask writes (checkpoint/generation.py): for a
DiffusionGemma folder transformers' DiffusionGemmaGenerationConfig refuses unknown keys, so
unmask's options go to unmask_generation.json and generation_config.json keeps that class's
keys only; unmask reads both layouts the same; other families keep one file."""

import json

import pytest
import transformers
from conftest import save_tiny_diffusion_gemma, save_tiny_model

from unmask.checkpoint.generation import UNMASK_GENERATION_FILE, write_generation_files
from unmask.data.tokenizer import load_local_tokenizer
from unmask.sampling import generation_file as sampling_config
from unmask.sampling.generation_file import GENERATION_FILE, generation_config_text, saved_sampling

OPTIONS = {"decoder": "entropy_bound", "gen_length": 12, "entropy_bound": 0.5, "temperature_start": 0.9,
           "temperature_end": 0.3, "max_denoising_steps": 20, "confidence_threshold": 0.01,
           "stability_threshold": 2, "row_length": 40}  # fmt: skip


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    _, folder = save_tiny_diffusion_gemma(tmp_path_factory.mktemp("gemma") / "hf")
    return folder


def test_a_diffusion_gemma_folder_loads_in_transformers_and_unmask_reads_every_option(gemma):
    assert sampling_config.UNMASK_GENERATION_FILE == UNMASK_GENERATION_FILE  # reader = writer
    tokenizer = load_local_tokenizer(str(gemma), "model folder")
    text = generation_config_text(tokenizer, OPTIONS, complete=True)
    (gemma / GENERATION_FILE).write_text(text)  # as unmask wrote it before: refused there
    strict = transformers.DiffusionGemmaForBlockDiffusion.generation_config_class
    with pytest.raises(ValueError, match="Unexpected kwargs: .*'mask_token_id', 'unmask'"):
        strict.from_pretrained(gemma)
    old = saved_sampling(gemma)
    assert old["row_length"] == 40 and old["decoder"] == "entropy_bound" and old["uniform_canvas"]

    write_generation_files(gemma, text)
    theirs = json.loads((gemma / GENERATION_FILE).read_text())
    assert "unmask" not in theirs and "mask_token_id" not in theirs
    assert json.loads((gemma / UNMASK_GENERATION_FILE).read_text()) == json.loads(text)
    config = strict.from_pretrained(gemma)
    assert (config.max_new_tokens, config.max_denoising_steps, config.t_max, config.t_min,
            config.stability_threshold, config.confidence_threshold,
            config.sampler_config.entropy_bound) == (12, 20, 0.9, 0.3, 2, 0.01, 0.5)  # fmt: skip
    assert config.eos_token_id == tokenizer.eos_token_id
    model = transformers.DiffusionGemmaForBlockDiffusion.from_pretrained(gemma)  # the folder
    assert model.generation_config.max_denoising_steps == 20
    assert saved_sampling(gemma) == old

    (gemma / UNMASK_GENERATION_FILE).unlink()  # transformers' keys alone: still read
    alone = saved_sampling(gemma)
    assert {k: alone[k] for k in ("gen_length", "entropy_bound", "temperature_start")} == {
        "gen_length": 12,
        "entropy_bound": 0.5,
        "temperature_start": 0.9,
    }


def test_other_families_keep_one_generation_config(tmp_path):
    folder = save_tiny_model(tmp_path / "qwen3")
    tokenizer = load_local_tokenizer(str(folder), "model folder")
    text = generation_config_text(tokenizer, {"remasking": "random"}, complete=False)
    write_generation_files(folder, text)
    assert (folder / GENERATION_FILE).read_text() == text
    assert not (folder / UNMASK_GENERATION_FILE).exists()
    assert saved_sampling(folder) == {"remasking": "random"}
