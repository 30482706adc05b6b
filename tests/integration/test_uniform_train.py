"""A tiny DiffusionGemma trained by `unmask train` with the `uniform` objective on the
synthetic quickstart tasks: its loss falls over 30 steps; 2 processes (FSDP2, the router
trained and frozen) give the losses of 1 within 1e-5; a run resumed from a checkpoint gives
the uninterrupted run's losses and weights bit for bit. With pictures (a DiffusionGemma
folder with a vision tower fine-tuned on LLaVA-style rows, data/images.py): 2 processes
give the losses of 1 within 1e-5 over 20 steps, the tower frozen and trained
(`model.freeze_vision: false`, its layers FSDP2 units; also under expert parallelism,
one expert a rank, and under tensor parallelism, the tower whole on each rank), and a run killed (SIGKILL) and resumed
gives the uninterrupted run's losses and weights bit for bit, the tower trained and its
pictures decoded in a DataLoader worker."""

import shutil

import pytest
import torch
import transformers
import yaml
from conftest import (
    TINY,
    TINY_GEMMA,
    deep_update,
    losses,
    read_metrics,
    save_vision_gemma,
    sigkill_after_steps,
    train_in_process,
    write_picture_rows,
    write_run_config,
)
from launch import train_in_ranks
from safetensors.torch import load_file

from unmask.checkpoint import export_distributed_checkpoint, is_distributed_checkpoint
from unmask.cli import main

pytestmark = pytest.mark.slow

GEMMA = TINY_GEMMA


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    """(a tiny DiffusionGemma folder with a vision tower, LLaVA-style rows of 48 pictures)."""
    root = tmp_path_factory.mktemp("uniform_pictures")
    return save_vision_gemma(root / "model"), write_picture_rows(root / "data", 48)


def picture_config(root, name: str, pictures, extra: dict):
    """root/<name>.yaml: the folder fine-tuned on the picture rows (`uniform`), in root/<name>."""
    folder, rows = pictures
    tree = deep_update(TINY, {"data": {"dataset": str(rows), "tokenizer": str(folder),
                                       "packing_length": 96, "eval_split": 4},
                              "diffusion": {"objective": "uniform"},
                              "train": {"eval_steps": 0, "save_steps": 0,
                                        "output_dir": str(root / name)}})  # fmt: skip
    tree["model"] = {"pretrained": str(folder)}
    tree = deep_update(tree, extra)
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def test_30_steps_on_the_quickstart_tasks_lower_the_loss(tmp_path):
    path = write_run_config(tmp_path, "run", GEMMA, {"train": {"max_steps": 30}})
    assert main(["train", str(path)]) == 0
    run = tmp_path / "run"
    curve = losses(run)
    assert sorted(curve) == list(range(1, 31))
    first = sum(curve[s] for s in range(1, 6)) / 5
    last = sum(curve[s] for s in range(26, 31)) / 5
    assert last < 0.85 * first, (first, last)
    final = [r for r in read_metrics(run) if "eval_loss" in r][-1]["eval_loss"]
    assert final < 0.85 * first
    assert (run / "final" / "model.safetensors").is_file()


@pytest.fixture(scope="module")
def pictures_tp(tmp_path_factory, pictures):
    """(the folder of `pictures` with 2 key/value heads in its global attention, so that
    tensor parallelism over 2 ranks splits them; the same rows)."""
    root = tmp_path_factory.mktemp("uniform_pictures_tp")
    return save_vision_gemma(root / "model", num_global_key_value_heads=2), pictures[1]


