"""Run several `unmask train` configs in one torchrun launch and record every rank's MoE
expert biases after each run (they must agree across ranks).

usage: torchrun --nproc_per_node=W moe_worker.py RESULTS_DIR CFG1.yaml CFG2.yaml ...
Rank r writes RESULTS_DIR/rank-r.json: {config name: {"rc", "stderr", "biases",
"named_biases"}} with "biases" the expert_bias of every sigmoid-router layer this rank holds
(lists, layer order; [] otherwise) and "named_biases" the same by parameter name
(`model.layers.N.mlp.gate.expert_bias`: under pipeline parallelism a rank holds its stages').
A config named bad* goes through the CLI entry point (its exit code and one-line error).
"""

import contextlib
import io
import json
import os
import sys
from pathlib import Path

from unmask.cli import main
from unmask.config import load_config
from unmask.models.moe import moe_blocks
from unmask.parallel.mesh import end_process
from unmask.train.trainer import Trainer


def run_all(results: str, configs: list[str]) -> None:
    out = {}
    for cfg in configs:
        err = io.StringIO()
        biases: list = []
        named: dict = {}
        with contextlib.redirect_stderr(err):
            if Path(cfg).stem.startswith("bad"):
                rc = main(["train", cfg])
            else:
                trainer = Trainer(load_config(cfg))
                trainer.train()
                rc = 0
                for block in moe_blocks(trainer.model):
                    if block.gate.expert_bias is not None:
                        biases.append(block.gate.expert_bias.tolist())
                for name, buffer in trainer.model.named_buffers():
                    if name.endswith("gate.expert_bias"):
                        named[name] = buffer.tolist()
        out[Path(cfg).stem] = {"rc": rc, "stderr": err.getvalue(), "biases": biases,
                               "named_biases": named}  # fmt: skip
    rank = int(os.environ.get("RANK", "0"))
    Path(results, f"rank-{rank}.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    run_all(sys.argv[1], sys.argv[2:])
    end_process(0)
