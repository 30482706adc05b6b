"""Run several `unmask train` configs in one torchrun launch (one process group).

usage: torchrun --nproc_per_node=W train_worker.py RESULTS.json CFG1.yaml CFG2.yaml ...
Each config goes through the CLI entry point; rank 0 writes {config name: {"rc", "stderr"}}
(stderr of that run on rank 0) to RESULTS.json.
"""

import contextlib
import io
import json
import os
import sys
from pathlib import Path

from unmask.cli import main
from unmask.parallel.mesh import end_process


def run_all(results_path: str, configs: list[str]) -> None:
    results = {}
    for cfg in configs:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = main(["train", cfg])
        results[Path(cfg).stem] = {"rc": rc, "stderr": err.getvalue()}
    if int(os.environ.get("RANK", "0")) == 0:
        Path(results_path).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    run_all(sys.argv[1], sys.argv[2:])
    end_process(0)
