"""Non-finite steps on one rank of a torchrun launch.

usage: torchrun --nproc_per_node=W guard_worker.py RESULTS.json SPEC [SPEC ...]
SPEC is CONFIG.yaml:MODE:RANK:STEPS, STEPS comma-separated; MODE is nan (that rank's loss is
NaN at those steps), nan-once (only the first time each is computed: a rollback computes it
again) or skip (the oracle: every rank's optimizer and schedule stand still at those steps).
Rank 0 writes {config name: {"rc", "message"}} to RESULTS.json.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: faults.py

from faults import NonFiniteAt, skipping_reference  # noqa: E402

from unmask.config import load_config  # noqa: E402
from unmask.errors import RunStopped  # noqa: E402
from unmask.parallel.mesh import end_process  # noqa: E402
from unmask.train.trainer import Trainer  # noqa: E402


def run(spec: str) -> dict:
    cfg, mode, rank, steps = spec.rsplit(":", 3)
    steps = {int(s) for s in steps.split(",")}
    trainer = Trainer(load_config(cfg))
    if mode == "skip":
        skipping_reference(trainer, steps)
    else:
        trainer.objective = NonFiniteAt(trainer, steps, once=mode == "nan-once", rank=int(rank))
    try:
        trainer.train()
    except RunStopped as stopped:
        return {"rc": 1, "message": str(stopped), "step": trainer.step}
    return {"rc": 0, "message": "", "step": trainer.step}


if __name__ == "__main__":
    results = {Path(spec.split(":")[0]).stem: run(spec) for spec in sys.argv[2:]}
    if int(os.environ.get("RANK", "0")) == 0:
        Path(sys.argv[1]).write_text(json.dumps(results, indent=2))
    end_process(0)
