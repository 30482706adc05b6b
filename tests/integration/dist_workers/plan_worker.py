"""Measure what `unmask plan` predicts, in a real run: several configs in one torchrun launch.

usage: torchrun --nproc_per_node=W plan_worker.py OUT_DIR CFG1.yaml CFG2.yaml ...
For each config every rank builds the run with the real Trainer (its mesh, TP, FSDP2,
optimizer), runs two training steps on the run's own batches, measures the second (the
optimizer state exists by then, as in every later step) and writes
OUT_DIR/<config stem>.rank<R>.json with, on this rank:
- parameters, gradients (read just before the optimizer step), optimizer_state: the sum of
  numel x itemsize of every local shard (DTensor.to_local());
- saved_activations: the most bytes autograd holds saved at once during the step's
  forwards (`LiveSaved`, through saved_tensors_hooks: distinct storages, parameters,
  gathered FSDP2 parameters included, left out; a storage counts from its first save to
  the release of its last saved reference: a micro-batch's backward frees its graph, and
  a part of the graph no output needs, such as the routing's group choice, is freed in
  the forward): at the end of a micro-batch's forward, the largest over the step's
  micro-batches; under a pipeline, whose schedule runs the stages outside the
  objective's call, during the schedule's step, micro-batches in flight together;
- peak (the MemTracker of torch.distributed._tools: every tensor allocation tracked through
  a dispatch mode, by category) and its categories at that peak, for the whole step
  (`StepTracker`: a module called once per micro-batch, a pipeline stage or the model
  under gradient accumulation, is allowed; under a pipeline the stages' receive buffers,
  made in the first step and reused, are tracked too);
- local_shapes: each parameter's local shape;
- masked: the LM head's rows (tokens masked) of the step on this rank (and
  collectives_masked: of the step whose collectives were counted);
- collectives: {c10d kind: [calls, bytes]} of a third step (torch.profiler).
"""

import json
import os
import sys
import weakref
from pathlib import Path

import torch
from torch import nn

from unmask.parallel.mesh import end_process


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


def _saved_storage(t, parameters: frozenset = frozenset()) -> tuple[int, int] | None:
    """(address, bytes) of the storage a saved tensor holds; None for a parameter or a view
    of one (a linear's transposed weight), or a tensor on a parameter's storage
    (`parameters`: their addresses; an expert stack's local shard under expert parallelism,
    which the grouped GEMM saves)."""
    if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
        return None
    # a functional collective's result (expert parallelism's all-to-alls) wraps the tensor
    # that holds its storage
    local = _local(t)
    local = getattr(local, "elem", local)
    storage = local.untyped_storage()
    if storage.data_ptr() in parameters:
        return None
    return storage.data_ptr(), storage.nbytes()


class _Held:
    """What the graph keeps for one saved tensor: released with the graph."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor) -> None:
        self.tensor = tensor


class LiveSaved:
    """The most bytes autograd holds saved at once (distinct storages, parameters left
    out): a storage counts from its first save until the graph releases its last saved
    reference (a micro-batch's backward frees its graph), so a pipeline schedule's
    micro-batches in flight add up and finished ones drop out."""

    def __init__(self, model: nn.Module) -> None:
        self.refs: dict[tuple[int, int], int] = {}
        self.live = self.most = 0
        self.parameters = frozenset(
            _local(p).untyped_storage().data_ptr() for p in model.parameters()
        )

    def pack(self, t):
        key = _saved_storage(t, self.parameters)
        if key is None:
            return t
        self.refs[key] = self.refs.get(key, 0) + 1
        if self.refs[key] == 1:
            self.live += key[1]
            self.most = max(self.most, self.live)
        held = _Held(t)
        weakref.finalize(held, self._release, key)
        return held

    def _release(self, key) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.live -= key[1]

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held


def step_tracker():
    """torch's MemTracker that allows a module called once per micro-batch in a step (a
    pipeline stage, the model under gradient accumulation): its per-module statistics,
    which such a call would mix, are not read here, only the step's peak."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepTracker(MemTracker):
        def _pre_fw_hook(self, module, inputs) -> None:
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                del self.memory_tracking[module]  # a new micro-batch's call
            super()._pre_fw_hook(module, inputs)

    return StepTracker()


def receive_buffers(runner) -> list[torch.Tensor]:
    """The pipeline stages' receive buffers (hidden states, and their gradients): one per
    micro-batch, made in the first step and reused by every later one."""
    found = []
    for stage in runner.stages:
        for infos in [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]:
            found += [info.buffer for info in infos if info.buffer is not None]
    return found


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
    live = LiveSaved(model)
    objective = trainer.objective
    real_call = type(objective).__call__
    masked = []

    def call_saving(self, model_, batch, generator):
        with torch.autograd.graph.saved_tensors_hooks(live.pack, live.unpack):
            out = real_call(self, model_, batch, generator)
        count = self.last_stats.get("num_masked")
        masked.append(int(count) if count is not None else None)
        return out

    type(objective).__call__ = call_saving
    runner = trainer.pipeline
    if runner is not None:  # the schedule runs the stages: hook its step
        real_run = runner.train_step

        def run_saving(*args, **kwargs):
            with torch.autograd.graph.saved_tensors_hooks(live.pack, live.unpack):
                return real_run(*args, **kwargs)

        runner.train_step = run_saving
    tracker = step_tracker()
    tracker.track_external(model, optimizer, *(receive_buffers(runner) if runner else ()))
    try:
        with tracker:
            trainer.train_step(batches())
    finally:
        type(objective).__call__ = real_call
        if runner is not None:
            runner.train_step = real_run
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
        "saved_activations": live.most,
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
    end_process(0)
