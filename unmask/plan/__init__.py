"""`unmask plan`: a run's layout priced per rank before it is launched, by running the run's
own mesh and parallelize code at cluster size under torch's fake process group on the
meta device (docs/scaling.md).

Modules: devices (the device table), shards (every parameter's shard on a rank, from the
trainer's own build), memory (state, activation and peak bytes: the decoder's walk),
canvas_memory (a canvas decoder's walk), memory_models (the walk a family's shape names),
traffic (collectives per mesh dim), planner (`make_run_plan`: the whole plan), report (text,
the refusal line), checkpointing (`activation_checkpointing: auto`), vision (a vision
tower's share).
"""

from unmask.plan.devices import DEVICES, Device, resolve_device
from unmask.plan.planner import RunPlan, make_run_plan

__all__ = ["DEVICES", "Device", "RunPlan", "make_run_plan", "resolve_device"]
