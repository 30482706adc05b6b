"""`unmask train` with tensor parallelism on 4 gloo processes against the one-process run.

One torchrun launch (dist_workers/train_worker.py) runs every multi-process config in order:
tp=4 and dp_shard=2 x tp=2 (with full and selective activation checkpointing), and dp_shard=2 x
tp=2 with sequence parallelism, with AdamW and with MuonAdamW (20 steps), then a MuonAdamW run
under dp_shard=2 x tp=2 that saves a DCP checkpoint at step 4, and two runs that resume it
under tp=4 and under dp_shard=4. The one-process references run here. The tiny model has 4
query and 4 key/value heads so that tp=4 splits them; every config uses split_batches, so
the global batch (8 rows) is the same in every layout.
"""

import json
from pathlib import Path

import pytest
from conftest import deep_update, losses, train_in_process, write_run_config
from launch import WORKERS, torchrun, train_in_ranks

from unmask.config import load_config
from unmask.train.trainer import Trainer

pytestmark = pytest.mark.slow
BASE = {
    "model": {"num_attention_heads": 4, "num_key_value_heads": 4},
    "train": {"split_batches": True, "eval_steps": 0, "save_steps": 0, "logging_steps": 1,
              "max_steps": 20},
}  # fmt: skip
MUON = {"optim": {"name": "muon", "ns_dtype": "float32"}}
DCP = deep_update(MUON, {"train": {"max_steps": 8, "save_steps": 4}})
#: each layout also checkpoints activations (full, selective): TP, then checkpointing, then
#: FSDP2, as the trainer composes them
LAYOUTS = {
    "tp4": {"tensor_parallel": 4, "activation_checkpointing": "full"},
    "dp2tp2": {"tensor_parallel": 2, "dp_shard": 2, "activation_checkpointing": "selective"},
    # sequence parallelism under FSDP2: norm weights' gradients are partial over tp
    "dp2tp2sp": {"tensor_parallel": 2, "dp_shard": 2, "sequence_parallel": True},
}