def test_two_processes_give_the_one_process_losses(tmp_path, pictures, pictures_tp):
    base = deep_update(GEMMA, {"train": {"split_batches": True, "max_steps": 5}})
    frozen = {"diffusion": {"freeze_router": True}}
    configs = {
        "trained": write_run_config(tmp_path, "trained", base, {}),
        "frozen": write_run_config(tmp_path, "frozen", base, frozen),
        # over 20 steps: a lower rate than the text runs' keeps AdamW's amplification of
        # the all-reduce's rounding below 1e-5 (1.4e-6 seen; 1.6e-5 at 3e-3)
        "pictures": picture_config(tmp_path, "pictures", pictures,
                                   {"train": {"split_batches": True, "max_steps": 20},
                                    "optim": {"learning_rate": 1e-3}}),
        # the tower and the projector trained too: each tower layer an FSDP2 unit of its own
        # (its last step also saved as a checkpoint: FSDP2's DCP shards, exported below)
        "pictures-tower": picture_config(tmp_path, "pictures-tower", pictures,
                                         {"train": {"split_batches": True, "max_steps": 20,
                                                    "save_steps": 20},
                                          "optim": {"learning_rate": 1e-3},
                                          "model": {"freeze_vision": False}}),
        # and under expert parallelism (1 of the folder's 2 experts a rank), the tower trained
        "pictures-ep2": picture_config(tmp_path, "pictures-ep2", pictures,
                                       {"train": {"split_batches": True, "max_steps": 20},
                                        "optim": {"learning_rate": 1e-3},
                                        "model": {"freeze_vision": False},
                                        "parallel": {"expert_parallel": 2}}),
        # and under tensor parallelism (attention and the dense MLP split over the 2 ranks,
        # the tower and projector whole on each), the tower trained: a folder whose global
        # attention has 2 key/value heads, one a rank
        "pictures-tp2": picture_config(tmp_path, "pictures-tp2", pictures_tp,
                                       {"train": {"split_batches": True, "max_steps": 20},
                                        "optim": {"learning_rate": 1e-3},
                                        "model": {"freeze_vision": False},
                                        "parallel": {"tensor_parallel": 2}}),
        "pictures-tp1": picture_config(tmp_path, "pictures-tp1", pictures_tp,
                                       {"train": {"split_batches": True, "max_steps": 20},
                                        "optim": {"learning_rate": 1e-3},
                                        "model": {"freeze_vision": False}}),
    }  # fmt: skip
    one_process = {"pictures-ep2": "pictures-tower",  # ep=2 and tp=2 need 2 ranks
                   "pictures-tp2": "pictures-tp1"}  # fmt: skip
    launched = [path for name, path in configs.items() if name != "pictures-tp1"]
    results = train_in_ranks(2, tmp_path / "results.json", *launched)
    singles: dict[str, dict] = {}
    for name in configs:
        if name == "pictures-tp1":  # pictures-tp2's one-process reference
            continue
        assert results[name]["rc"] == 0, results[name]["stderr"][-2000:]
        one = one_process.get(name, name)
        if one not in singles:
            singles[one] = losses(train_in_process(configs[one], tmp_path / f"{one}-1"))
        single = singles[one]
        double = losses(tmp_path / name)
        steps = 20 if name.startswith("pictures") else 5
        assert sorted(single) == sorted(double) == list(range(1, steps + 1))
        for step in single:
            assert double[step] == pytest.approx(single[step], abs=1e-5), (name, step)
    # `unmask export` of the 2 ranks' DCP checkpoint: one folder with the gathered weights
    # (the run's final/, written at the same step, holds the same), the tower's among them,
    # and the image processor, which transformers loads as a DiffusionGemma with pictures
    checkpoint = tmp_path / "pictures-tower" / "checkpoint-20"
    assert is_distributed_checkpoint(checkpoint)
    assert main(["export", str(checkpoint), "--out", str(tmp_path / "exported")]) == 0
    exported = tmp_path / "exported"
    source = pictures[0] / "preprocessor_config.json"
    assert (exported / "preprocessor_config.json").read_text() == source.read_text()
    final = load_file(tmp_path / "pictures-tower" / "final" / "model.safetensors")
    got = load_file(exported / "model.safetensors")
    assert sorted(got) == sorted(final)
    assert any(".vision_tower." in key for key in got)
    for key, value in final.items():
        assert torch.equal(got[key], value), key
    model = transformers.DiffusionGemmaForBlockDiffusion.from_pretrained(str(exported))
    state = model.state_dict()
    for key, value in final.items():
        assert torch.equal(state[key], value), key
    assert transformers.AutoImageProcessor.from_pretrained(str(exported)) is not None
    # the Python API's gather of the same checkpoint keeps the image processor too
    gathered = export_distributed_checkpoint(checkpoint, tmp_path / "gathered")
    assert (gathered / "preprocessor_config.json").read_text() == source.read_text()
    assert load_file(gathered / "model.safetensors").keys() == final.keys()


