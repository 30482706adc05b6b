"""Expert parallelism (`parallel.expert_parallel: 2`) of DiffusionGemma's experts on 2 gloo
processes, trained with the `uniform` objective and self-conditioning, against the
one-process run of the same global batch: the losses of 20 steps and the final weights
within 1e-5 (AdamW; Muon with 2 micro-batches per step within test_expert_parallel.py's
tolerances); a run resumed under ep=2 from the
ep=2 run's step-10 checkpoint (what a run killed after step 10 leaves on disk) gives the
uninterrupted run's losses and weights bit for bit, and the same checkpoint (DCP: one
global tensor per expert stack) resumes on one process. One torchrun launch
(dist_workers/gemma_ep_worker.py, which also records that the stacks really were split)."""

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY_GEMMA, deep_update, losses, train_in_process, write_run_config
from launch import WORKERS, torchrun
from safetensors.torch import load_file

from unmask.checkpoint import is_distributed_checkpoint
from unmask.config import load_config
from unmask.errors import InputError
from unmask.models.diffusion_gemma import Experts
from unmask.models.moe import SparseMoE
from unmask.parallel.expert import expert_blocks, expert_stacks
from unmask.train.setup import plan_parallel
from unmask.train.trainer import Trainer

GEMMA = TINY_GEMMA  # 4 experts: 2 per rank under ep=2
EP2 = deep_update(GEMMA, {
    "parallel": {"expert_parallel": 2},
    "diffusion": {"self_conditioning_prob": 0.5},
    "train": {"split_batches": True, "max_steps": 20, "save_steps": 10},
})  # fmt: skip
MUON = {"optim": {"name": "muon", "ns_dtype": "float32"},
        "train": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
                  "save_steps": 0}}  # fmt: skip


BF16 = {"train": {"bf16": True, "max_steps": 5, "save_steps": 0}}
COMPILED = {"train": {"torch_compile": True}}
NATIVE_MOE = {"model": {"model_type": "qwen3_moe_dllm", "diffusion_gemma": None},
              "diffusion": {"objective": "mdlm"}}  # fmt: skip
"""bf16 runs of 5 steps, compiled (train.torch_compile) and not, of this family and of a
native MoE model (SparseMoE) under ep=2."""


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "final" / "model.safetensors")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma_ep")
    resume = {"train": {"resume_from_checkpoint": str(root / "ep2" / "checkpoint-10")}}
    configs = {"ep2": {}, "ep2_muon": MUON, "ep2_resumed": resume,
               "ep2_bf16": BF16, "ep2_compiled": deep_update(BF16, COMPILED),
               "moe_bf16": deep_update(BF16, NATIVE_MOE),
               "moe_compiled": deep_update(deep_update(BF16, NATIVE_MOE), COMPILED)}  # fmt: skip
    paths = [write_run_config(root, name, EP2, extra) for name, extra in configs.items()]
    out = root / "results"
    out.mkdir()
    torchrun(2, WORKERS / "gemma_ep_worker.py", out, *paths)
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    return {"root": root, "ranks": ranks}


@pytest.mark.slow
def test_the_experts_are_split_over_the_two_ranks(runs):
    for rank in runs["ranks"]:
        for name, result in rank.items():
            assert result["rc"] == 0, result["stderr"][-3000:]
            assert result["reduces"], name
            stacks = result["stacks"]
            if name.startswith("moe"):  # SparseMoE's stacks
                where, names = "mlp.experts", ("down_proj", "gate_proj", "up_proj")
            else:
                where, names = "experts", ("down_proj", "gate_up_proj")
            assert sorted(stacks) == [f"model.layers.{i}.{where}.{s}" for i in (0, 1)
                                      for s in names], name  # fmt: skip
            for placements, local in stacks.values():
                assert placements == "(Replicate(), Shard(dim=0))"
                assert local[0] == 2  # 2 of the 4 experts on each rank


@pytest.mark.slow
def test_losses_and_final_weights_equal_one_process_for_20_steps(runs):
    root = runs["root"]
    single_run = train_in_process(root / "ep2.yaml", root / "ep2-1", expert_parallel=1)
    single, sharded = losses(single_run), losses(root / "ep2")
    assert sorted(single) == sorted(sharded) == list(range(1, 21))
    for step in single:
        assert sharded[step] == pytest.approx(single[step], abs=1e-5), step
    reference, final = weights(single_run), weights(root / "ep2")
    assert sorted(reference) == sorted(final)
    for key, value in reference.items():
        assert torch.allclose(final[key], value, rtol=0, atol=1e-5), key