def write_config(root: Path, name: str, extra: dict) -> Path:
    return write_run_config(root, name, BASE, extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    cfg = {}
    for layout, train in LAYOUTS.items():
        cfg[f"adamw-{layout}"] = write_config(root, f"adamw-{layout}", {"train": train})
        cfg[f"muon-{layout}"] = write_config(root, f"muon-{layout}",
                                             deep_update(MUON, {"train": train}))  # fmt: skip
    dp2tp2 = {"tensor_parallel": 2, "dp_shard": 2}
    cfg["dcp"] = write_config(root, "dcp", deep_update(DCP, {"train": dp2tp2}))
    saved = str(root / "dcp" / "checkpoint-4")
    for name, train in (("resume-tp4", {"tensor_parallel": 4}), ("resume-dp4", {})):
        train = {**train, "resume_from_checkpoint": saved}
        cfg[name] = write_config(root, name, deep_update(DCP, {"train": train}))
    results = train_in_ranks(4, root / "results.json", *cfg.values(), timeout=600)
    return {"root": root, "cfg": cfg, "results": results}


def one_process(runs, name: str, source: str, **train) -> Path:
    """Config `source` run in this process (world size 1, tp=1), written to <name>-1."""
    return train_in_process(runs["cfg"][source], runs["root"] / f"{name}-1", tensor_parallel=1,
                            sequence_parallel=False, dp_shard=-1, **train)  # fmt: skip


def test_runs_succeeded(runs):
    for name, result in runs["results"].items():
        assert result["rc"] == 0, (name, result["stderr"][-2000:])


@pytest.mark.parametrize("optim", ["adamw", "muon"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_losses_match_one_process_for_20_steps(runs, optim, layout):
    single = losses(one_process(runs, optim, f"{optim}-{layout}"))
    split = losses(runs["root"] / f"{optim}-{layout}")
    assert sorted(single) == sorted(split) == list(range(1, 21))
    for step in single:
        assert split[step] == pytest.approx(single[step], rel=1e-5), step


def test_dcp_checkpoint_saved_under_dp2_tp2_resumes_under_tp4_dp4_and_one_process(runs):
    root = runs["root"]
    ckpt = root / "dcp" / "checkpoint-4"
    assert json.loads((ckpt / "trainer_state.json").read_text())["world_size"] == 4
    uninterrupted = losses(one_process(runs, "dcp-full", "dcp", save_steps=0))
    resumed = {"tp4": losses(root / "resume-tp4"), "dp4": losses(root / "resume-dp4")}
    out = root / "resume-1"
    cfg = load_config(runs["cfg"]["resume-dp4"])
    cfg.train = cfg.train.model_copy(update={"output_dir": str(out)})
    cfg.parallel = cfg.parallel.model_copy(update={"dp_shard": -1})
    trainer = Trainer(cfg)
    assert trainer.step == 4
    trainer.train()
    resumed["one process"] = losses(out)
    for layout, got in resumed.items():
        assert sorted(got) == [5, 6, 7, 8], layout
        for step in got:
            assert got[step] == pytest.approx(uninterrupted[step], rel=1e-5), (layout, step)


def test_families_and_muon_step_under_tp_equal_one_process(tmp_path):
    """Every native family's forward and backward split tp=4 equals the unsplit model's. Two MuonAdamW steps with the same full gradients on a decoder split tp4, dp_shard2 x
    tp2 and dp_replicate2 x tp2 (dist_workers/tp_muon_worker.py) give the one-process
    parameters bit for bit, and Newton-Schulz runs once per Muon matrix per step."""
    out = tmp_path / "muon.json"
    torchrun(4, WORKERS / "tp_muon_worker.py", out, "families", "tp4", "dp2xtp2", "rep2xtp2",
             timeout=300)  # fmt: skip
    results = json.loads(out.read_text())
    # every native family split tp=4 (q/k norms, q/k/v biases, packed rows' document masks)
    # gives the unsplit model's losses and gradients within float32 rounding
    families = results.pop("families")
    assert sorted(families) == ["dream", "llada", "llama_dllm", "qwen2_dllm", "qwen3_dllm"]
    for family, rel in families.items():
        assert rel < 1e-5, (family, rel)
    assert sorted(results) == ["dp2xtp2", "rep2xtp2", "tp4"]
    for layout, result in results.items():
        assert result["bitwise"], (layout, result["max_abs_diff"])
        assert result["ns_matrices"] == result["muon_matrices"] == 14, layout


def test_muon_under_tp_sends_each_block_once_to_its_owner(tmp_path):
    """Muon under tp=2, tp=4 and dp_shard=2 x tp=2 (dist_workers/tp_muon_worker.py
    "paths-"): the owner all-to-all of every rank's own block gives the parameters of the
    previous path (DTensor's redistribute of each split matrix into rows first) bit for bit,
    and those of one process (float32 NS), after two steps of MuonAdamW on a decoder whose
    embeddings, head, norms and biases take AdamW. Bytes sent to other ranks in a step,
    summed over the ranks and counted from the collectives' own tensors, equal the plan's
    formula, (W - 1) / W of the Muon matrices' bytes in the NS dtype, once to the owners
    and once back; the previous path all-gathered whole matrices on top."""
    outputs = [tmp_path / "2.json", tmp_path / "4.json"]
    torchrun(2, WORKERS / "tp_muon_worker.py", outputs[0], "paths-tp2", "paths-tp2:bfloat16",
             timeout=300)  # fmt: skip
    torchrun(4, WORKERS / "tp_muon_worker.py", outputs[1], "paths-tp4", "paths-dp2xtp2",
             timeout=300)  # fmt: skip
    results = {k: v for out in outputs for k, v in json.loads(out.read_text()).items()}
    assert sorted(results) == ["paths-dp2xtp2", "paths-tp2", "paths-tp2:bfloat16", "paths-tp4"]
    for spec, result in results.items():
        world, size, new, old = (result[k] for k in ("world", "matrices_bytes", "new", "old"))
        itemsize = 2 if spec.endswith("bfloat16") else 4
        assert size == 2 * (4 * 32 * 32 + 3 * 64 * 32) * itemsize, spec  # 2 layers' 7 matrices
        assert result["equal"], spec
        assert result["bitwise"] or itemsize == 2, spec
        assert new["ns_matrices"] == old["ns_matrices"] == result["muon_matrices"] == 14, spec
        # the default path: one owner all-to-all each way (all 14 matrices share a mesh),
        # each block once out and once back, nothing else
        assert list(new["kinds"]) == ["alltoall_base"], (spec, new["kinds"])
        assert new["kinds"]["alltoall_base"][0] == 2, (spec, new["kinds"])
        assert new["gathers"] == 0, spec
        assert new["out"] == new["back"] == result["formula"]["out"], spec
        assert result["formula"]["back"] == (world - 1) * size // world, spec
        assert new["out"] <= 1.1 * (world - 1) / world * size, spec
        # the previous path sent the same all-to-alls and all-gathered whole matrices
        assert old["out"] == new["out"] and old["back"] == new["back"], spec
        assert old["total"] >= 3 * new["total"], (spec, old, new)
