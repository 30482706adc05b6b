"""QK-clip in a run (optim.qk_clip_threshold): the capture switched on in every native
attention layer, the step's per-head max logits reduced across ranks, the clip applied
after the optimizer step, and the step's metrics.

Each native `Attention` (models/transformer.py) keeps `qk_logits`, the running max over the
step's training forwards of its heads' largest pre-softmax logit (models/attention.py
`head_max_logits`, over whole rows: under context parallelism each rank fills in the heads
it attends with). After the optimizer step the layers' maxima are reduced (max) over the
"dp_cp" ranks (different rows, and the cp ranks' heads), gathered over the tensor-parallel
ranks (each holds heads / tp of them), and each layer's query/key weights are scaled
(optim/qk_clip.py), every rank its own shards of them (FSDP2, TP); a pipeline stage clips
the layers it holds. Megatron-core's order: ``clip_qk`` after ``optimizer.step()``,
the weights only (no optimizer state).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from unmask.errors import InputError
from unmask.models.transformer import Attention
from unmask.optim.qk_clip import clip_factors, scale_head_rows_
from unmask.parallel.mesh import sub_mesh

if TYPE_CHECKING:  # pragma: no cover
    from unmask.optim.config import OptimConfig
    from unmask.parallel.distributed import DistState


def _group(mesh, *names: str):
    """The process group of mesh dims `names`, None without a mesh or when of size 1."""
    if mesh is None:
        return None
    sub = sub_mesh(mesh, *names)
    return sub.get_group() if sub.size() > 1 else None


class QKClip:
    """The capture and the clip of one run's model (this rank's share of it)."""

    def __init__(self, model: torch.nn.Module, threshold: float, alpha: float,
                 device: torch.device, mesh=None) -> None:  # fmt: skip
        self.threshold, self.alpha, self.device = threshold, alpha, device
        self.layers = [m for m in model.modules() if isinstance(m, Attention)]
        # q/k RMSNorm after the projections (Qwen3): it undoes most of a row scale
        self.normed = any(not isinstance(m.q_norm, torch.nn.Identity) for m in self.layers)
        self.tp = 1 if mesh is None else mesh["tp"].size()
        self.rows_group = _group(mesh, "dp_cp")  # ranks with other rows or other heads
        self.tp_group = _group(mesh, "tp")
        self.stages = _group(mesh, "pp")
        for layer in self.layers:
            layer.qk_logits = torch.full((layer.num_heads // self.tp,), -math.inf,
                                         device=device)  # fmt: skip

    def after_step(self, update: bool = True) -> dict[str, torch.Tensor]:
        """The step's max logits reduced, the clip applied (when `update`: the optimizer
        step ran) and the capture reset; returns `qk_max_logit` (the largest over every
        layer and head of the model) and `qk_clipped_heads` (query heads scaled: those of
        the key/value groups over the threshold, summed over layers), 0-d device tensors.
        Collective over the whole run: every rank calls it after every step."""
        if not self.layers:  # a pipeline stage without attention still joins the reductions
            peak = torch.full((), -math.inf, device=self.device)
            return self._summed(peak, torch.zeros((), device=self.device))
        local = torch.stack([layer.qk_logits for layer in self.layers])  # (layers, H / tp)
        if self.rows_group is not None:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.rows_group)
        logits = local
        if self.tp_group is not None:  # every rank: all heads, in tp-rank order
            parts = [torch.empty_like(local) for _ in range(self.tp)]
            dist.all_gather(parts, local.contiguous(), group=self.tp_group)
            logits = torch.cat(parts, dim=1)
        clipped_heads = torch.zeros((), device=local.device)
        for layer, maxima in zip(self.layers, logits):
            query, key, clipped = clip_factors(maxima, layer.num_kv_heads, self.threshold,
                                               self.alpha)  # fmt: skip
            clipped_heads += clipped.sum() * (layer.num_heads // layer.num_kv_heads)
            if update:  # factors of 1 (groups under the threshold) leave rows exactly as
                # they are: scaling every layer needs no device read to decide which
                scale_head_rows_(layer.q_proj.weight, query, layer.head_dim)
                scale_head_rows_(layer.k_proj.weight, key, layer.head_dim)
            layer.qk_logits.fill_(-math.inf)
        return self._summed(logits.max(), clipped_heads)

    def _summed(self, peak: torch.Tensor, heads: torch.Tensor) -> dict:
        """The metrics over the pipeline's stages (each holds some layers)."""
        if self.stages is not None:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.stages)
            dist.all_reduce(heads, group=self.stages)
        return {"qk_max_logit": peak, "qk_clipped_heads": heads}


def build_qk_clip(cfg: OptimConfig, model: torch.nn.Module, device: torch.device,
                  dist_state: DistState | None = None,
                  lora: bool = False) -> QKClip | None:  # fmt: skip
    """QKClip for optim.qk_clip_threshold (None when off), or a one-line InputError for a
    model it cannot clip: one without native attention layers (wrapped transformers
    models, families with attention of their own) or with LoRA adapters (the projections
    are frozen)."""
    if cfg.qk_clip_threshold is None:
        return None
    key = f"optim.qk_clip_threshold={cfg.qk_clip_threshold}"
    if lora:
        raise InputError(f"{key} scales the query/key projections, which model.lora freezes; "
                         "set optim.qk_clip_threshold: null")  # fmt: skip
    mesh = None if dist_state is None else dist_state.mesh
    clip = QKClip(model, cfg.qk_clip_threshold, cfg.qk_clip_alpha, device, mesh)
    stage_of_pipeline = mesh is not None and mesh["pp"].size() > 1
    if not clip.layers and not stage_of_pipeline:
        raise InputError(f"{key} needs unmask's native decoder attention (q_proj / k_proj "
                         "per head); this model has none: set optim.qk_clip_threshold: "
                         "null")  # fmt: skip
    return clip
