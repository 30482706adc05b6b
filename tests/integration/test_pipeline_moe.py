"""Pipeline parallelism of mixture-of-experts models on 2 and 4 gloo processes against the
one-process run of the same config (dist_workers/moe_worker.py, two torchrun launches).

On 2 processes pp=2 with gpipe, 1f1b, interleaved 1F1B and interleaved zero bubble (2
stages per rank), on 4 dp_shard=2 x pp=2, dp_replicate=2 x pp=2 (HSDP: the balancing
spans the replicas too) and pp=2 x ep=2 (each stage's experts split over
its 2 data-parallel ranks) with gpipe and 1f1b; the softmax router with its
aux and z losses (qwen3_moe_dllm) and the sigmoid router with its expert bias
(llada2_moe: group-limited top-k, a shared expert, layer 0 dense); AdamW and MuonAdamW.
Every config runs 2 gradient-accumulation micro-batches of a 4-row global batch
(split_batches) and 2 pipeline micro-batches, so each pipeline micro-batch is one of the
one-process run's micro-batches: the balancing losses span the same tokens, and the
losses, the expert biases and the final weights must be the one-process run's. A DCP
checkpoint of the dp_shard=2 x pp=2 run resumes under pp=2 x ep=2 and on one process.
"""

import json
from pathlib import Path

import pytest
import torch
from conftest import by_step, deep_update, losses, train_in_process, write_run_config
from launch import WORKERS, torchrun
from safetensors.torch import load_file

