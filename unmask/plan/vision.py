"""DiffusionGemma's vision tower in `unmask plan`: what the tower and the projector of a
`model.pretrained` folder add to a rank's memory and a step's FLOPs, trained or frozen
(`model.freeze_vision`; models/diffusion_gemma_vision.py).

- Parameters: the folder's vision_config built on the meta device and counted.
- Weights: frozen and held apart (freeze_vision true), whole on every rank in the master
  weights' dtype (float32), as the trainer holds them; registered (a trained part), FSDP2-
  sharded over the ranks like the text model (float32 masters), one layer gathered at a
  time on top.
- Gradients and optimizer state: the trained part's only, sharded (float32 gradients; AdamW
  8 bytes a parameter; under Muon the tower layers' matrices 4, the rest AdamW's 8:
  optim/routing.py's rule, docs/multimodal.md).
- Activations: what a trained tower saves for backward over one micro-batch's pictures, its
  patch embedding and layers traced under FakeTensorMode with saved-tensor hooks (each
  storage once, parameters left out, as plan/memory.py traces the text layers), plus its
  pooling's and the projector's inputs (modelled); a frozen tower saves nothing (its
  forward runs without a graph).
- FLOPs: `tower_flops` (the MFU's count) of the step's pictures.

The pictures: one per row at the folder's image processor's largest size
(preprocessor_config.json `max_soft_tokens`, transformers' default 280 soft tokens:
280 k^2 patches), the most a row of the processor's output carries per picture.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

from unmask.models.diffusion_gemma_vision import (
    LORA_PROJECTOR,
    LORA_TOWER,
    Vision,
    tower_flops,
    trained_parts,
    vision_registered,
)
from unmask.models.lora import VISION_TARGETS
from unmask.plan.planner import step_rows
from unmask.plan.report import human_bytes
from unmask.plan.shards import parallel_of, planned_model_config

MAX_SOFT_TOKENS = 280
"""transformers' Gemma 4 image processor's default `max_soft_tokens`."""


@dataclass(frozen=True)
class TowerPlan:
    """The tower's share of one rank's memory (bytes) and of one step's FLOPs."""

    parameters: int
    trained: int
    """Of the parameters, those that train (freeze_vision)."""
    freeze_vision: bool | str
    adapters: int
    """LoRA factors' parameters on the tower's and the projector's linear maps (vision_tower /
    embed_vision in lora_target_modules): they train (float32, AdamW), the base stays frozen."""
    pictures: int
    """Pictures per rank and micro-batch (one per row)."""
    patches: int
    """Patches per picture."""
    weights: int
    gradients: int
    optimizer: int
    activations: int
    flops: float
    """FLOPs per rank and step (every micro-batch)."""

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations

    def to_json(self) -> dict:
        return {**asdict(self), "total": self.total}


def folder_vision_config(folder: str | Path) -> dict | None:
    """The folder's config.json if it is a diffusion_gemma one with a vision_config (None
    otherwise)."""
    path = Path(folder) / "config.json"
    try:
        source = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if source.get("model_type") != "diffusion_gemma":  # the one family with a tower here
        return None
    return source if isinstance(source.get("vision_config"), dict) else None


def max_soft_tokens(folder: str | Path) -> int:
    path = Path(folder) / "preprocessor_config.json"
    try:
        return int(json.loads(path.read_text()).get("max_soft_tokens") or MAX_SOFT_TOKENS)
    except (OSError, json.JSONDecodeError, TypeError, ValueError, AttributeError):
        return MAX_SOFT_TOKENS


