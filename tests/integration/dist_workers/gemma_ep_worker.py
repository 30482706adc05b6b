"""Train several DiffusionGemma configs in one torchrun launch and record, per rank, how its
expert stacks were laid out (expert parallelism must really split them).

usage: torchrun --nproc_per_node=W gemma_ep_worker.py RESULTS_DIR CFG1.yaml CFG2.yaml ...
Rank r writes RESULTS_DIR/rank-r.json: {config name: {"rc", "stderr", "stacks", "reduces"}}
with "stacks" {parameter name: [placements as text, local shape]} of every expert stack
(DTensors only; {} when none is one) and "reduces" whether the trainer reduces the expert
gradients before each optimizer step (a MoETraining with expert parameters).
"""

import contextlib
import io
import json
import os
import sys
from pathlib import Path

from torch.distributed.tensor import DTensor

from unmask.config import load_config
from unmask.parallel.mesh import end_process
from unmask.train.trainer import Trainer


def run_all(results: str, configs: list[str]) -> None:
    out = {}
    for cfg in configs:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            trainer = Trainer(load_config(cfg))
            trainer.train()
        stacks = {name: [str(p.placements), list(p.to_local().shape)]
                  for name, p in trainer.model.named_parameters()
                  if isinstance(p, DTensor) and ".experts." in name}  # fmt: skip
        reduces = trainer.moe is not None and bool(trainer.moe.expert_params)
        out[Path(cfg).stem] = {"rc": 0, "stderr": err.getvalue(), "stacks": stacks,
                               "reduces": reduces}  # fmt: skip
    rank = int(os.environ.get("RANK", "0"))
    Path(results, f"rank-{rank}.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    run_all(sys.argv[1], sys.argv[2:])
    end_process(0)
