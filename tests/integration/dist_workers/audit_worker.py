"""Audit a steady-state training step of several configs in one torchrun launch
(unmask/train/audit.py): each config's Trainer takes one step, then a second under the
matmul and sync audits.

usage: torchrun --nproc_per_node=W audit_worker.py RESULTS_DIR CFG1.yaml CFG2.yaml ...
Rank r writes RESULTS_DIR/rank-r.json: {config name: {"flops": {dtype: FLOPs},
"float32_largest": [[op, shapes, FLOPs, site], ...], "syncs": [[why, where], ...],
"sharded": whether the model's parameters are DTensors (FSDP2)}}.
"""

import json
import os
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from unmask.config import load_config
from unmask.parallel.mesh import end_process
from unmask.train.audit import MatmulAudit, SyncAudit
from unmask.train.trainer import Trainer


def audit(config: str) -> dict:
    trainer = Trainer(load_config(config))
    accumulation = trainer.cfg.train.gradient_accumulation_steps
    for index in range(2):
        batches = [next(trainer.loader) for _ in range(accumulation)]
        if index == 0:
            trainer.train_step(batches)
        else:
            with MatmulAudit(sites=True) as matmuls, SyncAudit() as syncs:
                trainer.train_step(batches)
        trainer.step += 1
    # train.nonfinite_check logging: the flags stay on the device, the step waits for none
    trainer.cfg.train.nonfinite_check = "logging"
    batches = [next(trainer.loader) for _ in range(accumulation)]
    with SyncAudit() as late:
        stats = trainer.train_step(batches)
    assert stats["finite"] is None and stats["flags"].numel() == 2  # finite, stop
    trainer.loader.close()
    return {
        "syncs_logging": late.found,
        "flops": {str(dtype): flops for dtype, flops in matmuls.flops_by_dtype().items()},
        "float32_largest": [
            [r.op, r.shapes, r.flops, r.site] for r in matmuls.largest(torch.float32)
        ],
        # the MoE routers' logits and their two gradients: float32 by design (models/moe.py
        # _Float32Linear), at its sites
        "float32_router": sum(
            r.flops
            for r in matmuls.records
            if r.dtype == torch.float32 and "models/moe.py" in r.site
        ),
        "syncs": syncs.found,
        "sharded": any(isinstance(p, DTensor) for p in trainer.model.parameters()),
    }


if __name__ == "__main__":
    results = {Path(config).stem: audit(config) for config in sys.argv[2:]}
    rank = int(os.environ.get("RANK", "0"))
    Path(sys.argv[1], f"rank-{rank}.json").write_text(json.dumps(results, indent=2))
    end_process(0)
