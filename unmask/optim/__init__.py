"""Optimizers: MuonAdamW (Muon on hidden matrices, AdamW on the rest) and its config.

``from unmask.optim import MuonAdamW`` works in any training loop::

    opt = MuonAdamW(model, lr=1e-3, weight_decay=0.1)

The batched Newton-Schulz kernels live in ``unmask.optim.newton_schulz`` (not re-exported
here, so the submodule name is not shadowed by its function).
"""

from unmask.optim.config import OptimConfig, build_optimizer
from unmask.optim.muon import MuonAdamW, Routing, lr_scale, route_parameters
from unmask.optim.newton_schulz import coefficient_schedule, orthogonalize

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
