"""Optimizers: MuonAdamW (Muon on hidden matrices, AdamW on the rest) and its config.

``from unmask.optim import MuonAdamW`` works in any training loop::

    opt = MuonAdamW(model, lr=1e-3, weight_decay=0.1)

Modules, each depending only on those above it:

* ``newton_schulz``: the batched Newton-Schulz kernels and coefficient schedules (not
  re-exported here, so the submodule name is not shadowed by its function);
* ``routing``: which parameters get Muon, AdamW with decay, or AdamW without;
* ``updates``: the per-matrix Muon and AdamW arithmetic both Muon paths share;
* ``distributed``: Muon on FSDP2/HSDP DTensors (the owner all-to-all);
* ``muon``: the ``MuonAdamW`` optimizer;
* ``config``: ``OptimConfig`` and ``build_optimizer``; ``schedule``: learning-rate schedules.
"""

from unmask.optim.config import OptimConfig, build_optimizer
from unmask.optim.muon import MuonAdamW
from unmask.optim.newton_schulz import coefficient_schedule, orthogonalize
from unmask.optim.routing import Routing, route_parameters
from unmask.optim.updates import lr_scale

__all__ = [
    "MuonAdamW",
    "OptimConfig",
    "Routing",
    "build_optimizer",
    "coefficient_schedule",
    "lr_scale",
    "orthogonalize",
    "route_parameters",
]
