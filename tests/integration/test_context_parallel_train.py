"""`unmask train` with parallel.context_parallel on gloo processes against one process.

cp=2 (2 processes) and dp_shard=2 x cp=2 (4 processes), AdamW and MuonAdamW, and tp=2 x cp=2
with MuonAdamW, 20 steps each:
the loss curve equals the one-process run of the same config (the noise of every row is
drawn whole, then sliced, so it does not depend on the cp degree). The AdamW config packs
documents (document masks across the slice boundary), accumulates 2 micro-batches,
recomputes activations in backward (gradient checkpointing: the all-to-alls run again), cuts
rows to random lengths (seed 42 cuts steps 0, 7, 8 and 10 to 27, 11, 20 and 15 tokens: odd
ones are padded to a multiple of cp) and evaluates. Every config uses
split_batches, so the global batch is the same at every world size. A MuonAdamW run under
cp=2 saves a DCP checkpoint that resumes on one process with the uninterrupted run's losses.
"""

import shutil
from pathlib import Path

import pytest
from conftest import by_step, deep_update, losses, write_run_config
from launch import train_in_ranks

from unmask.config import load_config
from unmask.train.trainer import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
BASE = {
    "model": {"num_attention_heads": 4, "num_key_value_heads": 2},
    "data": {"packing": True, "packing_length": 32},
    "train": {"split_batches": True, "max_steps": 20, "per_device_train_batch_size": 4,
              "logging_steps": 1, "eval_steps": 10, "save_steps": 0},
}  # fmt: skip
CONFIGS = {
    "adamw": {"train": {"gradient_accumulation_steps": 2, "gradient_checkpointing": True},
              "diffusion": {"random_length_prob": 0.3}},
    "muon": {"optim": {"name": "muon", "ns_dtype": "float32"}},
}  # fmt: skip
#: MuonAdamW under cp=2 saving a DCP checkpoint at step 4, resumed on one process
DCP = {"optim": {"name": "muon", "ns_dtype": "float32"},
       "train": {"context_parallel": 2, "max_steps": 8, "save_steps": 4}}  # fmt: skip
#: bad input under a real launch: refused in one line before any process group work
BAD = {"bad_heads": {"train": {"context_parallel": 2}, "model": {"num_attention_heads": 3,
                                                              "num_key_value_heads": 1,
                                                              "head_dim": 8}}}  # fmt: skip


def write_config(root: Path, name: str, extra: dict) -> Path:
    return write_run_config(root, name, BASE, extra)


def launch(nproc: int, root: Path, configs: list[Path]) -> dict:
    return train_in_ranks(nproc, root / f"results-{nproc}.json", *configs)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("cp_train")


def one_process(root: Path, name: str) -> Path:
    """The config with context_parallel 1 in this process (run once), attending through
    sdpa with the dense document mask: the multi-process runs take `auto` (varlen on CPU:
    one sdpa call per document of the gathered rows, no L x L mask)."""
    out = root / f"{name}-1"
    if not out.exists():
        dense = deep_update(CONFIGS[name], {"model": {"attn_implementation": "sdpa"}})
        cfg = load_config(write_config(root, f"{name}-1", dense))
        Trainer(cfg).train()
    return out


@pytest.fixture(scope="module")
def cp2(root):
    names = {f"{name}-cp2": deep_update(extra, {"train": {"context_parallel": 2}})
             for name, extra in CONFIGS.items()}  # fmt: skip
    paths = [write_config(root, n, e) for n, e in {**names, "dcp-cp2": DCP, **BAD}.items()]
    return launch(2, root, paths)


@pytest.fixture(scope="module")
def four(root):
    """dp_shard=2 x cp=2 for every config, and tp=2 x cp=2 for MuonAdamW."""
    names = {f"{name}-dp2cp2": deep_update(extra, {"train": {"context_parallel": 2}})
             for name, extra in CONFIGS.items()}  # fmt: skip
    layout = {"train": {"context_parallel": 2, "tensor_parallel": 2}}
    names["muon-tp2cp2"] = deep_update(CONFIGS["muon"], layout)
    return launch(4, root, [write_config(root, n, e) for n, e in names.items()])


def assert_same_curve(root: Path, name: str, run: str) -> None:
    single, split = losses(one_process(root, name)), losses(root / run)
    assert sorted(single) == sorted(split) == list(range(1, 21))
    for step in single:
        assert split[step] == pytest.approx(single[step], rel=1e-5), step


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cp2_losses_equal_one_process_for_20_steps(root, cp2, name):
    assert cp2[f"{name}-cp2"]["rc"] == 0, cp2[f"{name}-cp2"]["stderr"][-2000:]
    assert_same_curve(root, name, f"{name}-cp2")


def test_cp2_eval_loss_equals_one_process(root, cp2):
    single = by_step(one_process(root, "adamw"), "eval_loss")
    split = by_step(root / "adamw-cp2", "eval_loss")
    assert sorted(single) == sorted(split) == [10, 20]
    for step in single:
        assert split[step] == pytest.approx(single[step], rel=1e-5), step


@pytest.mark.parametrize("name", list(CONFIGS))
def test_dp_shard2_x_cp2_losses_equal_one_process_for_20_steps(root, four, name):
    run = f"{name}-dp2cp2"
    assert four[run]["rc"] == 0, four[run]["stderr"][-2000:]
    assert_same_curve(root, name, run)


def test_tp2_x_cp2_muon_losses_equal_one_process_for_20_steps(root, four):
    """Heads 4, K/V heads 2: 2 and 1 per tp rank, so cp repeats the K/V head."""
    assert four["muon-tp2cp2"]["rc"] == 0, four["muon-tp2cp2"]["stderr"][-2000:]
    assert_same_curve(root, "muon", "muon-tp2cp2")


def test_cp2_checkpoint_resumes_on_one_process_with_the_same_losses(root, cp2):
    assert cp2["dcp-cp2"]["rc"] == 0, cp2["dcp-cp2"]["stderr"][-2000:]
    out = root / "dcp-resumed-1"
    out.mkdir()
    shutil.copytree(root / "dcp-cp2" / "checkpoint-4", out / "checkpoint-4")
    cfg = load_config(write_config(root, "dcp-resumed-1", DCP))
    cfg.train = cfg.train.model_copy(update={"resume_from_checkpoint": True})
    cfg.parallel = cfg.parallel.model_copy(update={"context_parallel": 1})
    trainer = Trainer(cfg)
    assert trainer.step == 4
    trainer.train()
    resumed, uninterrupted = losses(out), losses(root / "dcp-cp2")
    assert sorted(resumed) == [5, 6, 7, 8]
    for step in resumed:
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-5), step


def test_bad_heads_refused_in_one_line_before_the_process_group(root, cp2):
    bad = cp2["bad_heads"]
    assert bad["rc"] == 2
    assert bad["stderr"].strip().splitlines() == [
        "unmask: error: parallel.context_parallel=2 does not divide model.num_attention_heads=3 "
        "(each rank attends with 1/2 of the heads); pick a divisor of 3"
    ]
    assert not (root / "bad_heads").exists()
