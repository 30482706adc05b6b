"""Optimizer and learning-rate schedule settings, and the optimizer builder."""

from __future__ import annotations

import re
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from unmask.optim.muon import MuonAdamW
from unmask.optim.routing import route_parameters
from unmask.optim.updates import FUSED_ADAMW_DEVICES


class OptimConfig(BaseModel):
    """AdamW, or Muon for hidden matrices + AdamW for everything else."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: Literal["adamw", "muon"] = "adamw"
    """adamw, or muon (Muon on 2-D hidden matrices, AdamW on the rest)."""
    learning_rate: float = Field(1e-3, ge=0)
    """Peak learning rate (AdamW, and Muon unless muon_lr is set)."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay, applied to weight matrices only (never norms or biases)."""
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    """AdamW beta1."""
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    """AdamW beta2."""
    adam_epsilon: float = Field(1e-8, ge=0)
    """AdamW epsilon."""
    max_grad_norm: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this value; 0 = no clipping."""
    lr_scheduler_type: Literal["constant", "linear", "cosine", "constant_with_warmup"] = "constant"
    """Learning-rate schedule after warmup."""
    warmup_steps: float = 0
    """Warmup length: a step count, or a float < 1 = ratio of total steps (wins over warmup_ratio)."""
    warmup_ratio: float = Field(0.0, ge=0, le=1)
    """Warmup as a fraction of total steps (used when warmup_steps is 0)."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Final learning rate of linear/cosine decay, as a fraction of the peak."""
    muon_lr: float | None = Field(None, ge=0)
    """Separate peak learning rate for Muon matrices (None = learning_rate)."""
    momentum: float = Field(0.95, ge=0, lt=1)
    """Muon momentum."""
    nesterov: bool = True
    """Muon Nesterov momentum."""
    ns_steps: int = Field(5, ge=1, lt=100)
    """Newton-Schulz iterations."""
    ns_coefficients: Literal["jordan", "you", "polar_express", "gram"] = "jordan"
    """Newton-Schulz coefficient set / variant."""
    ns_dtype: Literal["auto", "bfloat16", "float32", "float16"] = "auto"
    """Newton-Schulz iteration dtype. auto: bfloat16 on a GPU and on a CPU with native bfloat16
    matmuls (AVX512_BF16 or AMX), float32 on any other CPU, where bfloat16 GEMMs are emulated
    and many times slower; the start-up log names the choice."""
    adjust_lr: Literal["match_rms_adamw", "original", "none"] = "match_rms_adamw"
    """Muon update scaling: 0.2*sqrt(max(A,B)) (Moonlight), sqrt(max(1,A/B)), or none."""
    momentum_style: Literal["sum", "ema"] = "sum"
    """Momentum update: sum M = mu M + G, or ema M = lerp(M, G, 1 - mu) (torch.optim.Muon)."""
    muon_include: list[str] = []
    """Regexes of parameter names forced to Muon (checked before muon_exclude; first match wins)."""
    muon_exclude: list[str] = []
    """Regexes of parameter names forced to AdamW."""
    muon_per_head: bool = False
    """Per-head Muon: attention's q_proj, k_proj and v_proj weights orthogonalized one head
    at a time (each head's (head_dim, hidden) rows as a matrix of its own, its update scaled
    by that shape), the head dim read from the model; docs/muon.md."""
    qk_clip_threshold: float | None = Field(None, gt=0)
    """QK-clip (MuonClip, megatron-core's --qk-clip-threshold): after each optimizer step,
    the query/key projection rows of every key/value group whose largest pre-softmax
    attention logit in the step exceeded this value are scaled down so that it would not
    (None = off; Kimi K2 and Megatron use 100). Native decoders only; docs/muon.md."""
    qk_clip_alpha: float = Field(0.5, ge=0, le=1)
    """QK-clip's split of the scale eta = threshold / max logit: query rows times
    eta ** alpha, key rows times eta ** (1 - alpha) (megatron-core's --qk-clip-alpha)."""

    use_muon: bool | None = None
    """Seed spelling (LMMs-Engine): true sets name: muon, false sets name: adamw (wins over name)."""

    @model_validator(mode="after")
    def _use_muon(self) -> OptimConfig:
        if self.use_muon is not None:
            self.name = "muon" if self.use_muon else "adamw"
        return self

    @field_validator("warmup_steps")
    @classmethod
    def _warmup_steps(cls, v: float) -> float:
        if v < 0 or (v >= 1 and v != int(v)):
            raise ValueError("must be a whole step count or a ratio in [0, 1)")
        return v

    @field_validator("muon_include", "muon_exclude")
    @classmethod
    def _regexes(cls, v: list[str]) -> list[str]:
        for pat in v:
            try:
                re.compile(pat)
            except re.error as err:
                raise ValueError(f"{pat!r} is not a valid regex ({err})") from err
        return v


def build_optimizer(cfg: OptimConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """MuonAdamW, or torch AdamW with the same grouping as MuonAdamW's AdamW side.

    AdamW: weight decay on every matrix (Muon's matrices, embeddings, head, LoRA factors),
    none on norms, biases and 1-D parameters. Frozen parameters are left out. Both take
    torch's fused AdamW kernel where it exists for the parameters' device (CPU, CUDA): one
    pass over the memory instead of one per operation (several times faster than torch's
    default CPU path), within about 1 ulp per step of the plain path
    (tests/unit/test_muon.py); on CPU its rounding also depends by about 1 ulp on where FSDP2
    shards cut a tensor (see MuonAdamW's ``fused``).
    """
    betas = (cfg.adam_beta1, cfg.adam_beta2)
    trainable = [p for p in model.parameters() if p.requires_grad]
    fused = all(p.device.type in FUSED_ADAMW_DEVICES and p.is_floating_point() for p in trainable)
    if cfg.name == "muon":
        return MuonAdamW(
            model,
            verbose=False,  # the trainer prints the split through its own logger
            lr=cfg.learning_rate,
            weight_decay=cfg.weight_decay,
            betas=betas,
            eps=cfg.adam_epsilon,
            muon_lr=cfg.muon_lr,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov,
            ns_steps=cfg.ns_steps,
            ns_coefficients=cfg.ns_coefficients,
            ns_dtype=cfg.ns_dtype,
            adjust_lr=cfg.adjust_lr,
            momentum_style=cfg.momentum_style,
            muon_include=tuple(cfg.muon_include),
            muon_exclude=tuple(cfg.muon_exclude),
            fused=fused,
            per_head=cfg.muon_per_head,
        )
    routing = route_parameters(model)
    decay = routing.muon + routing.adamw_decay
    groups = [
        {"params": named, "weight_decay": wd}
        for named, wd in ((decay, cfg.weight_decay), (routing.adamw_no_decay, 0.0))
        if named
    ]
    return torch.optim.AdamW(
        groups, lr=cfg.learning_rate, betas=betas, eps=cfg.adam_epsilon, fused=fused
    )
