"""Train several DiffusionGemma configs in one torchrun launch under tensor parallelism and
record, per rank, how its parameters were laid out (tensor parallelism must really split
the attention and the dense MLP, and leave the routers and experts whole).

usage: torchrun --nproc_per_node=W gemma_tp_worker.py RESULTS_DIR CFG1.yaml CFG2.yaml ...
Rank r writes RESULTS_DIR/rank-r.json: {config name: {"rc", "stderr", "layout"}} with
"layout" {parameter name: [{mesh dim name: placement as text}, local shape]} of every
parameter ({} for a plain tensor).
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


def layout(model) -> dict[str, list]:
    out = {}
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            dims = dict(zip(param.device_mesh.mesh_dim_names, map(str, param.placements)))
            out[name] = [dims, list(param.to_local().shape)]
        else:
            out[name] = [{}, list(param.shape)]
    return out


def run_all(results: str, configs: list[str]) -> None:
    out = {}
    for cfg in configs:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            trainer = Trainer(load_config(cfg))
            trainer.train()
        out[Path(cfg).stem] = {"rc": 0, "stderr": err.getvalue(),
                               "layout": layout(trainer.model)}  # fmt: skip
    rank = int(os.environ.get("RANK", "0"))
    Path(results, f"rank-{rank}.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    run_all(sys.argv[1], sys.argv[2:])
    end_process(0)
