"""`unmask train` on 2 and 4 gloo processes against the one-process run of the same config.

All multi-process runs of this module happen in two torchrun launches (2 and 4 processes,
dist_workers/train_worker.py); the one-process references run here. Every config uses
split_batches, so the global batch (8 rows) is the same at every world size.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import deep_update, losses, train_in_process, write_run_config
from launch import train_in_ranks
from safetensors.torch import load_file

from unmask.checkpoint import (
    export_distributed_checkpoint,
    is_distributed_checkpoint,
    list_checkpoints,
)
from unmask.config import load_config
from unmask.train.trainer import Trainer

pytestmark = pytest.mark.slow
BASE = {
    "train": {"split_batches": True, "eval_steps": 0, "save_steps": 0, "logging_steps": 1},
}
MUON = {"optim": {"name": "muon", "ns_dtype": "float32"}, "train": {"max_steps": 5}}


def write_config(root: Path, name: str, extra: dict) -> Path:
    return write_run_config(root, name, BASE, extra)


def launch(nproc: int, root: Path, configs: list[Path]) -> dict:
    return train_in_ranks(nproc, root / f"results-{nproc}.json", *configs)


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "final" / "model.safetensors"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    cfg = {
        # 2 micro-batches per step: gradients are reduced only after the last one
        "adamw": write_config(
            root,
            "adamw",
            {
                "train": {
                    "max_steps": 20,
                    "per_device_train_batch_size": 4,
                    "gradient_accumulation_steps": 2,
                }
            },
        ),
        "muon": write_config(root, "muon", MUON),
        "replicated": write_config(
            root, "replicated", deep_update(MUON, {"train": {"fsdp2": False}})
        ),
        # MuonAdamW: its sharded momentum goes through DCP too
        "dcp": write_config(
            root, "dcp", deep_update(MUON, {"train": {"max_steps": 8, "save_steps": 4}})
        ),
        "bad_split": write_config(root, "bad_split", {"train": {"per_device_train_batch_size": 5}}),
        "bad_mesh": write_config(root, "bad_mesh", {"train": {"dp_replicate": 2, "dp_shard": 2}}),
        "muon4": write_config(
            root,
            "muon4",
            deep_update(
                MUON, {"train": {"reshard_after_forward": False, "gradient_checkpointing": True}}
            ),
        ),
        "hsdp": write_config(root, "hsdp", deep_update(MUON, {"train": {"dp_replicate": 2}})),
    }
    names = ("adamw", "muon", "replicated", "dcp", "bad_split", "bad_mesh")
    two = launch(2, root, [cfg[k] for k in names])
    # resume the 2-process run's checkpoint-4 at 4 processes (here) and at 1 (in the test)
    for name in ("resume4", "resume1"):
        (root / name).mkdir()
        shutil.copytree(root / "dcp" / "checkpoint-4", root / name / "checkpoint-4")
        resume = {"max_steps": 8, "save_steps": 4, "resume_from_checkpoint": True}
        cfg[name] = write_config(root, name, deep_update(MUON, {"train": resume}))
    four = launch(4, root, [cfg[k] for k in ("muon4", "hsdp", "resume4")])
    return {"root": root, "cfg": cfg, "results": {**two, **four}}


def one_process(runs, name: str, **train) -> Path:
    """The same config in this process (world size 1), written to <name>-1 (run once)."""
    return train_in_process(runs["cfg"][name], runs["root"] / f"{name}-1", **train)


def test_runs_succeeded(runs):
    for name in ("adamw", "muon", "replicated", "dcp", "muon4", "hsdp", "resume4"):
        assert runs["results"][name]["rc"] == 0, runs["results"][name]["stderr"][-2000:]


def test_adamw_loss_curve_matches_one_process_for_20_steps(runs):
    single = losses(one_process(runs, "adamw"))
    double = losses(runs["root"] / "adamw")
    assert sorted(single) == sorted(double) == list(range(1, 21))
    for step in single:
        assert double[step] == pytest.approx(single[step], abs=1e-5), step


@pytest.mark.parametrize("name", ["muon", "replicated", "muon4", "hsdp"])
def test_muon_parameters_after_5_steps_match_one_process(runs, name):
    # gradients are summed in another order on several ranks, so equal up to rounding;
    # the optimizer itself is bitwise exact (test_distributed_muon.py)
    single = final_weights(one_process(runs, "muon"))
    sharded = final_weights(runs["root"] / name)
    assert set(single) == set(sharded)
    for key, value in single.items():
        rel = ((sharded[key] - value).norm() / value.norm()).item()
        assert rel <= 1e-6, (key, rel)


def test_dcp_checkpoint_is_sharded_and_resumes_at_1_and_4_processes(runs):
    root = runs["root"]
    ckpt = root / "dcp" / "checkpoint-4"
    assert is_distributed_checkpoint(ckpt)
    assert len(list((ckpt / "dcp").glob("*.distcp"))) == 2  # one shard file per rank
    assert json.loads((ckpt / "trainer_state.json").read_text())["world_size"] == 2
    full = losses(root / "dcp")
    resumed4 = losses(root / "resume4")
    trainer = Trainer(load_config(runs["cfg"]["resume1"]))
    assert trainer.step == 4
    trainer.train()
    resumed1 = losses(root / "resume1")
    assert sorted(resumed4) == sorted(resumed1) == [5, 6, 7, 8]
    for step in (5, 6, 7, 8):
        assert resumed4[step] == pytest.approx(full[step], abs=1e-5), step
        assert resumed1[step] == pytest.approx(full[step], abs=1e-5), step


def test_export_gathers_a_dcp_checkpoint_into_one_hf_folder(runs, tmp_path):
    from unmask.models import from_pretrained

    root = runs["root"]
    out = export_distributed_checkpoint(root / "dcp" / "checkpoint-8", tmp_path / "export")
    model = from_pretrained(out)
    final = final_weights(root / "dcp")  # gathered by the run itself at the end
    for key, value in model.state_dict().items():
        assert torch.equal(value, final[key]), key
    assert (out / "tokenizer.json").is_file()
    assert [p.name for p in list_checkpoints(root / "dcp")] == ["checkpoint-4", "checkpoint-8"]


def test_bad_split_batches_and_mesh_fail_at_start_with_one_line(runs):
    split = runs["results"]["bad_split"]
    assert split["rc"] == 2
    assert split["stderr"].strip().splitlines() == [
        "unmask: error: train.split_batches: per_device_train_batch_size=5 does not divide "
        "by the world size 2; use a multiple of 2 or split_batches=false"
    ]
    mesh = runs["results"]["bad_mesh"]
    assert mesh["rc"] == 2
    assert mesh["stderr"].strip().splitlines() == [
        "unmask: error: mesh parallel.dp_replicate=2 x parallel.dp_shard=2 = 4 processes does not "
        "match the world size 2; make their product the number of processes (dp_shard: -1 "
        "fills it in)"
    ]
    assert not (runs["root"] / "bad_split").exists()