class _FusedAttentionShapes(torch.autograd.Function):
    """scaled_dot_product_attention as a fused kernel (flash / memory-efficient, the CPU's
    flash kernel) saves for backward: q, k, v, the output, the float32 log-sum-exp per
    query and head, and the mask in q's dtype; shapes only."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        # (B, heads, L, D) in the fused kernels' (B, L, heads, D) layout
        batch, heads, length = q.shape[:3]
        out = q.new_empty((batch, length, heads, v.shape[-1])).transpose(1, 2)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse, mask.to(q.dtype))
        return out

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - the trace runs no backward
        raise RuntimeError("a shape-only stand-in for the planner's forward trace")

    @staticmethod
    def call(q, k, v, attn_mask=None, scale=None):
        return _FusedAttentionShapes.apply(q, k, v, attn_mask)


def traced_tower_saves(vision: Vision, pictures: int, patches: int, dtype: torch.dtype) -> int:
    """Bytes the tower's patch embedding and layers save for backward over `pictures`
    pictures of `patches` patches, with its requires_grad as set: its forward on the meta
    device (no storage, `vision` built there) under saved-tensor hooks, parameters left
    out, each storage once."""
    tower = vision.vision_tower.to(dtype)
    params = {p.untyped_storage()._cdata for p in vision.parameters()}
    seen: set[int] = set()
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key not in params and key not in seen:
            seen.add(key)
            total[0] += t.untyped_storage().nbytes()
        return t

    with torch.device("meta"):
        pixels = torch.zeros(pictures, patches, 3 * tower.cfg["patch_size"] ** 2, dtype=dtype)
        positions = torch.zeros(pictures, patches, 2, dtype=torch.long)
        padding = torch.zeros(pictures, patches, dtype=torch.bool)
    # attention as a fused kernel saves it (the meta device would decompose it into the
    # P x P scores, which no fused kernel keeps)
    fused = mock.patch.object(F, "scaled_dot_product_attention", _FusedAttentionShapes.call)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), fused:
        x = tower.patch_embedder(pixels, positions, padding)
        for layer in tower.encoder.layers:
            x = layer(x, positions, ~padding)
    return total[0]


def lora_adapters(vision: Vision, model) -> dict[str, int]:
    """LoRA factors' parameters on the tower's and the projector's linear maps, by
    lora_target_modules entry (models/lora.py VISION_TARGETS: the modules peft adapts,
    r x (in + out) each); 0 for a part not targeted."""
    targets = model.lora_target_modules if model.lora else None
    count = dict.fromkeys((LORA_TOWER, LORA_PROJECTOR), 0)
    if not isinstance(targets, list):
        return count
    for name, pattern in VISION_TARGETS.items():
        if name not in targets:
            continue
        for path, module in vision.named_modules(prefix="model.encoder"):
            if isinstance(module, torch.nn.Linear) and re.fullmatch(pattern, path):
                count[name] += model.lora_r * (module.in_features + module.out_features)
    return count


def plan_tower(cfg, world_size: int) -> TowerPlan | None:
    """The TowerPlan of a run config (`RunConfig`) at `world_size` ranks, or None when its
    model has no vision tower (no pretrained folder, or one without vision_config)."""
    folder = cfg.model.pretrained
    source = folder_vision_config(folder) if folder is not None else None
    if source is None:
        return None
    text_hidden = int((source.get("text_config") or {}).get("hidden_size") or 0)
    with torch.device("meta"):
        vision = Vision(source, text_hidden)
    tower_trains, projector_trains = trained_parts(cfg.model.freeze_vision)
    adapters = lora_adapters(vision, cfg.model)
    vision.requires_grad_(False)
    vision.vision_tower.requires_grad_(tower_trains)
    vision.embed_vision.requires_grad_(projector_trains)
    parts = {"tower": (vision.vision_tower, tower_trains),
             "projector": (vision.embed_vision, projector_trains)}  # fmt: skip
    count = {name: sum(p.numel() for p in m.parameters()) for name, (m, _) in parts.items()}
    total = sum(count.values())
    trained = sum(count[name] for name, (_, trains) in parts.items() if trains)
    registered = vision_registered(cfg.model)
    # a part with LoRA factors runs its backward as a trained one (the factors' gradients),
    # as the trainer's MFU counts it (tower_flop_model: a part with a parameter to train)
    tower_trains = tower_trains or adapters[LORA_TOWER] > 0
    projector_trains = projector_trains or adapters[LORA_PROJECTOR] > 0
    adapted = sum(adapters.values())
    k = vision.vision_tower.cfg["pooling_kernel_size"]
    soft = max_soft_tokens(folder)
    patches = soft * k * k
    # the text plan's rows per rank and micro-batches (split_batches, pipeline schedules)
    planned = planned_model_config(cfg)
    rows, micro = step_rows(planned, parallel_of(planned, world_size))
    bf16 = cfg.train.bf16
    b = 2 if bf16 else 4
    hidden = vision.vision_tower.cfg["hidden_size"]
    if registered:  # FSDP2-sharded float32 masters, one tower layer gathered (compute dtype)
        layer = sum(p.numel() for p in vision.vision_tower.encoder.layers[0].parameters())
        weights = 4 * (total + adapted) // world_size + (b * layer if world_size > 1 else 0)
    else:  # held apart: whole on every rank
        weights = 4 * total
    gradients = 4 * (trained + adapted) // world_size
    muon_matrices = 0
    if cfg.optim.name == "muon" and tower_trains:
        muon_matrices = sum(p.numel() for name, p in vision.vision_tower.named_parameters()
                            if ".layers." in name and p.ndim == 2)  # fmt: skip
    optimizer = (8 * (trained + adapted) - 4 * muon_matrices) // world_size  # LoRA: AdamW
    activations = 0
    if tower_trains:  # LoRA's factors keep their linear maps' inputs: a trained tower's saves
        vision.vision_tower.requires_grad_(True)
        dtype = torch.bfloat16 if bf16 else torch.float32
        activations = traced_tower_saves(vision, rows, patches, dtype)
        activations += rows * patches * hidden * 4 + rows * patches * soft * 4  # pooling
    if tower_trains or projector_trains:  # the projector's input, normed
        activations += rows * soft * hidden * (4 + b)
    flops = micro * tower_flops(vision.vision_tower.cfg, text_hidden, rows, patches, rows * soft,
                                tower_trains, projector_trains)  # fmt: skip
    return TowerPlan(parameters=total, trained=trained, freeze_vision=cfg.model.freeze_vision,
                     adapters=adapted,
                     pictures=rows, patches=patches, weights=weights, gradients=gradients,
                     optimizer=optimizer, activations=activations, flops=float(flops))  # fmt: skip


def tower_lines(tower: TowerPlan, peak: int, limit: int, compute_s: float,
                step_flops: float) -> list[str]:  # fmt: skip
    """What `unmask plan` prints for the tower: its share of a rank's memory beside the
    text model's worst peak, and of the step's compute at the plan's MFU."""
    if tower.adapters:
        state = (f"LoRA: {tower.adapters / 1e6:.3f} M adapter parameters trained on the frozen "
                 "base, registered and FSDP2-sharded, with backward")  # fmt: skip
    elif tower.trained:
        state = (f"freeze_vision {tower.freeze_vision!r}: {tower.trained / 1e9:.3f} B of them "
                 "trained, FSDP2-sharded")  # fmt: skip
    else:
        state = "frozen (held apart: whole on every rank, forward only)"
    seconds = compute_s * tower.flops / step_flops if step_flops else 0.0
    verdict = "fits" if peak + tower.total <= limit else "DOES NOT FIT"
    return [
        f"vision tower: {tower.parameters / 1e9:.3f} B parameters, {state}; "
        f"{tower.pictures} picture(s) of {tower.patches} patches per rank and micro-batch",
        f"  per rank: weights {human_bytes(tower.weights)}, gradients "
        f"{human_bytes(tower.gradients)}, optimizer {human_bytes(tower.optimizer)}, "
        f"activations {human_bytes(tower.activations)}; peak with it "
        f"{human_bytes(peak + tower.total)} of {human_bytes(limit)} ({verdict})",
        f"  {tower.flops / 1e12:.2f} TFLOPs per rank and step: +{seconds:.3f} s at the plan's MFU",
    ]
