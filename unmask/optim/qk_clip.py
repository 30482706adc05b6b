"""QK-clip (MuonClip): the per-head scale factors and their application to the query and
key projection weights, as megatron-core 0.16 defines them
(``megatron/core/transformer/attention.py``: ``Attention.clip_qk`` and
``Attention._clip_linear_qkv``).

After an optimizer step, each key/value group g (the query heads that read key head g:
``Hq / Hkv`` of them, one under MHA) whose largest pre-softmax logit of the step ``m_g``
(the max over its query heads) exceeds the threshold tau gets ``eta_g = tau / m_g``: the
rows of its query heads are multiplied by ``eta_g ** alpha`` and the rows of its key head by
``eta_g ** (1 - alpha)``, so its logits shrink by ``eta_g``. Groups at or below tau keep
their weights (eta 1). Only the weights: megatron-core scales neither the projections'
biases nor the optimizer state (Muon's momentum, AdamW's moments); neither is scaled here.
The capture of the max logits is in models/attention.py (``head_max_logits``), the
reductions across ranks in train/qk_clip.py.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor


def clip_factors(
    max_logits: Tensor, kv_heads: int, threshold: float, alpha: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-head scale factors of one attention layer from its per-query-head max logits.

    max_logits: (Hq,) float32 (query head h reads key head h // (Hq / kv_heads)). Returns
    (query factors (Hq,), key factors (kv_heads,), clipped (kv_heads,) bool). eta is
    megatron-core's expression ``threshold / grouped`` where a group exceeds the threshold
    (it clamps the rest to 1; here they are 1 by construction, which also keeps a group
    whose logits are all negative unscaled, where the clamp would give a negative eta)."""
    grouped = max_logits.float().reshape(kv_heads, -1).amax(dim=1)
    clipped = grouped > threshold
    eta = torch.where(clipped, threshold / grouped, torch.ones_like(grouped))
    per_group = max_logits.shape[0] // kv_heads
    query = torch.pow(eta, alpha).repeat_interleave(per_group)
    key = torch.pow(eta, 1 - alpha)
    return query, key, clipped


def scale_head_rows_(weight: Tensor, factors: Tensor, head_dim: int) -> None:
    """Multiply the rows of each head of a (heads x head_dim, hidden) projection weight by
    that head's factor, in place. A DTensor (FSDP2 shards, tensor-parallel heads, both)
    has its local rows scaled by the factors of the heads they belong to: the factors
    (the whole model's heads, the same on every rank) are laid out as the weight is
    (``distribute_tensor`` from this rank's copy, no communication)."""
    rows = factors.repeat_interleave(head_dim)[:, None]
    with torch.no_grad():
        if isinstance(weight, DTensor):
            rows = rows.to(device=weight.device, dtype=weight.dtype)
            laid = distribute_tensor(rows, weight.device_mesh, weight.placements,
                                     src_data_rank=None)  # fmt: skip
            local = weight.to_local()
            if local.numel():
                local.mul_(laid.to_local())
            return
        weight.mul_(rows.to(device=weight.device, dtype=weight.dtype))
