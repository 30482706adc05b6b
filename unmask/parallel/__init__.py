"""Several processes: process group and device mesh from the launcher's environment,
FSDP2 / HSDP on given modules, each rank's share of a batch. Knows meshes, modules and
tensors only; the trainer decides what to shard and how to split its batches."""