pytestmark = pytest.mark.slow
STEPS = 20
BASE = {
    "model": {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
              "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
    "train": {"split_batches": True, "eval_steps": 10, "save_steps": 0, "logging_steps": 1,
              "max_steps": STEPS, "per_device_train_batch_size": 4,
              "gradient_accumulation_steps": 2, "pipeline_parallel": 2,
              "pipeline_microbatches": 2},
}  # fmt: skip
SOFTMAX = {"model": {"model_type": "qwen3_moe_dllm", "router_aux_loss_coef": 0.01,
                     "router_z_loss_coef": 0.001}}  # fmt: skip
SIGMOID = {"model": {"model_type": "llada2_moe", "n_group": 2, "topk_group": 1,
                     "num_shared_experts": 1, "first_k_dense_replace": 1,
                     "expert_bias_update_rate": 0.01}}  # fmt: skip
MUON = {"optim": {"name": "muon", "ns_dtype": "float32"}}
GPIPE = {"train": {"pipeline_schedule": "gpipe"}}
F1B = {"train": {"pipeline_schedule": "1f1b"}}
INTERLEAVED = {"train": {"pipeline_schedule": "interleaved_1f1b", "pipeline_stages_per_rank": 2}}
ZERO_BUBBLE = {"train": {"pipeline_schedule": "zero_bubble", "pipeline_stages_per_rank": 2}}
DP2 = {"train": {"dp_shard": 2}}
HSDP2 = {"train": {"dp_replicate": 2}}
EP2 = {"train": {"expert_parallel": 2}}
SAVE10 = {"train": {"save_steps": 10}}


def _join(*parts: dict) -> dict:
    tree: dict = {}
    for part in parts:
        tree = deep_update(tree, part)
    return tree


CONFIGS = {  # name: (processes, extra)
    "pp2_gpipe_adamw_softmax": (2, _join(SOFTMAX, GPIPE)),
    "pp2_1f1b_muon_softmax": (2, _join(SOFTMAX, F1B, MUON)),
    "pp2_gpipe_muon_sigmoid": (2, _join(SIGMOID, GPIPE, MUON)),
    "pp2_1f1b_adamw_sigmoid": (2, _join(SIGMOID, F1B)),
    # 2 stages per rank (one layer each), layer 0 dense
    "pp2_interleaved_adamw_sigmoid": (2, _join(SIGMOID, INTERLEAVED)),
    "pp2_zerobubble_muon_softmax": (2, _join(SOFTMAX, MUON, ZERO_BUBBLE)),
    "dp2pp2_1f1b_adamw_softmax": (4, _join(SOFTMAX, F1B, DP2)),
    "dp2pp2_gpipe_muon_sigmoid": (4, _join(SIGMOID, GPIPE, MUON, DP2, SAVE10)),
    "hsdp2pp2_1f1b_muon_softmax": (4, _join(SOFTMAX, F1B, MUON, HSDP2)),
    # expert parallelism inside each stage: its 2 data-parallel ranks split its experts
    "pp2ep2_1f1b_adamw_softmax": (4, _join(SOFTMAX, F1B, DP2, EP2)),
    "pp2ep2_gpipe_muon_sigmoid": (4, _join(SIGMOID, GPIPE, MUON, DP2, EP2)),
}


#: bf16 (FSDP2 mixed precision) MoE stages with expert parallelism: zero bubble and
#: interleaved 1F1B on the same 4 stages
BF16_RUNS = {
    f"pp2ep2_{name}_bf16_sigmoid": (4, _join(SIGMOID, schedule, DP2, EP2,
                                             {"train": {"bf16": True}}))
    for name, schedule in (("zerobubble", ZERO_BUBBLE), ("interleaved", INTERLEAVED))
}  # fmt: skip


def _launch(nproc: int, root: Path, names: list[str]) -> dict:
    out = root / f"results-{nproc}"
    out.mkdir()
    torchrun(nproc, WORKERS / "moe_worker.py", out, *[root / f"{n}.yaml" for n in names],
             timeout=1200)  # fmt: skip
    return {r: json.loads((out / f"rank-{r}.json").read_text()) for r in range(nproc)}


#: dp2pp2_gpipe_muon_sigmoid's DCP checkpoint-10 resumed under pp=2 x ep=2 (in the 4-process
#: launch, after it) and on one process (in the test)
SAVED = "dp2pp2_gpipe_muon_sigmoid"
RESUMED = _join(SIGMOID, GPIPE, MUON, DP2, EP2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppmoe")
    checkpoint = {"train": {"resume_from_checkpoint": str(root / SAVED / "checkpoint-10")}}
    configs = {**CONFIGS, **BF16_RUNS, "resume_pp2ep2": (4, _join(RESUMED, checkpoint)),
               "resume_one": (1, _join(RESUMED, checkpoint))}  # fmt: skip
    for name, (_, extra) in configs.items():
        write_run_config(root, name, BASE, extra)
    ranks: dict = {}
    for nproc in (2, 4):
        names = [n for n, (p, _) in configs.items() if p == nproc]
        for rank, result in _launch(nproc, root, names).items():
            ranks.setdefault(rank, {}).update(result)
    return {"root": root, "ranks": ranks}


def one_process(runs, name: str) -> Path:
    root = runs["root"]
    return train_in_process(root / f"{name}.yaml", root / f"{name}-1", pipeline_parallel=1,
                            dp_shard=-1, dp_replicate=1, pipeline_microbatches=None,
                            expert_parallel=1)  # fmt: skip


@pytest.mark.parametrize("name", list(CONFIGS))
def test_losses_biases_and_weights_equal_one_process_for_20_steps(runs, name):
    root, nproc = runs["root"], CONFIGS[name][0]
    result = runs["ranks"][0][name]
    assert result["rc"] == 0, result["stderr"][-3000:]
    single_dir = one_process(runs, name)
    single, split = losses(single_dir), losses(root / name)
    assert sorted(single) == sorted(split) == list(range(1, STEPS + 1))
    for step in single:
        assert split[step] == pytest.approx(single[step], rel=1e-5), step
    single_eval, split_eval = by_step(single_dir, "eval_loss"), by_step(root / name, "eval_loss")
    assert sorted(split_eval) == sorted(single_eval) == [10, 20]
    for step in single_eval:
        assert split_eval[step] == pytest.approx(single_eval[step], rel=1e-5), step
    # the balancing metrics cover every stage's layers, as one process logs them
    for key in ("moe_aux_loss", "moe_load_max_over_mean", "moe_load_max_over_mean/layer_2"):
        one, pp = by_step(single_dir, key), by_step(root / name, key)
        assert sorted(pp) == sorted(one) == list(range(1, STEPS + 1)), key
        for step in one:
            assert pp[step] == pytest.approx(one[step], rel=1e-5, abs=1e-9), (key, step)
    reference = load_file(single_dir / "final" / "model.safetensors")
    final = load_file(root / name / "final" / "model.safetensors")
    assert sorted(final) == sorted(reference)
    for key, value in reference.items():  # every stage's weights, gathered
        assert ((final[key] - value).norm() / value.norm().clamp(min=1e-12)).item() <= 1e-4, key
    if "sigmoid" in name:  # each stage's ranks hold its layers' biases, all equal to 1 process
        held: dict = {}
        for rank in range(nproc):
            for key, bias in runs["ranks"][rank][name]["named_biases"].items():
                held.setdefault(key, []).append(bias)
        expected = sorted(k for k in reference if k.endswith("expert_bias"))
        assert sorted(held) == expected == [f"model.layers.{i}.mlp.gate.expert_bias"
                                            for i in (1, 2, 3)]  # fmt: skip
        for key, biases in held.items():
            assert len(biases) == nproc // 2  # the dp ranks of the stage that holds it
            assert all(b == biases[0] for b in biases), key
            assert torch.equal(torch.tensor(biases[0]), reference[key]), key
        # they moved (a layer's may be back at 0 after 20 steps of +-rate)
        assert sum(torch.tensor(b[0]).abs().sum() for b in held.values()) > 0


def test_bf16_moe_stages_with_expert_parallelism_under_zero_bubble(runs):
    """MoE stages under bf16 (FSDP2 mixed precision) with expert parallelism (pp=2 x ep=2):
    zero bubble's split backward runs, and its 20 steps' losses equal interleaved 1F1B's on
    the same 4 stages within bf16's rounding (last-stage loss chunked against fused, the
    gradients summed in another order)."""
    root = runs["root"]
    for name in BF16_RUNS:
        result = runs["ranks"][0][name]
        assert result["rc"] == 0, result["stderr"][-3000:]
    split = losses(root / "pp2ep2_zerobubble_bf16_sigmoid")
    interleaved = losses(root / "pp2ep2_interleaved_bf16_sigmoid")
    assert sorted(split) == sorted(interleaved) == list(range(1, STEPS + 1))
    for step in split:
        assert split[step] == pytest.approx(interleaved[step], rel=1e-3), step


def test_dcp_checkpoint_of_dp2_pp2_resumes_under_pp2_ep2_and_on_one_process(runs):
    """The sigmoid-router run's checkpoint-10 (dp_shard=2 x pp=2: each stage's weights,
    expert biases and Muon state) resumed with each stage's experts split over ep=2, and
    on one process: steps 11-20 are the uninterrupted run's."""
    root = runs["root"]
    full = losses(root / SAVED)
    result = runs["ranks"][0]["resume_pp2ep2"]
    assert result["rc"] == 0, result["stderr"][-3000:]
    one = train_in_process(root / "resume_one.yaml", root / "resume_one", pipeline_parallel=1,
                           dp_shard=-1, pipeline_microbatches=None, expert_parallel=1)  # fmt: skip
    for resumed in (losses(root / "resume_pp2ep2"), losses(one)):
        assert sorted(resumed) == list(range(11, 21))
        for step in resumed:
            assert resumed[step] == pytest.approx(full[step], rel=1e-5), step
