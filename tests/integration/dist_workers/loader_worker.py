"""Read training batches as a torchrun rank would, and write them out.

usage: torchrun --nproc_per_node=W loader_worker.py CONFIG.yaml OUT_PREFIX BATCHES
Builds the tokenizer and data from the config the way the trainer does, takes this rank's
loader (rank and world size from the launcher's environment, per_device_train_batch_size
rows per micro-batch) and writes the input_ids of BATCHES micro-batches to
OUT_PREFIX-RANK.json.
"""

import json
import sys

from unmask.config import load_config
from unmask.data import build_datasets, build_tokenizer, ensure_special_tokens, make_loader
from unmask.parallel.mesh import end_process, launch_env


def main(config: str, out_prefix: str, batches: int) -> None:
    cfg = load_config(config)
    env = launch_env()
    tokenizer = build_tokenizer(cfg.data)
    ensure_special_tokens(tokenizer)
    data = build_datasets(cfg.data, tokenizer)
    loader = make_loader(data.train, cfg.train.per_device_train_batch_size, cfg.train.seed,
                         env.rank, env.world_size, cfg.train.dataloader_num_workers)  # fmt: skip
    rows = [next(loader)["input_ids"].tolist() for _ in range(batches)]
    with open(f"{out_prefix}-{env.rank}.json", "w") as f:
        json.dump(rows, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    end_process(0)
