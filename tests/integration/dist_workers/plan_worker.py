"""Measure what `unmask plan` predicts, in a real run: several configs in one torchrun launch.

usage: torchrun --nproc_per_node=W plan_worker.py OUT_DIR CFG1.yaml CFG2.yaml ...
For each config every rank builds the run with the real Trainer (its mesh, TP, FSDP2,
optimizer), runs two training steps on the run's own batches, measures the second (the
optimizer state exists by then, as in every later step) and writes
OUT_DIR/<config stem>.rank<R>.json with, on this rank:
- parameters, gradients (read just before the optimizer step), optimizer_state: the sum of
  numel x itemsize of every local shard (DTensor.to_local());
- saved_activations: bytes of the distinct storages autograd saved during a micro-batch's
  forward (saved_tensors_hooks; parameters, gathered FSDP2 parameters included, left
  out), the largest over the step's micro-batches;
- peak (the MemTracker of torch.distributed._tools: every tensor allocation tracked through
  a dispatch mode, by category) and its categories at that peak, for the whole step (None
  for a step of several micro-batches: MemTracker refuses a module called twice);
- local_shapes: each parameter's local shape;
- masked: the LM head's rows (tokens masked) of the step on this rank (and
  collectives_masked: of the step whose collectives were counted);
- collectives: {c10d kind: [calls, bytes]} of a third step (torch.profiler).
"""

import contextlib
import json
import os
import sys
from pathlib import Path

import torch
from torch import nn


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor inside a tensor subclass: a DTensor's local tensor, or the result
    an async functional collective wraps (the vocab-parallel embedding's all-reduced
    output, which the first norm saves)."""
    while hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        t = getattr(t, names[0])
    return t


def _bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


class SavedBytes:
    """Distinct storages autograd saves for backward: parameters and views of them (a
    linear's transposed weight) are left out. Everything saved stays alive until the
    backward, so no address is reused while the forward runs."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, t):
        if not (isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)):
            local = _local(t)
            # a functional collective's result (expert parallelism's all-to-alls) wraps
            # the tensor that holds its storage
            local = getattr(local, "elem", local)
            storage = local.untyped_storage()
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    def total(self) -> int:
        return sum(self.storages.values())


def collective_bytes(prof) -> dict[str, list[int]]:
    """kind -> [calls, bytes] of a third step on this rank, from torch.profiler's events: the
    kind from each c10d event (allreduce, allgather_into_tensor_coalesced, ...), the bytes
    from the gloo operation inside it (the tensor gloo is handed: an all-gather's shard, an
    all-to-all's send buffer)."""
    sizes = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8}
    found: dict[str, list[int]] = {}
    kind = None
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        if event.name.startswith("c10d::") and event.name != "c10d::barrier":
            kind = event.name.removeprefix("c10d::").strip("_")
            found.setdefault(kind, [0, 0])[0] += 1
        elif event.name.startswith("gloo:") and kind is not None:
            numel = 1
            for d in (event.input_shapes or [[0]])[0]:
                numel *= d
            dtype = (getattr(event, "input_dtypes", None) or ["float"])[0]
            found[kind][1] += numel * sizes.get(dtype, 4)
    return found


def measure(cfg_path: str, out_dir: Path) -> None:
    from torch.distributed._tools.mem_tracker import MemTracker

    from unmask.config import load_config
    from unmask.train.trainer import Trainer

    rank = int(os.environ.get("RANK", "0"))
    stem = Path(cfg_path).stem
    cfg = load_config(cfg_path, [f"train.output_dir={out_dir / ('run-' + stem)}"])
    trainer = Trainer(cfg)
    model, optimizer = trainer.model, trainer.optimizer

    def batches():
        return [next(trainer.loader) for _ in range(cfg.train.gradient_accumulation_steps)]

    trainer.train_step(batches())
    grads = {}
    real_step = optimizer.step

    def step_recording_grads(*args, **kwargs):
        grads["bytes"] = _bytes(p.grad for p in model.parameters() if p.grad is not None)
        return real_step(*args, **kwargs)

    optimizer.step = step_recording_grads
    saved: list[SavedBytes] = []  # one per micro-batch
    objective = trainer.objective
    real_call = type(objective).__call__
    masked = []

    def call_saving(self, model_, batch, generator):
        saved.append(SavedBytes())
        with torch.autograd.graph.saved_tensors_hooks(saved[-1].pack, lambda t: t):
            out = real_call(self, model_, batch, generator)
        count = self.last_stats.get("num_masked")
        masked.append(int(count) if count is not None else None)
        return out

    type(objective).__call__ = call_saving
    # MemTracker follows modules and refuses a module called twice in one step, so a step
    # of several micro-batches is measured without it (no peak)
    # (a pipeline's stages run once per micro-batch of its schedule: no peak either)
    tracked = cfg.train.gradient_accumulation_steps == 1 and cfg.train.pipeline_parallel == 1
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    try:
        with tracker if tracked else contextlib.nullcontext():
            trainer.train_step(batches())
    finally:
        type(objective).__call__ = real_call
    device_peaks = {"Total": None}
    if tracked:
        device_peaks = next(iter(tracker.get_tracker_snapshot("peak").values()))
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    optimizer.step = real_step
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:  # fmt: skip
        trainer.train_step(batches())
    # its masked count (the vocab-parallel loss's all-reduces are per masked row; one
    # micro-batch's count: the layouts with several measure no TP traffic)
    profiled_masked = int(trainer.objective.last_stats["num_masked"])
    result = {
        "parameters": _bytes(model.parameters()),
        "gradients": grads["bytes"],
        "optimizer_state": _bytes(state),
        "saved_activations": max(s.total() for s in saved),
        "peak": device_peaks["Total"],
        "peak_categories": {str(k): v for k, v in device_peaks.items()},
        "local_shapes": {
            n.replace("._orig_mod", ""): list(_local(p).shape) for n, p in model.named_parameters()
        },  # fmt: skip
        "masked": masked,
        "collectives": collective_bytes(prof),
        "collectives_masked": profiled_masked,
    }
    (out_dir / f"{stem}.rank{rank}.json").write_text(json.dumps(result, indent=1))
    trainer.loader.close()


if __name__ == "__main__":
    out = Path(sys.argv[1])
    for path in sys.argv[2:]:
        measure(path, out)
