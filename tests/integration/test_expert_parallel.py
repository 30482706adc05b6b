"""Expert parallelism on 2 and 4 gloo processes against the one-process run of the same
config: ep=2 (2 processes: all four pairs of router (softmax / aux loss, sigmoid / expert
bias) and optimizer (AdamW, MuonAdamW)) and dp x cp = 4 with ep=2 (4 processes: two replicas
of each expert; AdamW with the softmax router, MuonAdamW with the sigmoid one); a DCP
checkpoint of the 4-process run resumed on 1 process and under ep=4. Two torchrun launches in
all (dist_workers/moe_worker.py)."""

import json
from pathlib import Path

import pytest
import torch
from conftest import deep_update, losses, train_in_process, write_run_config
from launch import WORKERS, torchrun
from safetensors.torch import load_file

from unmask.checkpoint import is_distributed_checkpoint

pytestmark = pytest.mark.slow
BASE = {"train": {"split_batches": True, "eval_steps": 0, "save_steps": 0, "logging_steps": 1,
                  "max_steps": 20}}  # fmt: skip
SOFTMAX = {"model": {"model_type": "qwen3_moe_dllm", "num_experts": 4, "num_experts_per_tok": 2,
                     "moe_intermediate_size": 16, "router_aux_loss_coef": 0.01,
                     "router_z_loss_coef": 0.001}}  # fmt: skip
SIGMOID = {"model": {"model_type": "llada2_moe", "num_experts": 4, "num_experts_per_tok": 2,
                     "moe_intermediate_size": 16, "n_group": 2, "topk_group": 1,
                     "num_shared_experts": 1, "first_k_dense_replace": 1,
                     "expert_bias_update_rate": 0.01},
           "optim": {"name": "muon", "ns_dtype": "float32"}}  # fmt: skip
CONFIGS = {  # name: (processes, extra)
    "ep2_adamw_softmax": (2, deep_update(SOFTMAX, {"train": {"expert_parallel": 2}})),
    "ep2_muon_sigmoid": (2, deep_update(SIGMOID, {"train": {"expert_parallel": 2}})),
    # the other two router x optimizer pairs, in the same 2-process launch
    "ep2_adamw_sigmoid": (2, deep_update(SIGMOID, {"optim": {"name": "adamw"},
                                                    "train": {"expert_parallel": 2}})),
    "ep2_muon_softmax": (2, deep_update(SOFTMAX, {"optim": {"name": "muon",
                                                            "ns_dtype": "float32"},
                                                   "train": {"expert_parallel": 2}})),
    "bad_ep4": (2, deep_update(SOFTMAX, {"train": {"expert_parallel": 4}})),
    "dp4_ep2_adamw_softmax": (4, deep_update(SOFTMAX, {"train": {"expert_parallel": 2}})),
    "dp4_ep2_muon_sigmoid": (4, deep_update(SIGMOID, {"train": {"expert_parallel": 2,
                                                                 "save_steps": 10}})),
}  # fmt: skip


def _launch(nproc: int, root: Path, names: list[str]) -> dict:
    out = root / f"results-{nproc}-{names[0]}"
    out.mkdir()
    torchrun(nproc, WORKERS / "moe_worker.py", out, *[root / f"{n}.yaml" for n in names])
    return {r: json.loads((out / f"rank-{r}.json").read_text()) for r in range(nproc)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    # the 4-process run's checkpoint-10 resumed under ep=4 (same launch, after it) and on
    # one process (in a test)
    checkpoint = str(root / "dp4_ep2_muon_sigmoid" / "checkpoint-10")
    resume = deep_update(SIGMOID, {"train": {"expert_parallel": 4,
                                             "resume_from_checkpoint": checkpoint}})  # fmt: skip
    configs = {**CONFIGS, "resume_ep4": (4, resume), "resume_one": (1, resume)}
    for name, (_, extra) in configs.items():
        write_run_config(root, name, BASE, extra)
    two = _launch(2, root, [n for n, (p, _) in configs.items() if p == 2])
    four = _launch(4, root, [n for n, (p, _) in configs.items() if p == 4])
    ranks = {r: {**two.get(r, {}), **four[r]} for r in range(4)}
    return {"root": root, "ranks": ranks}


def one_process(runs, name: str) -> Path:
    root = runs["root"]
    return train_in_process(root / f"{name}.yaml", root / f"{name}-1", expert_parallel=1)


@pytest.mark.parametrize("name", [n for n in CONFIGS if not n.startswith("bad")])
def test_losses_and_biases_equal_one_process_for_20_steps(runs, name):
    result = runs["ranks"][0][name]
    assert result["rc"] == 0, result["stderr"][-3000:]
    single = losses(one_process(runs, name))
    sharded = losses(runs["root"] / name)
    assert sorted(single) == sorted(sharded) == list(range(1, 21))
    for step in single:
        assert sharded[step] == pytest.approx(single[step], rel=1e-5), step
    nproc = CONFIGS[name][0]
    biases = [runs["ranks"][r][name]["biases"] for r in range(nproc)]
    assert all(b == biases[0] for b in biases)  # every rank holds the same bias
    reference = load_file(runs["root"] / f"{name}-1" / "final" / "model.safetensors")
    final = load_file(runs["root"] / name / "final" / "model.safetensors")
    if "sigmoid" in name:
        bias = torch.tensor(biases[0][0])
        assert bias.abs().sum() > 0  # it moved
        assert torch.equal(bias, reference["model.layers.1.mlp.gate.expert_bias"])
    for key, value in reference.items():  # the gathered experts are the 1-process ones
        assert ((final[key] - value).norm() / value.norm().clamp(min=1e-12)).item() <= 1e-4, key


def test_dcp_checkpoint_resumes_on_one_process_and_under_ep4(runs):
    root = runs["root"]
    ckpt = root / "dp4_ep2_muon_sigmoid" / "checkpoint-10"
    assert is_distributed_checkpoint(ckpt)
    full = losses(root / "dp4_ep2_muon_sigmoid")
    result = runs["ranks"][0]["resume_ep4"]
    assert result["rc"] == 0, result["stderr"][-3000:]
    one = train_in_process(root / "resume_one.yaml", root / "resume_one", expert_parallel=1)
    for resumed in (losses(root / "resume_ep4"), losses(one)):
        assert sorted(resumed) == list(range(11, 21))
        for step in resumed:
            assert resumed[step] == pytest.approx(full[step], rel=1e-5), step


def test_bad_expert_parallel_fails_at_start_with_one_line(runs):
    bad = runs["ranks"][0]["bad_ep4"]
    assert bad["rc"] == 2
    assert bad["stderr"].strip().splitlines() == [
        "unmask: error: parallel.expert_parallel=4 does not divide the data-parallel x context "
        "ranks (2); launch a multiple of 4 of them, or override parallel.expert_parallel=2 "
        "(it divides the 4 experts and the 2 ranks)"
    ]
    assert not (runs["root"] / "bad_ep4").exists()