def test_a_resumed_run_gives_the_same_losses_bit_for_bit(tmp_path):
    full = write_run_config(tmp_path, "full", GEMMA, {"train": {"max_steps": 8, "save_steps": 4}})
    assert main(["train", str(full)]) == 0
    stopped = tmp_path / "stopped"  # a run killed after step 4: only checkpoint-4 on disk
    stopped.mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-4", stopped / "checkpoint-4")
    resume = {"train": {"max_steps": 8, "save_steps": 4, "resume_from_checkpoint": True}}
    assert main(["train", str(write_run_config(tmp_path, "stopped", GEMMA, resume))]) == 0
    before, after = losses(tmp_path / "full"), losses(stopped)
    assert sorted(after) == [5, 6, 7, 8]
    for step in after:
        assert after[step] == before[step], step  # exactly, on CPU
    weights = [(run / "final" / "model.safetensors").read_bytes()
               for run in (tmp_path / "full", stopped)]  # fmt: skip
    assert weights[0] == weights[1]


def test_sigkill_and_resume_with_pictures_is_bit_equal(tmp_path, pictures):
    from unmask.cli import main

    # the tower and the projector train too (model.freeze_vision: false): their weights and
    # optimizer state are in the checkpoint the run resumes from
    extra = {"model": {"freeze_vision": False},
             "train": {"max_steps": 8, "save_steps": 2, "save_total_limit": 1,
                       "per_device_train_batch_size": 4, "dataloader_num_workers": 1}}  # fmt: skip
    unsaved = deep_update(extra, {"train": {"save_steps": 0}})
    assert main(["train", str(picture_config(tmp_path, "ref", pictures, unsaved))]) == 0
    cfg = picture_config(tmp_path, "run", pictures, extra)
    run = tmp_path / "run"
    sigkill_after_steps(cfg, run, 3, timeout=120)
    assert main(["train", str(cfg), "train.resume_from_checkpoint=true"]) == 0
    ref = load_file(str(tmp_path / "ref" / "final" / "model.safetensors"))
    resumed = load_file(str(run / "final" / "model.safetensors"))
    assert ref.keys() == resumed.keys() and all(torch.equal(ref[k], resumed[k]) for k in ref)
    start = load_file(str(pictures[0] / "model.safetensors"))
    tower = [k for k in ref if k.startswith("model.encoder.vision_tower.")]
    assert tower and any(not torch.equal(ref[k], start[k]) for k in tower)  # it trained
    assert losses(run) == losses(tmp_path / "ref")
    assert sorted(losses(run)) == list(range(1, 9))
    # final/ keeps the folder's image processor: it takes pictures as the folder does
    processor = (pictures[0] / "preprocessor_config.json").read_text()
    assert (run / "final" / "preprocessor_config.json").read_text() == processor


@pytest.mark.parametrize("self_conditioning", [0.0, 0.5])
def test_the_mfu_flop_count_of_a_uniform_step_equals_flop_counter_mode(tmp_path, self_conditioning):
    """The family's own count (models/shape.py DiffusionGemmaShape.call_flops: the encoder
    over the prompt, the decoder over the canvas, the whole-vocabulary head, the
    self-conditioning pass) against torch's FlopCounterMode over one step (AdamW: no
    matmuls in the optimizer; sdpa's math kernel, whose matmuls the counter sees; the
    experts one matmul each: the counter has no formula for grouped GEMMs)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from unmask.config import load_config
    from unmask.train.trainer import Trainer

    extra = {"optim": {"name": "adamw"},
             "model": {"attn_implementation": "sdpa", "moe_implementation": "loop"},
             "diffusion": {"self_conditioning_prob": self_conditioning}}  # fmt: skip
    trainer = Trainer(load_config(write_run_config(tmp_path, "run", GEMMA, extra)))
    trainer.train_step([next(trainer.loader)])
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        stats = trainer.train_step([next(trainer.loader)])
    counted = counter.get_total_flops()
    assert counted > 0
    assert float(stats["flops"]) == pytest.approx(counted, rel=0.02)