@pytest.mark.slow
def test_muon_with_two_micro_batches_equals_one_process(runs):
    """Muon's Newton-Schulz iterations amplify the float32 rounding of other summation
    orders: test_expert_parallel.py's tolerances (1e-5 relative on the losses, 1e-4 on each
    tensor's relative norm)."""
    root = runs["root"]
    single_run = train_in_process(root / "ep2_muon.yaml", root / "ep2_muon-1",
                                  expert_parallel=1)  # fmt: skip
    single, sharded = losses(single_run), losses(root / "ep2_muon")
    assert sorted(single) == sorted(sharded) == list(range(1, 21))
    for step in single:
        assert sharded[step] == pytest.approx(single[step], rel=1e-5), step
    reference, final = weights(single_run), weights(root / "ep2_muon")
    for key, value in reference.items():
        assert ((final[key] - value).norm() / value.norm().clamp(min=1e-12)).item() <= 1e-4, key


@pytest.mark.slow
def test_a_run_resumed_under_ep2_equals_the_uninterrupted_one_bit_for_bit(runs):
    root = runs["root"]
    assert is_distributed_checkpoint(root / "ep2" / "checkpoint-10")
    full, resumed = losses(root / "ep2"), losses(root / "ep2_resumed")
    assert sorted(resumed) == list(range(11, 21))
    for step in resumed:
        assert resumed[step] == full[step], step  # exactly, on CPU
    assert ((root / "ep2" / "final" / "model.safetensors").read_bytes()
            == (root / "ep2_resumed" / "final" / "model.safetensors").read_bytes())  # fmt: skip


@pytest.mark.slow
def test_the_ep2_checkpoint_resumes_on_one_process(runs):
    root = runs["root"]
    one = train_in_process(root / "ep2_resumed.yaml", root / "resumed-1", expert_parallel=1)
    full, resumed = losses(root / "ep2"), losses(one)
    assert sorted(resumed) == list(range(11, 21))
    for step in resumed:
        assert resumed[step] == pytest.approx(full[step], abs=1e-5), step
    reference = weights(root / "ep2")
    for key, value in weights(one).items():
        assert torch.allclose(reference[key], value, rtol=0, atol=1e-5), key


def test_the_gemma_experts_are_the_expert_blocks_of_the_model(tmp_path):
    """The protocol parallel/expert.py splits: DiffusionGemma's `Experts` (one per layer,
    its two stacks), SparseMoE's layers as before; one process leaves them unsplit."""
    path = write_run_config(tmp_path, "run", GEMMA, {"train": {"max_steps": 1}})
    trainer = Trainer(load_config(path))
    blocks = expert_blocks(trainer.model)
    assert [type(b) for b in blocks] == [Experts, Experts]
    layers = trainer.model.model.layers
    for block, layer in zip(blocks, layers):
        assert block is layer.experts and block.expert_parallel is None
        stacks = expert_stacks(block)
        assert list(stacks) == ["gate_up_proj", "down_proj"]
        assert stacks["gate_up_proj"] is layer.experts.gate_up_proj
    assert trainer.moe is None  # nothing to balance, nothing to reduce on one process
    qwen = Trainer(load_config(write_run_config(tmp_path, "qwen", {"model": {
        "model_type": "qwen3_moe_dllm", "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16}}, {"train": {"max_steps": 1}})))  # fmt: skip
    moe = expert_blocks(qwen.model)
    assert moe and all(isinstance(b, SparseMoE) for b in moe)
    assert list(expert_stacks(moe[0])) == ["gate_proj", "up_proj", "down_proj"]


def test_experts_not_divisible_by_expert_parallel_fail_in_one_line(tmp_path):
    bad = deep_update(EP2, {"model": {"num_experts": 3}})
    cfg = load_config(write_run_config(tmp_path, "bad", bad, {}))
    with pytest.raises(InputError, match="num_experts=3 is not divisible by parallel.expert_"):
        plan_parallel(cfg, 2)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["ep2", "moe"])
def test_compiled_layers_under_ep2_give_the_eager_losses(runs, family):
    """train.torch_compile under expert parallelism: each layer compiled around its expert
    block, which runs eagerly (its all-to-all splits are host integers read from the
    per-expert counts, and it receives a data-dependent number of rows): it trains, and
    its bf16 losses follow the eager run's (rounding apart: compiled kernels fuse)."""
    root = runs["root"]
    eager, compiled = losses(root / f"{family}_bf16"), losses(root / f"{family}_compiled")
    assert sorted(compiled) == list(range(1, 6))
    for step in eager:
        assert compiled[step] == pytest.approx(eager[step], rel=1e-2), step  # measured 2.6e-3
