"""Several processes: the layout's one owner (dims.py `ParallelDims`: degrees, checks, the
world mesh and the experts' grid), the process group from the launcher's environment,
FSDP2 / HSDP, tensor, context, expert and pipeline parallelism on given modules, each rank's
share of a batch. Knows meshes, modules and tensors only; the trainer decides what to shard
and how to split its batches."""
