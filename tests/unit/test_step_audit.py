"""What one training step asks of the hardware, audited on a CPU (unmask/train/audit.py),
for dense and MoE models and every training objective:
- under bf16 autocast its matmuls run in bf16 but the MoE routers' (float32 by design):
  the other float32 matmul FLOPs <= 1% of all (the LM head and the residual stream were
  float32 at world size 1: the head's three GEMMs ran on CUDA cores at a fifteenth of the
  tensor-core rate); DiffusionGemma too (its soft-capped head in bf16, the soft-capping and
  the log-sum-exp in float32);
- a steady-state step makes no device sync but the non-finite guard's one read of its flag,
  and none when that flag is read at logging steps (train.nonfinite_check) (the masked rows are gathered by a count copied to the host early, expert counts come
  from a sort, the expert load stays on the device);
- the FLOPs the trainer counts for MFU are torch's FlopCounterMode's over the same step
  (within 2%; exact here), with the forwards the objective really ran (BD3LM and Fast-dLLM
  v2 feed the model more tokens than their batch holds).
"""

import pytest
import torch
import yaml
from conftest import AUDIT_CASES, TINY, deep_update
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from unmask.config import load_config
from unmask.diffusion.recipes import dense_ids
from unmask.train.audit import MatmulAudit, SyncAudit
from unmask.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

SLIDING, FULL = "sliding_attention", "full_attention"
CASES = {
    **AUDIT_CASES,
    # DiffusionGemma (encoder, two decoder passes with self-conditioning, the soft-capped
    # tied head over the whole vocabulary, experts as grouped GEMMs) under `uniform`
    "diffusion_gemma_uniform": {
        "model": {"model_type": "diffusion_gemma", "head_dim": 16, "num_experts": 4,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "diffusion_gemma": {"sliding_window": 8, "canvas_length": 4,
                                      "layer_types": [SLIDING, FULL]}},
        "diffusion": {"objective": "uniform", "self_conditioning_prob": 0.5},
    },
}  # fmt: skip


def trainer_for(tmp_path, extra: dict) -> Trainer:
    tree = deep_update(TINY, {"train": {"output_dir": str(tmp_path / "run")}})
    tree = deep_update(tree, extra)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    return Trainer(load_config(path))


def step(trainer: Trainer) -> dict:
    batches = [next(trainer.loader) for _ in range(trainer.cfg.train.gradient_accumulation_steps)]
    stats = trainer.train_step(batches)
    trainer.step += 1
    return stats


@pytest.mark.parametrize("name", list(CASES))
def test_a_bf16_step_runs_its_matmuls_in_bf16_and_waits_for_the_device_once(tmp_path, name):
    """sdpa attention: the GPU default (flex) is not differentiable on a CPU, and varlen,
    the CPU's packed-row kernel, reads its document runs to the host by design."""
    extra = deep_update(CASES[name], {"train": {"bf16": True},
                                      "model": {"attn_implementation": "sdpa"}})  # fmt: skip
    trainer = trainer_for(tmp_path, extra)
    step(trainer)  # the first step makes the optimizer's state
    with MatmulAudit(sites=True) as matmuls, SyncAudit() as syncs:
        step(trainer)
    assert matmuls.total > 0
    # the routers' matmuls run in float32 by design (models/moe.py float32_region): the
    # float32 ones with the expert count and the hidden size among their dims, (T, H) x
    # (H, E) and its two gradients; here E = 4 of the tiny models' 32 hidden
    model = trainer.cfg.model
    router = [
        r
        for r in matmuls.records
        if r.dtype == torch.float32
        and model.num_experts
        and {model.num_experts, model.hidden_size} <= {d for s in r.shapes for d in s}
    ]
    assert bool(router) == bool(model.num_experts), matmuls.largest(torch.float32)
    others = matmuls.total - sum(r.flops for r in router)
    float32 = matmuls.flops_by_dtype().get(torch.float32, 0) - sum(r.flops for r in router)
    assert float32 <= 0.01 * others, matmuls.largest(torch.float32)
    assert matmuls.flops_by_dtype()[torch.bfloat16] >= 0.99 * others
    found = syncs.found
    assert len(found) == 1 and found[0][0] == "Tensor.tolist", found  # the guard's flag
    assert "step.py" in found[0][1] and "train_step" in found[0][1], found


@pytest.mark.parametrize("name", list(CASES))
def test_checking_the_flag_at_logging_steps_leaves_a_step_no_sync(tmp_path, name):
    """train.nonfinite_check logging: the guard's flag stays on the device until the log
    line, so a steady-state step waits for the device nowhere."""
    extra = deep_update(CASES[name], {"train": {"bf16": True, "nonfinite_check": "logging"},
                                      "model": {"attn_implementation": "sdpa"}})  # fmt: skip
    trainer = trainer_for(tmp_path, extra)
    step(trainer)
    with SyncAudit() as syncs:
        stats = step(trainer)
    assert syncs.found == [], syncs.found
    assert stats["finite"] is None and bool(stats["flags"][0])


@pytest.mark.parametrize("name", list(CASES))
def test_the_mfu_flop_count_equals_flop_counter_mode(tmp_path, name):
    """AdamW (no matmuls in the optimizer), float32, attention through sdpa's math kernel
    (its matmuls are what FlopCounterMode counts on a CPU) and MoE experts one matmul each
    (`loop`: torch's counter has no formula for grouped GEMMs)."""
    extra = {"optim": {"name": "adamw"}, "model": {"attn_implementation": "sdpa"}}
    if "moe" in name or "diffusion_gemma" in name:
        extra["model"]["moe_implementation"] = "loop"
    trainer = trainer_for(tmp_path, deep_update(CASES[name], extra))
    step(trainer)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        stats = step(trainer)
    counted = counter.get_total_flops()
    assert counted > 0
    assert float(stats["flops"]) == pytest.approx(counted, rel=0.02)


def test_dense_ids_number_each_rows_ids_in_order():
    ids = torch.tensor([[7, 7, 3, 3, 9, 7], [100, 100, 100, 5, 5, 5000]])
    assert dense_ids(ids).tolist() == [[1, 1, 0, 0, 2, 1], [1, 1, 1, 0, 0, 2]]
